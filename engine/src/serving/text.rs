//! Stop strings over streamed text: emit text as soon as it cannot be the start of
//! a stop string, hold back only the longest tail that still could be, and cut at
//! the first complete match (the stop string itself is not emitted, as in OpenAI's
//! API).

/// Incremental stop-string matcher for one request.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// Result of feeding text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopStep {
    /// Text safe to emit now.
    pub emit: String,
    /// A stop string matched; nothing more should be emitted.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    #[must_use]
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Feeds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopStep {
        self.pending.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let emit = self.pending[..at].to_string();
            self.pending.clear();
            return StopStep {
                emit,
                stopped: true,
            };
        }
        // Longest suffix of `pending` that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    hold = hold.max(i);
                }
            }
        }
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopStep {
            emit,
            stopped: false,
        }
    }

    /// The held-back text, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| (*s).to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let s = m.push(p);
            out.push_str(&s.emit);
            if s.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn cuts_at_a_stop_split_across_pieces() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "Dxyz"]),
            ("abc ".into(), true)
        );
        assert_eq!(
            run(&["\n\n", "."], &["one", " two.", "three"]),
            ("one two".into(), true)
        );
    }

    #[test]
    fn holds_back_only_a_possible_prefix() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abcE").emit, "abc");
        assert_eq!(m.push("x").emit, "Ex");
        assert_eq!(run(&["END"], &["E", "N"]), ("EN".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run(&["é!"], &["café", "?"]), ("café?".into(), false));
    }
}
