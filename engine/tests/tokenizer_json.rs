//! A Hugging Face `tokenizer.json` built from the real model's GGUF vocabulary
//! (`tokenizer_json::from_metadata`, what `engine/scripts/make-tokenizer-json`
//! writes), run by the `tokenizers` crate: the same ids as llama.cpp on the oracle
//! prompts, the same ids and text as the GGUF tokenizer on 2,000 random strings, the
//! same special tokens; and the start-up checks on such a file (embedding size,
//! special-token ids). Fails (never skips) when the model or the oracle is missing.

use std::sync::OnceLock;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::template::{ChatTemplate, RenderOptions};
use slipway_engine::testing;
use slipway_engine::tokenizer::{
    DecodeOptions, EncodeOptions, IncrementalDecoder, TokenType, Tokenizer, TokenizerError,
    tokenizer_json,
};

fn model() -> &'static GgufFile {
    static MODEL: OnceLock<GgufFile> = OnceLock::new();
    MODEL.get_or_init(|| GgufFile::open(&testing::model_path()).expect("open test model"))
}

fn gguf() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_metadata(model().metadata()).expect("GGUF tokenizer"))
}

fn json() -> &'static Value {
    static JSON: OnceLock<Value> = OnceLock::new();
    JSON.get_or_init(|| tokenizer_json::from_metadata(model().metadata()).expect("tokenizer.json"))
}

fn hf_from(json: &Value) -> Result<Tokenizer, TokenizerError> {
    let bytes = serde_json::to_vec(json).expect("serialize");
    Tokenizer::from_tokenizer_json(model().metadata(), &bytes)
}

fn hf() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| hf_from(json()).expect("load the generated tokenizer.json"))
}

/// Both decoders, streaming and whole, with and without special tokens, agree.
fn assert_same_text(ids: &[u32], what: &str) {
    for skip_special in [false, true] {
        let options = DecodeOptions { skip_special };
        let want = gguf().decode_with(ids, options).expect("GGUF decode");
        let got = hf()
            .decode_with(ids, options)
            .expect("tokenizer.json decode");
        assert_eq!(got, want, "{what}: decode (skip_special {skip_special})");
        let mut d = IncrementalDecoder::new(options);
        let mut streamed = String::new();
        for &id in ids {
            streamed.push_str(&d.push(hf(), id).expect("push"));
        }
        streamed.push_str(&d.finish());
        assert_eq!(
            streamed, want,
            "{what}: streamed (skip_special {skip_special})"
        );
    }
}

#[test]
fn the_file_describes_a_byte_level_bpe_with_the_smollm_splits() {
    let j = json();
    assert_eq!(j["model"]["type"], "BPE");
    assert_eq!(
        j["model"]["vocab"].as_object().map(|v| v.len()),
        Some(49152)
    );
    assert_eq!(j["model"]["merges"].as_array().map(Vec::len), Some(48900));
    assert_eq!(j["added_tokens"].as_array().map(Vec::len), Some(17));
    assert_eq!(j["pre_tokenizer"]["pretokenizers"][0]["type"], "Split");
    assert_eq!(j["pre_tokenizer"]["pretokenizers"][1]["type"], "ByteLevel");
    assert_eq!(j["post_processor"], Value::Null, "SmolLM2 adds no BOS");
    assert!(hf().is_tokenizer_json() && !gguf().is_tokenizer_json());
    assert_eq!(hf().vocab_size(), gguf().vocab_size());
}

#[test]
fn tokenizer_json_gives_llama_cpp_ids_on_every_oracle_prompt() {
    let oracle = testing::oracle();
    assert!(!oracle.prompts.is_empty());
    let mut failures = Vec::new();
    for p in &oracle.prompts {
        let ours = hf().encode(&p.prompt);
        if ours != p.prompt_tokens {
            failures.push(format!(
                "{}: {:?}\n  llama.cpp:      {:?}\n  tokenizer.json: {:?}",
                p.id, p.prompt, p.prompt_tokens, ours
            ));
        }
        assert_eq!(hf().decode(&p.prompt_tokens).unwrap(), p.prompt, "{}", p.id);
        let all: Vec<u32> = p
            .prompt_tokens
            .iter()
            .chain(&p.continuation)
            .copied()
            .collect();
        assert_same_text(&all, &p.id);
    }
    assert!(
        failures.is_empty(),
        "{} of {} prompts differ:\n{}",
        failures.len(),
        oracle.prompts.len(),
        failures.join("\n")
    );
}

/// Character pools that stress the pre-tokenizer (those of
/// `engine/scripts/diff-tokenizer`, plus C0 controls that have a byte token).
const POOLS: &[&str] = &[
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "      \t\n\n\r",
    "'sdtmlrevSDTMLREV",
    ".,;:!?-_()[]{}<>|/\\\"@#$%^&*+=~`",
    "éèêàçôüßñøåæœÀÉÎÕ",
    "先保护用户等待时间再谈跑得有多满这句话的意思是，。！？",
    "🚀🔥👩\u{200d}💻😀🎉❤️\u{fe0f}",
    "αβγδεΣΩжзийклмнДЖ",
    "²³¹¼½①②٣٤٥߁१२३",
    "\u{a0}\u{2003}\u{3000}\u{2028}\u{85}\u{200b}\u{ad}",
    "\u{1F600}\u{10348}\u{1D400}",
    "ـًٌٍَُِّْ",
    "ก่อนหน้านี้",
    "\u{1}\u{2}\u{7}\u{8}\u{b}\u{c}\u{1b}\u{7f}",
];
const SPECIALS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<repo_name>",
    "<jupyter_output>",
    "<|im_start",
    "im_end|>",
];

fn random_text(rng: &mut StdRng) -> String {
    let mut text = String::new();
    for _ in 0..rng.random_range(1..=12) {
        if rng.random::<f64>() < 0.08 {
            text.push_str(SPECIALS[rng.random_range(0..SPECIALS.len())]);
        } else {
            let pool: Vec<char> = POOLS[rng.random_range(0..POOLS.len())].chars().collect();
            for _ in 0..rng.random_range(1..=8) {
                text.push(pool[rng.random_range(0..pool.len())]);
            }
        }
    }
    text
}

#[test]
fn tokenizer_json_matches_the_gguf_tokenizer_on_2000_random_strings() {
    let mut rng = StdRng::seed_from_u64(16);
    let mut failures = Vec::new();
    let literal = EncodeOptions {
        add_special: true,
        parse_special: false,
    };
    for _ in 0..2000 {
        let text = random_text(&mut rng);
        assert!(
            gguf().can_round_trip(&text),
            "{text:?}: the pools hold only bytes with tokens"
        );
        let want = gguf().encode(&text);
        let got = hf().encode(&text);
        if got != want {
            failures.push(format!(
                "{text:?}\n  GGUF:           {want:?}\n  tokenizer.json: {got:?}"
            ));
            continue;
        }
        // Special-token text read as text, as llama.cpp's parse_special = false.
        let (want_literal, got_literal) = (
            gguf().encode_with(&text, literal),
            hf().encode_with(&text, literal),
        );
        if got_literal != want_literal {
            failures.push(format!(
                "{text:?} (parse_special off)\n  GGUF:           {want_literal:?}\n  tokenizer.json: {got_literal:?}"
            ));
        }
        assert_eq!(hf().decode(&got).unwrap(), text, "round trip");
        assert_same_text(&got, &text);
    }
    assert!(
        failures.is_empty(),
        "{} of 2000 strings differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn bytes_without_a_token_are_dropped_by_both() {
    // SmolLM2 has no token for byte 0x04 (nor 0x06, 0x13, 0x14, 0x16, 0x1D). Both
    // drop it; llama.cpp keeps it as a merge barrier, the crate does not, so where
    // it separates two symbols that merge, the ids differ but the text is the same.
    for text in ["a\u{4}b", "u\u{13}nits", "\u{e9}\u{1d}", "!!\u{4}!!"] {
        let (want, got) = (gguf().encode(text), hf().encode(text));
        assert_eq!(
            gguf().decode(&want).unwrap(),
            hf().decode(&got).unwrap(),
            "{text:?}"
        );
    }
    // "!!" is one token; llama.cpp cannot merge across the dropped byte, the crate can.
    assert_eq!(gguf().encode("!!\u{4}!!"), [10095, 10095]);
    assert_eq!(hf().encode("!!\u{4}!!"), [36689]);
    assert_eq!(hf().encode("u\u{13}nits"), [101, 94, 842]);
}

#[test]
fn special_tokens_are_the_models_whichever_vocabulary_encodes() {
    assert_eq!(hf().bos(), gguf().bos());
    assert_eq!(hf().eos(), gguf().eos());
    assert_eq!(hf().eog_tokens(), gguf().eog_tokens());
    assert_eq!(hf().eog_tokens(), [0, 2]);
    for id in 0..20 {
        assert_eq!(hf().token_type(id), gguf().token_type(id), "{id}");
        assert_eq!(hf().token_text(id), gguf().token_text(id), "{id}");
    }
    assert_eq!(hf().token_type(1), Some(TokenType::Control));
    assert_eq!(hf().token_id("<|im_end|>"), Some(2));
    // The chat template gets the same BOS/EOS strings, so it renders the same.
    let messages = testing::oracle()
        .prompts
        .iter()
        .find_map(|p| p.chat.clone())
        .expect("a chat prompt in the oracle");
    let render = |t: &Tokenizer| {
        ChatTemplate::from_metadata(model().metadata(), t)
            .unwrap()
            .render(&messages, RenderOptions::default())
            .unwrap()
    };
    assert_eq!(render(hf()), render(gguf()));
}

/// The generated file with one more added token, at `id`.
fn with_added_token(id: usize) -> Value {
    let mut j = json().clone();
    j["added_tokens"]
        .as_array_mut()
        .expect("added_tokens")
        .push(
            json!({"id": id, "content": "<|extra|>", "single_word": false, "lstrip": false,
                     "rstrip": false, "normalized": false, "special": true}),
        );
    j
}

#[test]
fn a_vocabulary_larger_than_the_embedding_is_refused_with_both_sizes() {
    let rows = model()
        .tensor_info("token_embd.weight")
        .expect("embedding")
        .dims[1] as usize;
    assert_eq!(rows, 49152);
    hf().check_fits_embedding(rows)
        .expect("the equivalent file fits");

    let bigger = hf_from(&with_added_token(rows)).expect("a valid tokenizer.json");
    assert_eq!(bigger.vocab_size(), rows + 1);
    let error = bigger
        .check_fits_embedding(rows)
        .expect_err("one id past the embedding");
    assert!(
        matches!(error, TokenizerError::VocabularyTooLarge { ids, embedding_rows }
            if ids == rows + 1 && embedding_rows == rows),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("49152") && message.contains("rows"),
        "{message}"
    );

    // Through the start-up path, from a file.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&with_added_token(rows)).unwrap()).unwrap();
    let error = Tokenizer::for_model(model(), Some(&path), None).expect_err("refused");
    assert!(
        matches!(error, TokenizerError::VocabularyTooLarge { .. }),
        "{error}"
    );
    // A file that fits loads the same way.
    std::fs::write(&path, serde_json::to_vec(json()).unwrap()).unwrap();
    let ok = Tokenizer::for_model(model(), Some(&path), None).expect("fits");
    assert!(ok.is_tokenizer_json());
}

#[test]
fn a_special_token_of_the_model_missing_from_the_file_is_refused() {
    let mut j = json().clone();
    j["model"]["vocab"]
        .as_object_mut()
        .expect("vocab")
        .remove("<|im_end|>");
    j["added_tokens"]
        .as_array_mut()
        .expect("added_tokens")
        .retain(|t| t["id"] != 2);
    let error = hf_from(&j).expect_err("EOS (2) is gone");
    assert!(
        matches!(
            error,
            TokenizerError::SpecialTokenMissing {
                key: "tokenizer.ggml.eos_token_id",
                id: 2
            }
        ),
        "{error:?}"
    );
}

#[test]
fn unreadable_tokenizer_json_is_refused() {
    let error = Tokenizer::from_tokenizer_json(model().metadata(), b"{\"version\": ").unwrap_err();
    assert!(
        matches!(error, TokenizerError::TokenizerJson(_)),
        "{error:?}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let error =
        Tokenizer::for_model(model(), Some(&dir.path().join("absent.json")), None).unwrap_err();
    assert!(matches!(error, TokenizerError::Read { .. }), "{error:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any ids, including ones that cut characters or make invalid UTF-8: the crate's
    /// streaming decoder equals its whole decode, which equals the GGUF's.
    #[test]
    fn any_ids_decode_and_stream_as_the_gguf_vocabulary_does(
        ids in proptest::collection::vec(0u32..49152, 0..48)
    ) {
        for skip_special in [false, true] {
            let options = DecodeOptions { skip_special };
            let want = gguf().decode_with(&ids, options).unwrap();
            prop_assert_eq!(hf().decode_with(&ids, options).unwrap(), want.clone());
            let mut d = IncrementalDecoder::new(options);
            let mut streamed = String::new();
            for &id in &ids {
                streamed.push_str(&d.push(hf(), id).unwrap());
            }
            streamed.push_str(&d.finish());
            prop_assert_eq!(streamed, want);
        }
    }
}

#[test]
fn ids_outside_the_file_are_refused_as_by_the_gguf_vocabulary() {
    assert!(matches!(
        hf().decode(&[49152]),
        Err(TokenizerError::UnknownToken(49152))
    ));
    let mut d = IncrementalDecoder::default();
    assert_eq!(d.push(hf(), 81).unwrap(), "a");
    assert!(matches!(
        d.push(hf(), 70_000),
        Err(TokenizerError::UnknownToken(70_000))
    ));
    // The stream goes on where it was.
    assert_eq!(d.push(hf(), 82).unwrap(), "b");
    assert_eq!(d.finish(), "");
}
