//! Fuzzes the tokenizer of the real model with arbitrary text: encoding must not
//! panic, must round-trip (`decode(encode(text)) == text`, less the few bytes the
//! vocabulary has no token for; special-token text re-renders as itself), and
//! streaming decode must equal full decode. Needs the model (`make model` or SLIPWAY_MODEL).
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::testing;
use slipway_engine::tokenizer::{DecodeOptions, IncrementalDecoder, Tokenizer};

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let file = GgufFile::open(&testing::model_path()).expect("open the model");
        Tokenizer::from_metadata(file.metadata()).expect("build its tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let tok = tokenizer();
    let ids = tok.encode(text);
    let round = tok.decode(&ids).expect("ids come from the vocabulary");
    if tok.can_round_trip(text) {
        assert_eq!(round, text);
    } else {
        // Bytes without a token are dropped (as llama.cpp drops them), nothing
        // else; what is left may be invalid UTF-8, so compare bytes.
        let kept: Vec<u8> = text
            .bytes()
            .filter(|&b| tok.byte_token(b).is_some())
            .collect();
        let raw = tok
            .decode_bytes(&ids, DecodeOptions::default())
            .expect("ids come from the vocabulary");
        assert_eq!(raw, kept);
    }
    let mut d = IncrementalDecoder::default();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&d.push(tok, id).expect("ids come from the vocabulary"));
    }
    streamed.push_str(&d.finish());
    assert_eq!(streamed, round);
});
