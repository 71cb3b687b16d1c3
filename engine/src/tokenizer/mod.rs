//! The tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
//!
//! Supported: byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) with the
//! pre-tokenizers in [`pretokenize`]. The behaviour reproduces llama.cpp's
//! `llama_tokenize(..., parse_special = true)` exactly, because llama.cpp's ids are
//! our reference (see `engine/tests/tokenizer_oracle.rs`):
//!
//! 1. Special-token partition (`tokenizer_st_partition`): every token typed
//!    CONTROL, USER_DEFINED or UNKNOWN is searched for in the raw text, longest
//!    first; each occurrence becomes that token and splits the text around it.
//! 2. Each remaining text fragment is pre-tokenized, each word is rewritten in
//!    GPT-2's byte alphabet and BPE-merged ([`bpe`]); a final symbol missing from
//!    the vocabulary falls back to single-character tokens, as llama.cpp does
//!    (a byte with no token of its own is dropped; see [`Tokenizer::byte_token`]).
//! 3. With `add_special`, BOS/EOS are added only where the metadata says so
//!    (`tokenizer.ggml.add_bos_token` / `add_eos_token`; llama.cpp's default for
//!    BPE vocabularies is neither).
//!
//! Beyond the oracle prompts, `engine/scripts/diff-tokenizer` compares us with a
//! running llama-server on random text built to stress the splitter (mixed
//! scripts, digits, whitespace runs, ZWJ emoji, special-token fragments): 2,300
//! strings, no difference, against the llama.cpp of llama-cpp-python's sdist.
//!
//! Why not the `tokenizers` crate: it could be assembled from these pieces (a BPE
//! model from tokens + merges, a ByteLevel pre-tokenizer), but its pre-tokenizer
//! is a regex (`\s+(?!\S)` evaluated by a regex engine over the whole fragment),
//! and it has no notion of llama.cpp's two-stage `\p{N}`-then-GPT-2 split, whose
//! piece boundaries change the result (e.g. spaces before a digit). Matching
//! llama.cpp token for token means porting llama.cpp's splitter; once that is
//! done, the BPE loop is a page of code and the crate would add a large
//! dependency for nothing.
//!
//! Not ported: the LSTRIP/RSTRIP attributes llama.cpp hard-codes for a few model
//! names (jina, phi-3), and SentencePiece (`llama`) vocabularies; both are refused
//! or unaffected for the models we load.

mod bpe;
pub mod decode;
pub mod pretokenize;

use std::collections::HashMap;

use crate::model::gguf::{GgufError, Metadata};
pub use decode::IncrementalDecoder;
pub use pretokenize::PreTokenizer;

/// Errors building a tokenizer or decoding ids.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported tokenizer model {0:?} (supported: \"gpt2\", byte-level BPE)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer {0:?} (tokenizer.ggml.pre)")]
    UnsupportedPreTokenizer(String),
    #[error("tokenizer metadata is inconsistent: {0}")]
    Inconsistent(&'static str),
    #[error("token id {0} is outside the vocabulary")]
    UnknownToken(u32),
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    /// A value outside llama.cpp's enum; treated like [`TokenType::Unused`].
    Undefined,
}

impl TokenType {
    fn from_i32(v: i32) -> Self {
        match v {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }

    /// Whether text is scanned for this token before BPE (llama.cpp's special
    /// token cache: CONTROL, USER_DEFINED, UNKNOWN).
    fn is_matched_in_text(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }
}

/// How to encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS/EOS where the vocabulary's metadata asks for them.
    pub add_special: bool,
    /// Recognise special-token text (`<|im_start|>`) as those tokens. Off, only
    /// USER_DEFINED tokens are recognised (as in llama.cpp).
    pub parse_special: bool,
}

impl Default for EncodeOptions {
    /// What llama.cpp's server does with a prompt: both on.
    fn default() -> Self {
        Self {
            add_special: true,
            parse_special: true,
        }
    }
}

/// How to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeOptions {
    /// Render CONTROL and UNKNOWN tokens as nothing instead of their text.
    pub skip_special: bool,
}

/// A vocabulary with its merges and special-token rules.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    by_text: HashMap<String, u32>,
    merges: bpe::Merges,
    alphabet: bpe::ByteAlphabet,
    pre: PreTokenizer,
    /// Tokens matched in raw text, longest text first (ties by id, so the order
    /// is deterministic where llama.cpp's unstable sort is not).
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eog: Vec<u32>,
}

/// Token texts llama.cpp treats as end-of-generation wherever they appear in a
/// vocabulary (its `special_eog_ids` detection), in addition to EOS and EOT.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata.
    ///
    /// # Errors
    /// Missing or mistyped keys, an unsupported tokenizer model or pre-tokenizer,
    /// or ids in the metadata that are outside the vocabulary.
    pub fn from_metadata(md: &Metadata) -> Result<Self, TokenizerError> {
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
        let types: Vec<TokenType> = match md.get("tokenizer.ggml.token_type") {
            None => vec![TokenType::Normal; tokens.len()],
            Some(_) => md
                .get_i32_array("tokenizer.ggml.token_type")?
                .iter()
                .map(|&t| TokenType::from_i32(t))
                .collect(),
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::Inconsistent(
                "token_type and tokens have different lengths",
            ));
        }
        let merges = bpe::Merges::new(md.get_str_array("tokenizer.ggml.merges")?);

        // Like llama.cpp's token_to_id map: a duplicated text maps to its last id.
        let by_text: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();

        let id_key = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match md.get_u32_opt(key)? {
                Some(id) if id as usize >= tokens.len() => Err(TokenizerError::Inconsistent(
                    "a special token id is outside the vocabulary",
                )),
                other => Ok(other),
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        let add_bos = md
            .get_bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false);
        let add_eos = md
            .get_bool_opt("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false);

        let mut eog: Vec<u32> = EOG_TEXTS
            .iter()
            .filter_map(|t| by_text.get(*t).copied())
            .chain(eos)
            .chain(eot)
            .collect();
        eog.sort_unstable();
        eog.dedup();

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
            add_bos,
            add_eos,
            "built tokenizer"
        );
        Ok(Self {
            tokens,
            types,
            by_text,
            merges,
            alphabet: bpe::ByteAlphabet::gpt2(),
            pre,
            specials,
            bos,
            eos,
            add_bos,
            add_eos,
            eog,
        })
    }

    /// Number of tokens in the vocabulary.
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The stored text of a token (in the byte alphabet for normal tokens).
    #[must_use]
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of a token.
    #[must_use]
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The id of a token with exactly this stored text.
    #[must_use]
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// Beginning-of-sequence token, if the vocabulary names one.
    #[must_use]
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token, if the vocabulary names one.
    #[must_use]
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The token that stands for the raw byte `b`, if the vocabulary has one.
    /// Text containing a byte without one cannot round-trip: the byte is dropped,
    /// exactly as llama.cpp drops it (SmolLM2 lacks e.g. 0x04, 0x13, 0x1D and the
    /// lead bytes 0xF1/0xF2 of planes 4 to 11).
    #[must_use]
    pub fn byte_token(&self, b: u8) -> Option<u32> {
        self.token_id(self.alphabet.char_of(b).encode_utf8(&mut [0; 4]))
    }

    /// Whether `decode(encode(text)) == text` is guaranteed: every byte of `text`
    /// has a byte token.
    #[must_use]
    pub fn can_round_trip(&self, text: &str) -> bool {
        text.bytes().all(|b| self.byte_token(b).is_some())
    }

    /// Whether generation should stop at `id` (EOS, EOT, and the end-of-turn
    /// tokens llama.cpp recognises by text, e.g. `<|im_end|>` and `<|endoftext|>`).
    #[must_use]
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    #[must_use]
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    /// Encodes with [`EncodeOptions::default`] (special tokens parsed, BOS/EOS as
    /// the metadata says).
    #[must_use]
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, EncodeOptions::default())
    }

    /// Encodes `text`.
    #[must_use]
    pub fn encode_with(&self, text: &str, options: EncodeOptions) -> Vec<u32> {
        let mut out = Vec::new();
        if options.add_special && self.add_bos {
            out.extend(self.bos);
        }
        for fragment in self.partition(text, options.parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(t) => self.encode_text(t, &mut out),
            }
        }
        if options.add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
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

    /// Appends the bytes token `id` renders as.
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary.
    pub fn append_token_bytes(
        &self,
        id: u32,
        options: DecodeOptions,
        out: &mut Vec<u8>,
    ) -> Result<(), TokenizerError> {
        let text = self
            .tokens
            .get(id as usize)
            .ok_or(TokenizerError::UnknownToken(id))?;
        // llama.cpp's token_to_piece for BPE vocabularies with special = !skip.
        match self.types[id as usize] {
            TokenType::Normal => self.alphabet.decode_into(text, out),
            TokenType::UserDefined => out.extend_from_slice(text.as_bytes()),
            TokenType::Control | TokenType::Unknown => {
                if !options.skip_special {
                    out.extend_from_slice(text.as_bytes());
                }
            }
            TokenType::Unused | TokenType::Byte | TokenType::Undefined => {}
        }
        Ok(())
    }

    /// The bytes of a sequence of tokens.
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary.
    pub fn decode_bytes(
        &self,
        ids: &[u32],
        options: DecodeOptions,
    ) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            self.append_token_bytes(id, options, &mut out)?;
        }
        Ok(out)
    }

    /// Decodes ids to text, special tokens included; invalid UTF-8 (a sequence cut
    /// mid-character) becomes U+FFFD.
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.decode_with(ids, DecodeOptions::default())
    }

    /// [`Tokenizer::decode`] with options.
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary.
    pub fn decode_with(
        &self,
        ids: &[u32],
        options: DecodeOptions,
    ) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids, options)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

#[derive(Debug, Clone, Copy)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

#[cfg(test)]
mod tests;
