//! Fuzzes the GGUF reader with arbitrary bytes, then everything downstream that
//! trusts what it returns: metadata getters, tensor views, and the tokenizer and
//! chat template built from the metadata. Any panic, out-of-bounds access or
//! runaway allocation is a bug (the reader's contract is "error, never crash").
#![no_main]

use libfuzzer_sys::fuzz_target;
use slipway_engine::model::gguf::GgufFile;
use slipway_engine::template::{ChatMessage, ChatTemplate, RenderOptions};
use slipway_engine::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let md = file.metadata();
    for (key, _) in md.iter() {
        let _ = md.get_u32(key);
        let _ = md.get_f32(key);
        let _ = md.get_str(key);
        let _ = md.get_str_array(key);
        let _ = md.get_i32_array(key);
    }
    for info in file.tensors() {
        let Ok(view) = file.raw_tensor(&info.name) else {
            panic!("listed tensor {} cannot be read", info.name);
        };
        assert_eq!(view.data.len() as u64, info.size);
        let _ = file.tensor(&info.name);
    }
    if let Ok(tokenizer) = Tokenizer::from_metadata(md) {
        let ids = tokenizer.encode("Hello <|im_start|>wörld 123 🚀");
        let _ = tokenizer.decode(&ids);
        if let Ok(template) = ChatTemplate::from_metadata(md, &tokenizer) {
            let _ = template.render(&[ChatMessage::new("user", "hi")], RenderOptions::default());
        }
    }
});
