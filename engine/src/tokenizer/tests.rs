//! Tokenizer tests on a small synthetic vocabulary (the real model's vocabulary is
//! tested against llama.cpp's ids in `engine/tests/tokenizer_oracle.rs`).

use proptest::prelude::*;

use super::*;
use crate::model::gguf::{Array, Value};

/// A vocabulary with all 256 byte tokens, a few merges, and special tokens.
fn tiny(add_bos: bool) -> Tokenizer {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3, 3, 3];
    for b in 0..=255u8 {
        tokens.push(bpe::ByteAlphabet::gpt2_char(b).to_string());
        types.push(1);
    }
    let merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    tokens.push("<user>".into());
    types.push(4);

    let mut md = Metadata::default();
    let mut put = |k: &str, v: Value| md.insert(k.into(), v).unwrap();
    put("tokenizer.ggml.model", Value::String("gpt2".into()));
    put("tokenizer.ggml.pre", Value::String("smollm".into()));
    put("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    put("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    put(
        "tokenizer.ggml.merges",
        Value::Array(Array::String(
            merges.iter().map(|s| (*s).to_owned()).collect(),
        )),
    );
    put("tokenizer.ggml.bos_token_id", Value::U32(1));
    put("tokenizer.ggml.eos_token_id", Value::U32(2));
    put("tokenizer.ggml.add_bos_token", Value::Bool(add_bos));
    Tokenizer::from_metadata(&md).unwrap()
}

fn byte_id(b: u8) -> u32 {
    3 + u32::from(b)
}

#[test]
fn merges_and_specials() {
    let t = tiny(false);
    let hell = t.token_id("hell").unwrap();
    let wor = t.token_id("Ġwor").unwrap();
    assert_eq!(
        t.encode("hello world"),
        [hell, byte_id(b'o'), wor, byte_id(b'l'), byte_id(b'd')]
    );
    assert_eq!(
        t.encode("<|im_start|>hi<|im_end|>"),
        [1, byte_id(b'h'), byte_id(b'i'), 2]
    );
    // Without parse_special, control tokens are plain text but user-defined ones
    // are still recognised.
    let plain = t.encode_with(
        "<|im_end|><user>",
        EncodeOptions {
            add_special: true,
            parse_special: false,
        },
    );
    assert_eq!(plain.last(), t.token_id("<user>").as_ref());
    assert!(!plain.contains(&2));
}

#[test]
fn bos_follows_the_metadata() {
    assert_eq!(tiny(true).encode("h")[0], 1);
    assert_eq!(tiny(false).encode("h"), [byte_id(b'h')]);
    assert!(
        tiny(true).encode_with(
            "h",
            EncodeOptions {
                add_special: false,
                parse_special: true
            }
        ) == [byte_id(b'h')]
    );
}

#[test]
fn eog_includes_eos_and_known_end_texts() {
    let t = tiny(false);
    assert!(t.is_eog(2));
    assert!(t.is_eog(0)); // <|endoftext|>
    assert!(!t.is_eog(1));
}

#[test]
fn decode_renders_or_skips_specials() {
    let t = tiny(false);
    let ids = t.encode("<|im_start|>hello<|im_end|>");
    assert_eq!(t.decode(&ids).unwrap(), "<|im_start|>hello<|im_end|>");
    assert_eq!(
        t.decode_with(&ids, DecodeOptions { skip_special: true })
            .unwrap(),
        "hello"
    );
    assert!(matches!(
        t.decode(&[99_999]),
        Err(TokenizerError::UnknownToken(99_999))
    ));
}

#[test]
fn incremental_decoder_holds_back_partial_characters() {
    let t = tiny(false);
    let rocket = "🚀".as_bytes();
    let mut d = IncrementalDecoder::default();
    assert_eq!(d.push(&t, byte_id(b'a')).unwrap(), "a");
    assert_eq!(d.push(&t, byte_id(rocket[0])).unwrap(), "");
    assert_eq!(d.push(&t, byte_id(rocket[1])).unwrap(), "");
    assert_eq!(d.pending().len(), 2);
    assert_eq!(d.push(&t, byte_id(rocket[2])).unwrap(), "");
    assert_eq!(d.push(&t, byte_id(rocket[3])).unwrap(), "🚀");
    // A truncated character at the end becomes one replacement character.
    assert_eq!(d.push(&t, byte_id(rocket[0])).unwrap(), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

#[test]
fn unsupported_vocabularies_are_refused() {
    let mut md = Metadata::default();
    md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()))
        .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::UnsupportedModel(_))
    ));
    let mut md = Metadata::default();
    md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()))
        .unwrap();
    md.insert(
        "tokenizer.ggml.pre".into(),
        Value::String("llama-bpe".into()),
    )
    .unwrap();
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::UnsupportedPreTokenizer(_))
    ));
}

proptest! {
    #[test]
    fn round_trip_any_text(text in "\\PC*|[\\x00-\\x7f<>|_a-z]{0,40}") {
        let t = tiny(false);
        let ids = t.encode(&text);
        prop_assert_eq!(t.decode(&ids).unwrap(), text);
    }

    #[test]
    fn incremental_equals_full_decode(ids in proptest::collection::vec(0u32..(3 + 256 + 6), 0..40)) {
        let t = tiny(false);
        let mut d = IncrementalDecoder::default();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&d.push(&t, id).unwrap());
        }
        streamed.push_str(&d.finish());
        prop_assert_eq!(streamed, t.decode(&ids).unwrap());
    }
}
