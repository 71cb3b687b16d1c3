//! Byte-level BPE: GPT-2's byte↔unicode alphabet and the merge loop.
//!
//! Byte-level vocabularies store every token as text over a 256-character
//! alphabet in which each byte has a printable stand-in (GPT-2's
//! `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the other 68
//! bytes to U+0100.. in order). A word is first rewritten in that alphabet, then
//! merged.
//!
//! The merge loop is llama.cpp's `llm_tokenizer_bpe_session::tokenize`: start from
//! one symbol per alphabet character, repeatedly merge the adjacent pair with the
//! lowest merge rank (ties: the leftmost pair), until no adjacent pair has a rank.
//! A priority queue holds candidate pairs; entries made stale by an earlier merge
//! are recognised by their recorded lengths and skipped.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The GPT-2 byte→char table and its inverse.
#[derive(Debug, Clone)]
pub struct ByteAlphabet {
    to_char: [char; 256],
    to_byte: HashMap<char, u8>,
}

impl ByteAlphabet {
    /// Builds GPT-2's `bytes_to_unicode` table.
    #[must_use]
    pub fn gpt2() -> Self {
        let to_char: [char; 256] = std::array::from_fn(|b| Self::gpt2_char(b as u8));
        let to_byte = (0..=255u8).map(|b| (to_char[usize::from(b)], b)).collect();
        Self { to_char, to_byte }
    }

    /// GPT-2's stand-in character for byte `b`: printable Latin-1 bytes stand for
    /// themselves, the others are U+0100.. in byte order.
    #[must_use]
    pub fn gpt2_char(b: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(b) {
            return char::from(b);
        }
        let below = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + below).unwrap_or('\u{FFFD}')
    }

    /// Rewrites `text`'s UTF-8 bytes in the alphabet.
    #[must_use]
    pub fn encode(&self, text: &str) -> String {
        text.bytes().map(|b| self.to_char[usize::from(b)]).collect()
    }

    /// Appends the bytes a token's text stands for. A character outside the
    /// alphabet (possible only in a malformed vocabulary) is kept as its own UTF-8,
    /// which loses nothing, where llama.cpp would print an `[UNK_BYTE_..]` marker.
    pub fn decode_into(&self, token_text: &str, out: &mut Vec<u8>) {
        for c in token_text.chars() {
            match self.to_byte.get(&c) {
                Some(&b) => out.push(b),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
    }
}

/// Merge ranks from `tokenizer.ggml.merges`.
#[derive(Debug, Clone)]
pub struct Merges {
    /// Keyed by `"left right"`. Byte-level symbols never contain a raw space (byte
    /// 0x20 is written `Ġ`), so the joined key is unambiguous.
    ranks: HashMap<String, u32>,
}

impl Merges {
    /// Builds ranks from merge lines `"left right"`, split at the first space after
    /// the first character (as llama.cpp does, so a merge of a space-like symbol
    /// still parses). The first occurrence of a duplicate keeps its rank. Lines
    /// without a separator are ignored, as llama.cpp effectively does.
    #[must_use]
    pub fn new(lines: &[String]) -> Self {
        let mut ranks = HashMap::with_capacity(lines.len());
        for (rank, line) in lines.iter().enumerate() {
            let first_len = line.chars().next().map_or(0, char::len_utf8);
            if line[first_len..].contains(' ') {
                ranks.entry(line.clone()).or_insert(rank as u32);
            }
        }
        Self { ranks }
    }

    fn rank(&self, key: &mut String, left: &str, right: &str) -> Option<u32> {
        key.clear();
        key.push_str(left);
        key.push(' ');
        key.push_str(right);
        self.ranks.get(key.as_str()).copied()
    }

    /// Splits an alphabet-encoded word into its final BPE symbols (byte ranges).
    #[must_use]
    pub fn apply(&self, word: &str) -> Vec<std::ops::Range<usize>> {
        #[derive(Clone, Copy)]
        struct Symbol {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let n = word.chars().count();
        let mut symbols: Vec<Symbol> = word
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
            })
            .collect();

        // Pairs are ordered by (rank, left index); the lengths they had when queued
        // detect staleness.
        // Entries: (rank, left, right, left len, right len), smallest first.
        type Queue = BinaryHeap<Reverse<(u32, usize, usize, usize, usize)>>;
        let mut queue = Queue::new();
        let mut key = String::new();
        let text = |s: &Symbol| &word[s.start..s.start + s.len];
        let mut push =
            |symbols: &[Symbol], queue: &mut Queue, l: Option<usize>, r: Option<usize>| {
                let (Some(l), Some(r)) = (l, r) else { return };
                let (ls, rs) = (&symbols[l], &symbols[r]);
                if let Some(rank) = self.rank(&mut key, text(ls), text(rs)) {
                    queue.push(Reverse((rank, l, r, ls.len, rs.len)));
                }
            };
        for i in 1..n {
            push(&symbols, &mut queue, Some(i - 1), Some(i));
        }

        while let Some(Reverse((_, l, r, l_len, r_len))) = queue.pop() {
            let (ls, rs) = (symbols[l], symbols[r]);
            // A merge since queueing changed one side (a symbol only grows, or
            // drops to zero when absorbed); the pair no longer exists as queued.
            if ls.len == 0
                || rs.len == 0
                || ls.len != l_len
                || rs.len != r_len
                || ls.next != Some(r)
            {
                continue;
            }
            symbols[l].len += rs.len;
            symbols[r].len = 0;
            symbols[l].next = rs.next;
            if let Some(nx) = rs.next {
                symbols[nx].prev = Some(l);
            }
            let prev = symbols[l].prev;
            let next = symbols[l].next;
            push(&symbols, &mut queue, prev, Some(l));
            push(&symbols, &mut queue, Some(l), next);
        }

        symbols
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| s.start..s.start + s.len)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_matches_gpt2() {
        let a = ByteAlphabet::gpt2();
        assert_eq!(a.encode(" hello\n"), "Ġhello\u{10a}");
        assert_eq!(a.encode("é"), "Ã©");
        let mut back = Vec::new();
        a.decode_into(&a.encode("héllo 🚀"), &mut back);
        assert_eq!(back, "héllo 🚀".as_bytes());
        // All 256 bytes have distinct stand-ins.
        assert_eq!(a.to_byte.len(), 256);
    }

    #[test]
    fn merges_lowest_rank_first_then_leftmost() {
        let m = Merges::new(&["a b".into(), "b c".into(), "ab c".into(), "c c".into()]);
        let split =
            |w: &str| -> Vec<String> { m.apply(w).into_iter().map(|r| w[r].to_owned()).collect() };
        assert_eq!(split("abc"), ["abc"]);
        // "bc" would need "b c" (rank 1) but "a b" (rank 0) wins first.
        assert_eq!(split("abcc"), ["abc", "c"]);
        // Tie on rank between two "c c" pairs: the leftmost merges.
        assert_eq!(split("ccc"), ["cc", "c"]);
        assert_eq!(split("x"), ["x"]);
        assert!(split("").is_empty());
    }
}
