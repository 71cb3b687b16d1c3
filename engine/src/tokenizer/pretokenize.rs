//! Pre-tokenizers: split text into the words that byte-level BPE merges within.
//!
//! These are ports of llama.cpp's splitters (src/unicode.cpp), not of the regexes
//! in Hugging Face `tokenizer.json` files, because llama.cpp's token ids are the
//! reference this engine is tested against. The two differ in details a regex
//! engine would get "right" and llama.cpp does not do (and vice versa), so the code
//! follows llama.cpp step by step:
//!
//! - llama.cpp applies its list of regexes in sequence: each one splits every piece
//!   produced by the previous one, keeping the text between matches as pieces of
//!   its own. A later regex never sees across an earlier split, which matters for
//!   the look-ahead in `\s+(?!\S)`.
//! - `\p{N}` alone is run by std::regex over a "collapsed" text in which every
//!   codepoint whose Unicode general category is N* becomes one marker byte; so it
//!   isolates every number codepoint (ASCII digits and other N* alike).
//! - The GPT-2 regex is never run as a regex: llama.cpp recognises the pattern and
//!   calls a hand-written scanner, `unicode_regex_split_custom_gpt2`, ported below
//!   as [`split_gpt2`]. Its categories are general categories (`L*` letter, `N*`
//!   number) and Unicode `White_Space`, which is exactly `char::is_whitespace`.
//!
//! We use a hand-written splitter rather than `fancy-regex` for the same reason
//! llama.cpp does: the backtracking look-ahead is the slow part of a regex engine,
//! and a scanner makes the matching order explicit enough to compare line by line.
//!
//! Invariant: the pieces returned by [`PreTokenizer::split`] are non-empty and
//! concatenate to the input exactly.

use std::ops::Range;

use unicode_general_category::{GeneralCategory, get_general_category};

/// Which of llama.cpp's regex sets a vocabulary uses (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `\p{N}` then the GPT-2 pattern: llama.cpp's STARCODER group (starcoder,
    /// refact, command-r, smollm, codeshell, exaone, minerva-7b).
    DigitsThenGpt2,
    /// The GPT-2 pattern alone (gpt-2, mpt, olmo, jais).
    Gpt2,
}

impl PreTokenizer {
    /// Maps a `tokenizer.ggml.pre` value to a splitter, for the names whose rules
    /// are ported here; other names are refused rather than approximated.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone"
            | "minerva-7b" => Some(Self::DigitsThenGpt2),
            "gpt-2" | "mpt" | "olmo" | "jais" => Some(Self::Gpt2),
            _ => None,
        }
    }

    /// Splits `text` into words (byte ranges of `text`).
    #[must_use]
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        // Work in codepoints, as llama.cpp does, and map back to byte offsets.
        let chars: Vec<char> = text.chars().collect();
        let mut byte_at = Vec::with_capacity(chars.len() + 1);
        byte_at.extend(text.char_indices().map(|(i, _)| i));
        byte_at.push(text.len());

        let mut pieces = Vec::new();
        match self {
            Self::Gpt2 => split_gpt2(&chars, 0..chars.len(), &mut pieces),
            Self::DigitsThenGpt2 => {
                for piece in split_each_number(&chars) {
                    split_gpt2(&chars, piece, &mut pieces);
                }
            }
        }
        pieces
            .into_iter()
            .map(|r| byte_at[r.start]..byte_at[r.end])
            .collect()
    }
}

/// The three properties the GPT-2 scanner looks at.
#[derive(Debug, Clone, Copy, Default)]
struct Flags {
    letter: bool,
    number: bool,
    whitespace: bool,
}

fn flags(c: char) -> Flags {
    use GeneralCategory::*;
    let cat = get_general_category(c);
    Flags {
        letter: matches!(
            cat,
            UppercaseLetter | LowercaseLetter | TitlecaseLetter | ModifierLetter | OtherLetter
        ),
        number: matches!(cat, DecimalNumber | LetterNumber | OtherNumber),
        whitespace: c.is_whitespace(),
    }
}

/// `\p{N}` as llama.cpp's collapsed std::regex applies it: every number codepoint
/// becomes its own piece, and each run of other codepoints stays one piece.
fn split_each_number(chars: &[char]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &c) in chars.iter().enumerate() {
        if flags(c).number {
            if start < i {
                out.push(start..i);
            }
            out.push(i..i + 1);
            start = i + 1;
        }
    }
    if start < chars.len() {
        out.push(start..chars.len());
    }
    out
}

/// Port of llama.cpp's `unicode_regex_split_custom_gpt2` over `chars[range]`:
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
/// Positions outside `range` are "out of range" (no flags), exactly as in the
/// original, so nothing matches across the piece boundary.
fn split_gpt2(chars: &[char], range: Range<usize>, out: &mut Vec<Range<usize>>) {
    let (ini, end) = (range.start, range.end);
    let cpt = |p: usize| (p < end).then(|| chars[p]);
    let flags_at = |p: usize| cpt(p).map(flags);
    let is = |p: usize, f: fn(Flags) -> bool| flags_at(p).is_some_and(f);
    // "[^\s\p{L}\p{N}]": any in-range codepoint of another category.
    let other = |f: Flags| !(f.whitespace || f.letter || f.number);

    // Invariant at the top of the loop: everything before `pos` has been emitted.
    let mut pos = ini;
    let emit = |from: usize, to: usize, out: &mut Vec<Range<usize>>| {
        if to > from {
            out.push(from..to);
        }
    };
    while pos < end {
        let start = pos;
        let c = chars[pos];

        if c == '\'' && pos + 1 < end {
            let next = chars[pos + 1];
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += 2;
                emit(start, pos, out);
                continue;
            }
            if pos + 2 < end {
                let pair = (next, chars[pos + 2]);
                if matches!(pair, ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    pos += 3;
                    emit(start, pos, out);
                    continue;
                }
            }
        }

        // An optional leading space is judged by the codepoint after it.
        let lead = usize::from(c == ' ');
        let f2 = if c == ' ' {
            flags_at(pos + 1)
        } else {
            Some(flags(c))
        };
        if f2.is_some_and(|f| f.letter) {
            pos += lead;
            while is(pos, |f| f.letter) {
                pos += 1;
            }
            emit(start, pos, out);
            continue;
        }
        if f2.is_some_and(|f| f.number) {
            pos += lead;
            while is(pos, |f| f.number) {
                pos += 1;
            }
            emit(start, pos, out);
            continue;
        }
        if f2.is_some_and(other) {
            pos += lead;
            while is(pos, other) {
                pos += 1;
            }
            emit(start, pos, out);
            continue;
        }

        let mut n_ws = 0;
        while is(pos + n_ws, |f| f.whitespace) {
            n_ws += 1;
        }
        if n_ws > 1 && cpt(pos + n_ws).is_some() {
            // \s+(?!\S): leave the last space to lead the next word.
            pos += n_ws - 1;
        } else if n_ws > 0 {
            pos += n_ws;
        } else {
            pos += 1;
        }
        emit(start, pos, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_pattern_cases() {
        let g = PreTokenizer::Gpt2;
        assert_eq!(words(g, "Hello world"), ["Hello", " world"]);
        assert_eq!(
            words(g, "I'm here, they'll go"),
            ["I", "'m", " here", ",", " they", "'ll", " go"]
        );
        // \s+(?!\S): the last space of a run joins the following word.
        assert_eq!(words(g, "a   b"), ["a", "  ", " b"]);
        assert_eq!(words(g, "a \n b"), ["a", " \n", " b"]);
        assert_eq!(words(g, "end  "), ["end", "  "]);
        assert_eq!(words(g, "x=1+22"), ["x", "=", "1", "+", "22"]);
        assert_eq!(words(g, " ?!"), [" ?!"]);
        assert_eq!(words(g, "l'été"), ["l", "'", "été"]);
    }

    #[test]
    fn digits_are_isolated_before_the_gpt2_pattern() {
        let s = PreTokenizer::DigitsThenGpt2;
        assert_eq!(
            words(s, "from 1,234 to"),
            ["from", " ", "1", ",", "2", "3", "4", " to"]
        );
        // The digit split hides the following text from the look-ahead: "  " stays
        // one piece because the '7' after it is in another piece.
        assert_eq!(words(s, "a  7"), ["a", "  ", "7"]);
        // Non-ASCII numbers are numbers too (U+00B2 SUPERSCRIPT TWO is No).
        assert_eq!(words(s, "x²"), ["x", "²"]);
    }

    #[test]
    fn pieces_cover_the_input() {
        for text in [
            "",
            " ",
            "\t\n",
            "先保护 GPU 跑得",
            "🚀🔥 and 👩\u{200d}💻",
            "a'",
            "''ll",
        ] {
            for pre in [PreTokenizer::Gpt2, PreTokenizer::DigitsThenGpt2] {
                let pieces = words(pre, text);
                assert!(pieces.iter().all(|p| !p.is_empty()));
                assert_eq!(pieces.concat(), text);
            }
        }
    }

    #[test]
    fn names_map_to_llama_cpp_groups() {
        assert_eq!(
            PreTokenizer::from_name("smollm"),
            Some(PreTokenizer::DigitsThenGpt2)
        );
        assert_eq!(PreTokenizer::from_name("gpt-2"), Some(PreTokenizer::Gpt2));
        assert_eq!(PreTokenizer::from_name("llama3"), None);
    }
}
