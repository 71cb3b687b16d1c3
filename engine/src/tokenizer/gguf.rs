//! The vocabulary stored in a GGUF file's `tokenizer.ggml.*` metadata, encoded and
//! decoded exactly as llama.cpp's `llama_tokenize(..., parse_special = true)` and
//! `token_to_piece` do (llama.cpp's ids are our reference, see
//! `engine/tests/tokenizer_oracle.rs`):
//!
//! 1. Special-token partition (`tokenizer_st_partition`): every token typed
//!    CONTROL, USER_DEFINED or UNKNOWN is searched for in the raw text, longest
//!    first; each occurrence becomes that token and splits the text around it.
//! 2. Each remaining text fragment is pre-tokenized, each word is rewritten in
//!    GPT-2's byte alphabet and BPE-merged ([`super::bpe`]); a final symbol missing
//!    from the vocabulary falls back to single-character tokens, as llama.cpp does
//!    (a byte with no token of its own is dropped; see
//!    [`super::Tokenizer::byte_token`]).
//!
//! BOS/EOS and the end-of-generation set are not here: [`super::Tokenizer`]
//! resolves them from the metadata the same way for every vocabulary.
//!
//! Supported: byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) with the
//! pre-tokenizers in [`super::pretokenize`].

use std::collections::HashMap;

use super::{TokenType, TokenizerError, bpe};
use crate::model::gguf::Metadata;
use crate::tokenizer::PreTokenizer;

/// A GGUF vocabulary with its merges and special-token rules.
#[derive(Debug, Clone)]
pub(super) struct GgufVocab {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    by_text: HashMap<String, u32>,
    merges: bpe::Merges,
    alphabet: bpe::ByteAlphabet,
    pre: PreTokenizer,
    /// Tokens matched in raw text, longest text first (ties by id, so the order
    /// is deterministic where llama.cpp's unstable sort is not).
    specials: Vec<u32>,
}

impl GgufVocab {
    /// Reads the vocabulary from GGUF metadata.
    ///
    /// # Errors
    /// Missing or mistyped keys, an unsupported tokenizer model or pre-tokenizer.
    pub(super) fn from_metadata(md: &Metadata) -> Result<Self, TokenizerError> {
        let model = md.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_owned()));
        }
        // llama.cpp falls back to "default" when the key is absent, whose rules
        // differ again; refuse rather than guess.
        let pre_name = md.get_str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
        let pre = PreTokenizer::from_name(pre_name)
            .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(pre_name.to_owned()))?;

        let tokens = md.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
            return Err(TokenizerError::Inconsistent(
                "vocabulary is empty or too large",
            ));
        }
        let types = token_types(md, tokens.len())?;
        let merges = bpe::Merges::new(md.get_str_array("tokenizer.ggml.merges")?);

        // Like llama.cpp's token_to_id map: a duplicated text maps to its last id.
        let by_text: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();

        let mut specials: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&id| {
                types[id as usize].is_matched_in_text() && !tokens[id as usize].is_empty()
            })
            .collect();
        specials.sort_by_key(|&id| (std::cmp::Reverse(tokens[id as usize].len()), id));

        tracing::debug!(
            vocab = tokens.len(),
            pre = pre_name,
            specials = specials.len(),
            "read the GGUF vocabulary"
        );
        Ok(Self {
            tokens,
            types,
            by_text,
            merges,
            alphabet: bpe::ByteAlphabet::gpt2(),
            pre,
            specials,
        })
    }

    pub(super) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(super) fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub(super) fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub(super) fn token_id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// Encodes `text` (no BOS/EOS) onto `out`.
    pub(super) fn encode_into(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) {
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(t) => self.encode_text(t, out),
            }
        }
    }

    /// Splits raw text at special-token occurrences, longest tokens first.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(text)];
        for &id in &self.specials {
            let ty = self.types[id as usize];
            if !parse_special && ty != TokenType::UserDefined {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            // Cheap pre-check: most specials appear in no fragment.
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text(mut t) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = t.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&t[..at]));
                    }
                    next.push(Fragment::Token(id));
                    t = &t[at + needle.len()..];
                }
                if !t.is_empty() {
                    next.push(Fragment::Text(t));
                }
            }
            fragments = next;
        }
        fragments
    }

    fn encode_text(&self, text: &str, out: &mut Vec<u32>) {
        for word in self.pre.split(text) {
            let encoded = self.alphabet.encode(&text[word]);
            for sym in self.merges.apply(&encoded) {
                let sym = &encoded[sym];
                match self.by_text.get(sym) {
                    Some(&id) => out.push(id),
                    // llama.cpp's fallback: look up each byte of the symbol's
                    // (alphabet-encoded) UTF-8 as a one-byte token text; skip misses.
                    None => {
                        for b in sym.bytes() {
                            let one = [b];
                            if let Some(&id) = std::str::from_utf8(&one)
                                .ok()
                                .and_then(|s| self.by_text.get(s))
                            {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Appends the bytes token `id` renders as (llama.cpp's `token_to_piece` for BPE
    /// vocabularies with `special = !skip_special`).
    pub(super) fn append_token_bytes(
        &self,
        id: u32,
        skip_special: bool,
        out: &mut Vec<u8>,
    ) -> Result<(), TokenizerError> {
        let text = self
            .tokens
            .get(id as usize)
            .ok_or(TokenizerError::UnknownToken(id))?;
        match self.types[id as usize] {
            TokenType::Normal => self.alphabet.decode_into(text, out),
            TokenType::UserDefined => out.extend_from_slice(text.as_bytes()),
            TokenType::Control | TokenType::Unknown => {
                if !skip_special {
                    out.extend_from_slice(text.as_bytes());
                }
            }
            TokenType::Unused | TokenType::Byte | TokenType::Undefined => {}
        }
        Ok(())
    }
}

/// `tokenizer.ggml.token_type`, or all NORMAL when the key is absent.
///
/// # Errors
/// A mistyped key, or a length different from the vocabulary's.
pub(super) fn token_types(
    md: &Metadata,
    n_tokens: usize,
) -> Result<Vec<TokenType>, TokenizerError> {
    let types: Vec<TokenType> = match md.get("tokenizer.ggml.token_type") {
        None => vec![TokenType::Normal; n_tokens],
        Some(_) => md
            .get_i32_array("tokenizer.ggml.token_type")?
            .iter()
            .map(|&t| TokenType::from_i32(t))
            .collect(),
    };
    if types.len() != n_tokens {
        return Err(TokenizerError::Inconsistent(
            "token_type and tokens have different lengths",
        ));
    }
    Ok(types)
}

#[derive(Debug, Clone, Copy)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}
