//! Streaming-safe detokenization.
//!
//! A byte-level token can end in the middle of a multi-byte UTF-8 character (an
//! emoji is often two or three tokens). [`IncrementalDecoder`] turns a stream of
//! token ids into text without ever emitting a half character: it holds back an
//! incomplete trailing sequence until the bytes that complete it arrive.
//!
//! With the GGUF's vocabulary it works on the tokens' bytes. With a
//! `tokenizer.json`, whose decoder maps ids to text, it runs the `tokenizers`
//! crate's own streaming decoder (`DecodeStream`: decode a short window of ids and
//! emit what grew past the text already sent, unless it ends in U+FFFD), keeping the
//! window's text as what [`IncrementalDecoder::finish`] returns.
//!
//! Invariant: the concatenation of everything [`IncrementalDecoder::push`] and
//! [`IncrementalDecoder::finish`] return equals [`super::Tokenizer::decode_with`] of
//! the same ids (for the GGUF's vocabulary, `String::from_utf8_lossy` of all the
//! token bytes). There, invalid bytes become U+FFFD as soon as they are known to be
//! invalid (the same maximal-subpart rule `from_utf8_lossy` uses), so streaming never
//! stalls on them; the crate's decoder holds text back while it ends in U+FFFD.

use super::hugging_face::StreamState;
use super::{DecodeOptions, Tokenizer, TokenizerError, Vocab};

/// Decodes a token stream into text chunks that are always whole characters.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    options: DecodeOptions,
    /// Bytes received but not yet emitted: at most an incomplete UTF-8 prefix
    /// (GGUF vocabulary).
    pending: Vec<u8>,
    /// The `tokenizer.json` decoder's window, and the text it holds back.
    stream: StreamState,
    held: String,
}

impl IncrementalDecoder {
    /// A decoder with the given options.
    #[must_use]
    pub fn new(options: DecodeOptions) -> Self {
        Self {
            options,
            ..Self::default()
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    ///
    /// # Errors
    /// [`TokenizerError::UnknownToken`] for an id outside the vocabulary; the
    /// decoder's state is unchanged then.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        match &tokenizer.vocab {
            Vocab::Gguf(v) => {
                v.append_token_bytes(id, self.options.skip_special, &mut self.pending)?;
                Ok(self.drain(false))
            }
            Vocab::HuggingFace(v) => {
                let skip = self.options.skip_special;
                match v.step_decode(id, skip, &mut self.stream)? {
                    Some(text) => {
                        self.held.clear();
                        Ok(text)
                    }
                    None => {
                        self.held = v.held_text(skip, &self.stream)?;
                        Ok(String::new())
                    }
                }
            }
        }
    }

    /// Ends the stream: returns what is held back, with an incomplete trailing
    /// sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.stream = StreamState::default();
        let mut out = std::mem::take(&mut self.held);
        out.push_str(&self.drain(true));
        out
    }

    /// Bytes held back waiting for the rest of a character (GGUF vocabulary).
    #[must_use]
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // Cannot fail: `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // An incomplete sequence at the end: wait for more bytes.
                        None if !at_end => {
                            rest = after;
                            break;
                        }
                        None => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &[];
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }
}
