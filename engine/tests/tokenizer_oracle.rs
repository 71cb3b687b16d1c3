//! The tokenizer and chat template on the real model, against llama.cpp's output
//! in `shared/oracle/` (token ids are deterministic: exact equality, no tolerance).
//! Fails (never skips) when the model or the oracle is missing.

use std::sync::OnceLock;

use proptest::prelude::*;
use slipway_engine::model::gguf::{GgmlType, GgufFile};
use slipway_engine::template::{ChatTemplate, RenderOptions};
use slipway_engine::testing;
use slipway_engine::tokenizer::{DecodeOptions, EncodeOptions, IncrementalDecoder, Tokenizer};

fn model() -> &'static GgufFile {
    static MODEL: OnceLock<GgufFile> = OnceLock::new();
    MODEL.get_or_init(|| GgufFile::open(&testing::model_path()).expect("open test model"))
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_metadata(model().metadata()).expect("build tokenizer"))
}

#[test]
fn gguf_header_of_the_real_model() {
    let f = model();
    let md = f.metadata();
    assert_eq!(f.version(), 3);
    assert_eq!(md.architecture().unwrap(), "llama");
    assert_eq!(md.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(md.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(md.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(f.tensors().len(), 272);
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.dtype, emb.dims), (GgmlType::Q8_0, &[576, 49152][..]));
    assert_eq!(emb.data.len(), 576 / 32 * 34 * 49152);
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (q.dtype, q.row_len(), q.n_rows()),
        (GgmlType::Q4_1, 576, 576)
    );
    for t in f.tensors() {
        assert!(t.dtype.is_supported(), "{} is {}", t.name, t.dtype);
        assert_eq!(f.tensor(&t.name).unwrap().data.len() as u64, t.size);
    }
}

#[test]
fn tokenize_matches_llama_cpp_for_every_oracle_prompt() {
    let tok = tokenizer();
    let oracle = testing::oracle();
    assert!(!oracle.prompts.is_empty());
    let mut failures = Vec::new();
    for p in &oracle.prompts {
        let ours = tok.encode(&p.prompt);
        if ours != p.prompt_tokens {
            failures.push(format!(
                "{}: {:?}\n  llama.cpp: {:?}\n  ours:      {:?}",
                p.id, p.prompt, p.prompt_tokens, ours
            ));
        }
        // This model's metadata asks for no BOS, so add_special changes nothing.
        let bare = tok.encode_with(
            &p.prompt,
            EncodeOptions {
                add_special: false,
                parse_special: true,
            },
        );
        assert_eq!(bare, ours, "{}", p.id);
    }
    assert!(
        failures.is_empty(),
        "{} prompts differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn oracle_tokens_decode_to_their_text() {
    let tok = tokenizer();
    let oracle = testing::oracle();
    let full_len = oracle
        .prompts
        .iter()
        .map(|p| p.continuation.len())
        .max()
        .unwrap_or(0);
    let mut texts_checked = 0;
    for p in &oracle.prompts {
        assert_eq!(tok.decode(&p.prompt_tokens).unwrap(), p.prompt, "{}", p.id);
        // Streaming the prompt and continuation gives the same text as one decode.
        let all: Vec<u32> = p
            .prompt_tokens
            .iter()
            .chain(&p.continuation)
            .copied()
            .collect();
        let mut d = IncrementalDecoder::default();
        let mut streamed = String::new();
        for &id in &all {
            streamed.push_str(&d.push(tok, id).unwrap());
        }
        streamed.push_str(&d.finish());
        assert_eq!(streamed, tok.decode(&all).unwrap(), "{}", p.id);
        // llama-server's streamed record drops the ids of tokens that end inside a
        // multi-byte character (the "chinese" and "emoji" records are short without
        // having hit an end-of-generation token), so only complete records can be
        // compared with the text.
        let complete = p.continuation.len() == full_len
            || p.continuation.last().is_some_and(|&t| tok.is_eog(t));
        if complete {
            let text = tok
                .decode_with(&p.continuation, DecodeOptions { skip_special: true })
                .unwrap();
            assert_eq!(text, p.continuation_text, "{}", p.id);
            texts_checked += 1;
        }
    }
    assert!(
        texts_checked >= 10,
        "only {texts_checked} complete continuations"
    );
}

#[test]
fn chat_template_renders_the_oracle_prompts() {
    let template = ChatTemplate::from_metadata(model().metadata(), tokenizer()).unwrap();
    let oracle = testing::oracle();
    let chats: Vec<_> = oracle.prompts.iter().filter(|p| p.chat.is_some()).collect();
    assert!(chats.len() >= 4, "the oracle should hold chat prompts");
    for p in chats {
        let messages = p.chat.as_deref().unwrap_or_default();
        let rendered = template.render(messages, RenderOptions::default()).unwrap();
        assert_eq!(rendered, p.prompt, "{}", p.id);
    }
}

#[test]
fn end_of_generation_tokens_follow_llama_cpp() {
    let tok = tokenizer();
    // <|im_end|> is EOS; <|endoftext|> is recognised by text, as in llama.cpp.
    assert_eq!(tok.eog_tokens(), [0, 2]);
    assert_eq!(tok.bos(), Some(1));
}

#[test]
fn bytes_without_a_token_are_dropped_as_llama_cpp_drops_them() {
    let tok = tokenizer();
    let missing: Vec<u8> = (0..=255u8)
        .filter(|&b| tok.byte_token(b).is_none())
        .collect();
    assert_eq!(
        missing,
        [
            4, 6, 19, 20, 22, 29, 192, 193, 241, 242, 245, 246, 247, 248, 249, 250, 251, 252, 253,
            254, 255
        ]
    );
    // Ids from llama-server's /tokenize for the same strings.
    assert_eq!(tok.encode("u\u{13}nits"), [101, 94, 842]);
    assert_eq!(tok.encode("a\u{4}b"), [81, 82]);
    assert_eq!(tok.encode("\u{e9}\u{1d}"), [2756]);
    assert!(!tok.can_round_trip("u\u{13}nits"));
    assert!(tok.can_round_trip("units 🚀 先"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decode_of_encode_is_identity(text in "\\PC{0,64}|[ \\t\\n0-9a-zA-Z'<|>_]{0,64}|[\\x00-\\x7f]{0,32}") {
        let tok = tokenizer();
        let round = tok.decode(&tok.encode(&text)).unwrap();
        if tok.can_round_trip(&text) {
            prop_assert_eq!(round, text);
        } else {
            // Only the bytes without a token go missing.
            let kept: Vec<u8> = text.bytes().filter(|&b| tok.byte_token(b).is_some()).collect();
            // Compared as bytes: what is left may not be valid UTF-8.
            let raw = tok.decode_bytes(&tok.encode(&text), DecodeOptions::default()).unwrap();
            prop_assert_eq!(raw, kept);
        }
    }

    #[test]
    fn incremental_decode_equals_full_decode(ids in proptest::collection::vec(0u32..49152, 0..48)) {
        let tok = tokenizer();
        let mut d = IncrementalDecoder::default();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(tok, id).unwrap());
        }
        streamed.push_str(&d.finish());
        prop_assert_eq!(streamed, tok.decode(&ids).unwrap());
    }
}
