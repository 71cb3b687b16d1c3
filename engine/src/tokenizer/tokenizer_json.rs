//! Writes a GGUF's byte-level BPE vocabulary as a Hugging Face `tokenizer.json`
//! (`slipway-engine tokenizer-json`, `engine/scripts/make-tokenizer-json`), the
//! inverse of what llama.cpp's `convert_hf_to_gguf.py` reads from one:
//!
//! - model: `BPE` over `tokenizer.ggml.tokens` (id = position) and
//!   `tokenizer.ggml.merges` (rank = position; a repeated merge keeps its first
//!   rank, as llama.cpp does), no `unk_token`, no byte fallback;
//! - added tokens: every CONTROL, USER_DEFINED and UNKNOWN token (the ones
//!   llama.cpp finds in raw text), `special` for all but USER_DEFINED, so the
//!   crate's `skip_special_tokens` and `encode_special_tokens` mean what llama.cpp's
//!   `special` flags mean; no strip, not normalized;
//! - pre-tokenizer from `tokenizer.ggml.pre`: GPT-2's regex (`ByteLevel` with
//!   `use_regex`) for the GPT-2 group, and for the STARCODER group (`smollm`, ...)
//!   first llama.cpp's `\p{N}` split (`Split`, `Isolated`: every number codepoint
//!   a piece of its own), then GPT-2's regex inside each piece, as llama.cpp applies
//!   its regex list ([`super::pretokenize`]);
//! - decoder: `ByteLevel`; post-processor: BOS/EOS as `add_bos_token` /
//!   `add_eos_token` say (none for SmolLM2).
//!
//! Only byte-level (`gpt2`) vocabularies with a pre-tokenizer
//! [`super::PreTokenizer`] knows are written; others are refused, as the GGUF
//! tokenizer refuses them.

use serde_json::{Value, json};

use super::gguf::token_types;
use super::{PreTokenizer, TokenType, TokenizerError};
use crate::model::gguf::Metadata;

/// The `tokenizer.json` equivalent to the GGUF vocabulary in `md`.
///
/// # Errors
/// Missing or mistyped keys, a vocabulary that is not byte-level BPE, a
/// pre-tokenizer with no equivalent here, a token text used twice (a JSON vocabulary
/// maps each text to one id), or a special-token id outside the vocabulary.
pub fn from_metadata(md: &Metadata) -> Result<Value, TokenizerError> {
    let model = md.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(TokenizerError::UnsupportedModel(model.to_owned()));
    }
    let pre_name = md.get_str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre = PreTokenizer::from_name(pre_name)
        .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre_name.to_owned()))?;
    let tokens = md.get_str_array("tokenizer.ggml.tokens")?;
    let types = token_types(md, tokens.len())?;

    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, text) in tokens.iter().enumerate() {
        if vocab.insert(text.clone(), json!(id)).is_some() {
            return Err(TokenizerError::Inconsistent(
                "a token text appears twice in the vocabulary",
            ));
        }
    }
    let mut seen = std::collections::HashSet::new();
    let merges: Vec<Value> = md
        .get_str_array("tokenizer.ggml.merges")?
        .iter()
        .filter(|line| seen.insert(line.as_str()))
        .filter_map(|line| {
            // Split as llama.cpp does: at the first space after the first character.
            let first = line.chars().next()?.len_utf8();
            let at = first + line[first..].find(' ')?;
            Some(json!([&line[..at], &line[at + 1..]]))
        })
        .collect();

    let added: Vec<Value> = types
        .iter()
        .enumerate()
        .filter(|(id, ty)| ty.is_matched_in_text() && !tokens[*id].is_empty())
        .map(|(id, ty)| {
            json!({
                "id": id,
                "content": tokens[id],
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": *ty != TokenType::UserDefined,
            })
        })
        .collect();

    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": true,
    });
    let pre_tokenizer = match pre {
        PreTokenizer::Gpt2 => byte_level.clone(),
        PreTokenizer::DigitsThenGpt2 => json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": { "Regex": "\\p{N}" },
                    "behavior": "Isolated",
                    "invert": false,
                },
                byte_level,
            ],
        }),
    };

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor(md, tokens)?,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": true,
            "use_regex": true,
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    }))
}

/// A `TemplateProcessing` adding BOS/EOS as the metadata asks, or `null`.
fn post_processor(md: &Metadata, tokens: &[String]) -> Result<Value, TokenizerError> {
    let special = |flag: &str, key: &'static str| -> Result<Option<(u32, &str)>, TokenizerError> {
        if !md.get_bool_opt(flag)?.unwrap_or(false) {
            return Ok(None);
        }
        let Some(id) = md.get_u32_opt(key)? else {
            return Ok(None);
        };
        let text = tokens
            .get(id as usize)
            .ok_or(TokenizerError::SpecialTokenMissing { key, id })?;
        Ok(Some((id, text.as_str())))
    };
    let bos = special(
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.bos_token_id",
    )?;
    let eos = special(
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.eos_token_id",
    )?;
    if bos.is_none() && eos.is_none() {
        return Ok(Value::Null);
    }
    let piece = |text: &str| json!({ "SpecialToken": { "id": text, "type_id": 0 } });
    let sequence = |name: &str| json!({ "Sequence": { "id": name, "type_id": 0 } });
    let mut single = Vec::new();
    let mut pair = Vec::new();
    if let Some((_, t)) = bos {
        single.push(piece(t));
        pair.push(piece(t));
    }
    single.push(sequence("A"));
    pair.push(sequence("A"));
    pair.push(sequence("B"));
    if let Some((_, t)) = eos {
        single.push(piece(t));
        pair.push(piece(t));
    }
    let special_tokens: serde_json::Map<String, Value> = bos
        .into_iter()
        .chain(eos)
        .map(|(id, t)| (t.to_owned(), json!({ "id": t, "ids": [id], "tokens": [t] })))
        .collect();
    Ok(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special_tokens,
    }))
}
