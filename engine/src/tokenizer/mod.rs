//! Tokenizers: text to token ids and back, with the special tokens generation stops
//! on. Two vocabularies are supported, behind one [`Tokenizer`]:
//!
//! - the GGUF's own (`tokenizer.ggml.*`, `gguf.rs`): a port of llama.cpp's byte-level
//!   BPE tokenizer, token for token, because llama.cpp's ids are our reference (see
//!   `engine/tests/tokenizer_oracle.rs`);
//! - a Hugging Face `tokenizer.json` from the release bundle (`serve --tokenizer`,
//!   `hugging_face.rs`), run by the maintained `tokenizers` crate.
//!
//! Whichever encodes, the special tokens are resolved one way, from the GGUF's
//! metadata (`SpecialTokens`): BOS, EOS and EOT are the model's ids
//! (`tokenizer.ggml.*_token_id`, the ids it was trained to emit), and must exist in
//! the vocabulary in use; the end-of-generation set adds the tokens llama.cpp
//! recognises by text (`<|im_end|>`, `<|endoftext|>`, ...), looked up in that
//! vocabulary. [`Tokenizer::for_model`] also checks that every id the vocabulary
//! can produce has a row in the model's embedding.
//!
//! Beyond the oracle prompts, `engine/scripts/diff-tokenizer` compares the GGUF port
//! with a running llama-server on random text built to stress the splitter (mixed
//! scripts, digits, whitespace runs, ZWJ emoji, special-token fragments): 2,300
//! strings, no difference, against the llama.cpp of llama-cpp-python's sdist. A
//! `tokenizer.json` built from the GGUF ([`tokenizer_json`]) gives the same ids on
//! the oracle prompts and 2,000 random strings
//! (`engine/tests/tokenizer_json.rs`).
//!
//! Why the GGUF path is a port rather than the `tokenizers` crate fed the GGUF's
//! tokens: llama.cpp drops a byte that has no token *while keeping it as a merge
//! barrier*, where the crate drops it *before* merging, so the two differ on text
//! holding such a byte (SmolLM2 lacks six C0 controls, e.g. U+0004); and llama.cpp's
//! special-token partition (longest token first over the whole text, where the crate
//! takes the leftmost longest match) and pre-tokenizer are hand-written scanners whose
//! matching order only a port reproduces for every vocabulary.
//!
//! Not ported: the LSTRIP/RSTRIP attributes llama.cpp hard-codes for a few model
//! names (jina, phi-3), and SentencePiece (`llama`) GGUF vocabularies; both are
//! refused or unaffected for the models we load.

mod bpe;
pub mod decode;
mod gguf;
mod hugging_face;
pub mod pretokenize;
pub mod tokenizer_json;

use std::path::{Path, PathBuf};

use crate::fetch::{Sha256Digest, VerifyError, verify_release_file};
use crate::model::gguf::{GgufError, GgufFile, Metadata};
pub use decode::IncrementalDecoder;
use gguf::GgufVocab;
use hugging_face::HfVocab;
pub use pretokenize::PreTokenizer;

/// The embedding whose rows the token ids index.
const EMBEDDING_TENSOR: &str = "token_embd.weight";

/// Errors building a tokenizer, encoding or decoding.
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
    #[error("the model's {key} ({id}) is not in the tokenizer's vocabulary")]
    SpecialTokenMissing { key: &'static str, id: u32 },
    #[error(
        "the tokenizer's vocabulary has ids up to {}, but the model's embedding ({EMBEDDING_TENSOR}) has {embedding_rows} rows: the tokenizer is not this model's",
        ids - 1
    )]
    VocabularyTooLarge { ids: usize, embedding_rows: usize },
    /// The file is not the one the release names (`--tokenizer-sha256`): `serve`
    /// exits with [`slipway_contract::exit::MODEL_REJECTED`], as for the model.
    #[error("--tokenizer-sha256")]
    Rejected(#[source] VerifyError),
    // The causes below are in the message and not also a `source`, so `serve`'s
    // `Error: ...` line (an error chain printed in full) does not say them twice.
    #[error("reading {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("tokenizer.json cannot be used: {0}")]
    TokenizerJson(tokenizers::Error),
    #[error("encoding failed: {0}")]
    Encode(tokenizers::Error),
    #[error("decoding failed: {0}")]
    Decode(tokenizers::Error),
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
    /// Add BOS/EOS where the vocabulary asks for them (the GGUF's
    /// `add_bos_token`/`add_eos_token`, or a `tokenizer.json`'s post-processor).
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

/// A vocabulary with the model's special tokens.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    special: SpecialTokens,
}

/// Which vocabulary encodes and decodes.
// One per process (shared behind an `Arc`): boxing a variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum Vocab {
    Gguf(GgufVocab),
    HuggingFace(HfVocab),
}

/// The model's special tokens, resolved from GGUF metadata whichever vocabulary is
/// in use.
#[derive(Debug, Clone)]
struct SpecialTokens {
    bos: Option<u32>,
    eos: Option<u32>,
    /// Sorted, no duplicates.
    eog: Vec<u32>,
    /// The GGUF's `add_bos_token`/`add_eos_token` (a `tokenizer.json` has its own
    /// post-processor instead).
    add_bos: bool,
    add_eos: bool,
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

impl SpecialTokens {
    /// Reads BOS/EOS/EOT ids and the add flags from `md`; `has_id` and `lookup` ask
    /// the vocabulary in use whether an id exists and which id a text has.
    fn resolve(
        md: &Metadata,
        has_id: impl Fn(u32) -> bool,
        lookup: impl Fn(&str) -> Option<u32>,
    ) -> Result<Self, TokenizerError> {
        let id_key = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            match md.get_u32_opt(key)? {
                Some(id) if !has_id(id) => Err(TokenizerError::SpecialTokenMissing { key, id }),
                other => Ok(other),
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let eot = id_key("tokenizer.ggml.eot_token_id")?;
        let mut eog: Vec<u32> = EOG_TEXTS
            .iter()
            .filter_map(|t| lookup(t))
            .chain(eos)
            .chain(eot)
            .collect();
        eog.sort_unstable();
        eog.dedup();
        Ok(Self {
            bos,
            eos,
            eog,
            add_bos: md
                .get_bool_opt("tokenizer.ggml.add_bos_token")?
                .unwrap_or(false),
            add_eos: md
                .get_bool_opt("tokenizer.ggml.add_eos_token")?
                .unwrap_or(false),
        })
    }
}

impl Tokenizer {
    /// The GGUF's own vocabulary, from its metadata.
    ///
    /// # Errors
    /// Missing or mistyped keys, an unsupported tokenizer model or pre-tokenizer,
    /// or special-token ids in the metadata that are outside the vocabulary.
    pub fn from_metadata(md: &Metadata) -> Result<Self, TokenizerError> {
        let vocab = GgufVocab::from_metadata(md)?;
        let special =
            SpecialTokens::resolve(md, |id| (id as usize) < vocab.len(), |t| vocab.token_id(t))?;
        Ok(Self {
            vocab: Vocab::Gguf(vocab),
            special,
        })
    }

    /// A Hugging Face `tokenizer.json` (its content) instead of the GGUF's
    /// vocabulary, with the special tokens of the GGUF's metadata `md`.
    ///
    /// # Errors
    /// A file the `tokenizers` crate cannot load, or a special-token id of the
    /// model that the file does not define.
    pub fn from_tokenizer_json(md: &Metadata, json: &[u8]) -> Result<Self, TokenizerError> {
        let vocab = HfVocab::from_json(json)?;
        let special = SpecialTokens::resolve(
            md,
            |id| vocab.token_text(id).is_some(),
            |t| vocab.token_id(t),
        )?;
        // The model was trained on the GGUF's ids; a file that names them otherwise
        // is probably another model's (the ids still decide, e.g. where to stop).
        if let Ok(gguf_tokens) = md.get_str_array("tokenizer.ggml.tokens") {
            for id in special.bos.iter().chain(&special.eos) {
                let ours = gguf_tokens.get(*id as usize).map(String::as_str);
                let theirs = vocab.token_text(*id);
                if ours.is_some() && ours != theirs {
                    tracing::warn!(
                        id,
                        gguf = ours,
                        tokenizer_json = theirs,
                        "tokenizer.json names a special token of the model differently"
                    );
                }
            }
        }
        Ok(Self {
            vocab: Vocab::HuggingFace(vocab),
            special,
        })
    }

    /// The tokenizer `serve` uses for the model `file`: its own vocabulary, or the
    /// `tokenizer.json` at `tokenizer_json` (first verified against `sha256` when
    /// given, with the helper that verifies the model), checked to fit the model's
    /// embedding.
    ///
    /// # Errors
    /// Those of [`Tokenizer::from_metadata`] / [`Tokenizer::from_tokenizer_json`],
    /// [`TokenizerError::Rejected`], an unreadable file, or
    /// [`TokenizerError::VocabularyTooLarge`].
    pub fn for_model(
        file: &GgufFile,
        tokenizer_json: Option<&Path>,
        sha256: Option<&Sha256Digest>,
    ) -> Result<Self, TokenizerError> {
        let md = file.metadata();
        let tokenizer = match tokenizer_json {
            None => Self::from_metadata(md)?,
            Some(path) => {
                if let Some(expected) = sha256 {
                    let bytes = verify_release_file("tokenizer", path, expected)
                        .map_err(TokenizerError::Rejected)?;
                    tracing::info!(tokenizer = %path.display(), bytes, "tokenizer sha256 verified");
                }
                let json = std::fs::read(path).map_err(|error| TokenizerError::Read {
                    path: path.to_owned(),
                    error,
                })?;
                Self::from_tokenizer_json(md, &json)?
            }
        };
        let rows = file
            .tensor_info(EMBEDDING_TENSOR)
            .and_then(|t| t.dims.get(1))
            .ok_or_else(|| GgufError::MissingTensor(EMBEDDING_TENSOR.into()))?;
        tokenizer.check_fits_embedding(usize::try_from(*rows).unwrap_or(usize::MAX))?;
        Ok(tokenizer)
    }

    /// Checks that every id the vocabulary defines indexes one of `embedding_rows`
    /// rows.
    ///
    /// # Errors
    /// [`TokenizerError::VocabularyTooLarge`] with both numbers.
    pub fn check_fits_embedding(&self, embedding_rows: usize) -> Result<(), TokenizerError> {
        let ids = self.vocab_size();
        if ids > embedding_rows {
            return Err(TokenizerError::VocabularyTooLarge {
                ids,
                embedding_rows,
            });
        }
        Ok(())
    }

    /// Whether this is a `tokenizer.json` rather than the GGUF's vocabulary.
    #[must_use]
    pub fn is_tokenizer_json(&self) -> bool {
        matches!(self.vocab, Vocab::HuggingFace(_))
    }

    /// Number of ids the vocabulary uses (one past the largest).
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        match &self.vocab {
            Vocab::Gguf(v) => v.len(),
            Vocab::HuggingFace(v) => v.len(),
        }
    }

    /// The stored text of a token (in the byte alphabet for normal tokens).
    #[must_use]
    pub fn token_text(&self, id: u32) -> Option<&str> {
        match &self.vocab {
            Vocab::Gguf(v) => v.token_text(id),
            Vocab::HuggingFace(v) => v.token_text(id),
        }
    }

    /// The type of a token (for a `tokenizer.json`: its special added tokens are
    /// CONTROL, its other added tokens USER_DEFINED, the rest NORMAL).
    #[must_use]
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        match &self.vocab {
            Vocab::Gguf(v) => v.token_type(id),
            Vocab::HuggingFace(v) => v.token_type(id),
        }
    }

    /// The id of a token with exactly this stored text.
    #[must_use]
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.vocab {
            Vocab::Gguf(v) => v.token_id(text),
            Vocab::HuggingFace(v) => v.token_id(text),
        }
    }

    /// Beginning-of-sequence token, if the model names one.
    #[must_use]
    pub fn bos(&self) -> Option<u32> {
        self.special.bos
    }

    /// End-of-sequence token, if the model names one.
    #[must_use]
    pub fn eos(&self) -> Option<u32> {
        self.special.eos
    }

    /// The token that stands for the raw byte `b` in a byte-level vocabulary, if it
    /// has one. Text containing a byte without one cannot round-trip: the byte is
    /// dropped, exactly as llama.cpp drops it (SmolLM2 lacks e.g. 0x04, 0x13, 0x1D
    /// and the lead bytes 0xF1/0xF2 of planes 4 to 11).
    #[must_use]
    pub fn byte_token(&self, b: u8) -> Option<u32> {
        self.token_id(bpe::ByteAlphabet::gpt2_char(b).encode_utf8(&mut [0; 4]))
    }

    /// Whether `decode(encode(text)) == text` is guaranteed (byte-level
    /// vocabularies): every byte of `text` has a byte token.
    #[must_use]
    pub fn can_round_trip(&self, text: &str) -> bool {
        text.bytes().all(|b| self.byte_token(b).is_some())
    }

    /// Whether generation should stop at `id` (EOS, EOT, and the end-of-turn
    /// tokens llama.cpp recognises by text, e.g. `<|im_end|>` and `<|endoftext|>`).
    #[must_use]
    pub fn is_eog(&self, id: u32) -> bool {
        self.special.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    #[must_use]
    pub fn eog_tokens(&self) -> &[u32] {
        &self.special.eog
    }

    /// Encodes with [`EncodeOptions::default`] (special tokens parsed, BOS/EOS as
    /// the vocabulary says).
    #[must_use]
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, EncodeOptions::default())
    }

    /// Encodes `text`. The GGUF's vocabulary cannot fail; a `tokenizer.json` can
    /// (see [`Tokenizer::try_encode_with`]), and then the failure is logged and the
    /// result is empty, which every caller refuses as an empty prompt.
    #[must_use]
    pub fn encode_with(&self, text: &str, options: EncodeOptions) -> Vec<u32> {
        self.try_encode_with(text, options).unwrap_or_else(|error| {
            tracing::warn!(%error, bytes = text.len(), "a text could not be tokenized");
            Vec::new()
        })
    }

    /// Encodes `text`.
    ///
    /// # Errors
    /// Only with a `tokenizer.json`: [`TokenizerError::Encode`], e.g. a
    /// pre-tokenizer regex past its backtracking limit.
    pub fn try_encode_with(
        &self,
        text: &str,
        options: EncodeOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.vocab {
            Vocab::Gguf(v) => {
                let mut out = Vec::new();
                if options.add_special && self.special.add_bos {
                    out.extend(self.special.bos);
                }
                v.encode_into(text, options.parse_special, &mut out);
                if options.add_special && self.special.add_eos {
                    out.extend(self.special.eos);
                }
                Ok(out)
            }
            Vocab::HuggingFace(v) => v.encode(text, options),
        }
    }

    /// Appends the bytes token `id` renders as. For a `tokenizer.json`, whose
    /// decoder works on text, these are the UTF-8 of the token decoded alone (a
    /// partial character is U+FFFD); streaming goes through [`IncrementalDecoder`].
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary.
    pub fn append_token_bytes(
        &self,
        id: u32,
        options: DecodeOptions,
        out: &mut Vec<u8>,
    ) -> Result<(), TokenizerError> {
        match &self.vocab {
            Vocab::Gguf(v) => v.append_token_bytes(id, options.skip_special, out),
            Vocab::HuggingFace(v) => {
                out.extend_from_slice(v.decode(&[id], options.skip_special)?.as_bytes());
                Ok(())
            }
        }
    }

    /// The bytes of a sequence of tokens (for a `tokenizer.json`: of its decoded
    /// text).
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary.
    pub fn decode_bytes(
        &self,
        ids: &[u32],
        options: DecodeOptions,
    ) -> Result<Vec<u8>, TokenizerError> {
        match &self.vocab {
            Vocab::Gguf(v) => {
                let mut out = Vec::new();
                for &id in ids {
                    v.append_token_bytes(id, options.skip_special, &mut out)?;
                }
                Ok(out)
            }
            Vocab::HuggingFace(v) => Ok(v.decode(ids, options.skip_special)?.into_bytes()),
        }
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
        match &self.vocab {
            Vocab::Gguf(_) => {
                let bytes = self.decode_bytes(ids, options)?;
                Ok(match String::from_utf8(bytes) {
                    Ok(s) => s,
                    Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
                })
            }
            Vocab::HuggingFace(v) => v.decode(ids, options.skip_special),
        }
    }
}

#[cfg(test)]
mod tests;
