//! A Hugging Face `tokenizer.json` (`serve --tokenizer`), run by the maintained
//! `tokenizers` crate: its normalizer, pre-tokenizer, model, added tokens,
//! post-processor and decoder, whatever the file configures. Nothing of it is
//! re-implemented here; this module only adapts it to [`super::Tokenizer`]'s shape.
//!
//! Mapping to llama.cpp's notions (so one `tokenizer.json` built from a GGUF's
//! vocabulary encodes and decodes as that vocabulary does):
//! - `parse_special = false` is the crate's `encode_special_tokens`: added tokens
//!   marked `special` are then encoded as text, non-special added tokens (llama.cpp's
//!   USER_DEFINED) are still recognised;
//! - `skip_special` is the crate's `skip_special_tokens`: added tokens marked
//!   `special` (llama.cpp's CONTROL) decode to nothing;
//! - `add_special` is the crate's `add_special_tokens`, i.e. the file's own
//!   post-processor decides where BOS/EOS go, not the GGUF's `add_bos_token`.
//!
//! Invariant: `texts[id]` is the crate's `id_to_token(id)` for every id up to the
//! largest the file defines; ids it leaves out are `None`, and decoding them is
//! [`TokenizerError::UnknownToken`] (the crate would silently drop them).

use std::sync::OnceLock;

use super::{EncodeOptions, TokenType, TokenizerError};

/// A loaded `tokenizer.json`.
#[derive(Debug, Clone)]
pub(super) struct HfVocab {
    tokenizer: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens encoded as plain text, made on first
    /// use (only `EncodeOptions { parse_special: false }` needs it).
    literal: OnceLock<tokenizers::Tokenizer>,
    /// Stored text and type per id: the crate returns texts by value.
    texts: Vec<Option<(String, TokenType)>>,
}

impl HfVocab {
    /// Parses a `tokenizer.json`.
    ///
    /// # Errors
    /// [`TokenizerError::TokenizerJson`] when the crate cannot read it, or when it has
    /// no decoder (its ids could not be turned back into text).
    pub(super) fn from_json(json: &[u8]) -> Result<Self, TokenizerError> {
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(json).map_err(TokenizerError::TokenizerJson)?;
        if tokenizer.get_decoder().is_none() {
            return Err(TokenizerError::TokenizerJson(
                "it has no decoder, so its ids cannot be turned back into text".into(),
            ));
        }
        let vocab = tokenizer.get_vocab(true);
        let n_ids = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let added = tokenizer.get_added_tokens_decoder();
        let mut texts = vec![None; n_ids];
        for (text, id) in vocab {
            let ty = match added.get(&id) {
                Some(t) if t.special => TokenType::Control,
                Some(_) => TokenType::UserDefined,
                None => TokenType::Normal,
            };
            texts[id as usize] = Some((text, ty));
        }
        Ok(Self {
            tokenizer,
            literal: OnceLock::new(),
            texts,
        })
    }

    /// One past the largest id.
    pub(super) fn len(&self) -> usize {
        self.texts.len()
    }

    pub(super) fn token_text(&self, id: u32) -> Option<&str> {
        self.entry(id).map(|(t, _)| t.as_str())
    }

    pub(super) fn token_type(&self, id: u32) -> Option<TokenType> {
        self.entry(id).map(|&(_, ty)| ty)
    }

    pub(super) fn token_id(&self, text: &str) -> Option<u32> {
        self.tokenizer.token_to_id(text)
    }

    fn entry(&self, id: u32) -> Option<&(String, TokenType)> {
        self.texts.get(id as usize).and_then(Option::as_ref)
    }

    /// Encodes `text` with the file's rules.
    ///
    /// # Errors
    /// [`TokenizerError::Encode`] from the crate (e.g. a pre-tokenizer regex past
    /// its backtracking limit).
    pub(super) fn encode(
        &self,
        text: &str,
        options: EncodeOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        let tokenizer = if options.parse_special {
            &self.tokenizer
        } else {
            self.literal.get_or_init(|| {
                let mut t = self.tokenizer.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let encoding = tokenizer
            .encode_fast(text, options.add_special)
            .map_err(TokenizerError::Encode)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Checks that every id is defined (the crate would drop unknown ones silently).
    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| self.entry(id).is_none()) {
            Some(&id) => Err(TokenizerError::UnknownToken(id)),
            None => Ok(()),
        }
    }

    /// Decodes with the file's decoder.
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id the file does not define, or the
    /// decoder's error.
    pub(super) fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(TokenizerError::Decode)
    }

    /// One step of the crate's streaming decoder (`DecodeStream`, whose state
    /// [`super::IncrementalDecoder`] keeps): the text `id` completes, or `None`
    /// while the decoded window ends in an incomplete character.
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] (the state is unchanged then), or the
    /// crate's error.
    pub(super) fn step_decode(
        &self,
        id: u32,
        skip_special: bool,
        state: &mut StreamState,
    ) -> Result<Option<String>, TokenizerError> {
        self.check_ids(&[id])?;
        // `DecodeStream::step` itself, as a function over state we own (the crate
        // exports it for its Python binding, which has the same borrowing problem).
        tokenizers::tokenizer::step_decode_stream(
            &self.tokenizer,
            vec![id],
            skip_special,
            &mut state.ids,
            &mut state.prefix,
            &mut state.prefix_index,
        )
        .map_err(TokenizerError::Decode)
    }

    /// The text of the window the streaming decoder holds back (beyond the prefix it
    /// already emitted), as a whole decode would render it.
    ///
    /// # Errors
    /// The decoder's error.
    pub(super) fn held_text(
        &self,
        skip_special: bool,
        state: &StreamState,
    ) -> Result<String, TokenizerError> {
        let text = self.decode(&state.ids, skip_special)?;
        Ok(match text.strip_prefix(state.prefix.as_str()) {
            Some(rest) => rest.to_owned(),
            None => text,
        })
    }
}

/// The crate's `DecodeStream` state, kept apart from the tokenizer so a decoder
/// does not borrow it.
#[derive(Debug, Clone, Default)]
pub(super) struct StreamState {
    /// The window of ids not yet fully emitted, with the ids of `prefix` first.
    pub(super) ids: Vec<u32>,
    /// The text of `ids[..prefix_index]`, already emitted.
    pub(super) prefix: String,
    pub(super) prefix_index: usize,
}
