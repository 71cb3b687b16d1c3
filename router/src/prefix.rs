//! The router's approximate prefix index: which leading blocks of a prompt each endpoint
//! probably holds in its KV cache.
//!
//! The router has no tokenizer, so it follows llm-d inference scheduler's *approximate*
//! prefix-cache scorer: the prompt text is cut into fixed-size blocks of characters
//! ([`block_hashes`], about one engine KV block each), each block's hash chained to its
//! predecessor's as the engine chains its KV block hashes, and per endpoint the index
//! remembers the hashes of what the router itself sent there, under an LRU bound and a
//! TTL. It is approximate in two ways, both deliberate: it does not see the engine's own
//! evictions (the TTL and the LRU bound stand in for them), and character blocks are not
//! token blocks (the cost only needs overlap in proportion, not exact).
//!
//! Invariants:
//! - An endpoint holds at most `max_blocks_per_endpoint` hashes.
//! - [`PrefixIndex::overlap`] counts leading blocks only: because hashes chain, block `i`
//!   is useless to the engine without blocks `0..i`, so the count stops at the first miss.
//! - Nothing reads the clock: `now` is a parameter.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest as _, Sha256};

/// Marks the start of a message's role in [`prompt_text`], and the start of its content.
/// Control characters that ordinary text does not contain, so a role boundary never
/// hashes like message text.
const ROLE_MARK: char = '\u{1}';
const CONTENT_MARK: char = '\u{2}';

/// The text the engine will prefill, as far as the router can see it: for chat, each
/// message's role and content in order (content may be a string or an array of
/// `{type:"text", text}` parts); for completions, `prompt` (string, or first element of
/// an array of strings). Empty if none.
///
/// The rendering is not the engine's chat template (the router does not have it); what
/// matters is that it is a function of the prefix: a conversation that grows by a turn
/// renders to an extension of its previous text, so its earlier blocks hash the same.
/// Non-text content parts (images) are skipped: a text-only router cannot see them.
#[must_use]
pub fn prompt_text(body: &Value) -> String {
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        let mut out = String::new();
        for message in messages {
            out.push(ROLE_MARK);
            if let Some(role) = message.get("role").and_then(Value::as_str) {
                out.push_str(role);
            }
            out.push(CONTENT_MARK);
            match message.get("content") {
                Some(Value::String(text)) => out.push_str(text),
                Some(Value::Array(parts)) => {
                    for part in parts {
                        if part.get("type").and_then(Value::as_str) == Some("text")
                            && let Some(text) = part.get("text").and_then(Value::as_str)
                        {
                            out.push_str(text);
                        }
                    }
                }
                // null (an assistant turn with tool calls) or absent: no text.
                _ => {}
            }
        }
        return out;
    }
    match body.get("prompt") {
        Some(Value::String(prompt)) => prompt.clone(),
        Some(Value::Array(prompts)) => prompts
            .first()
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// Chained hashes of each full block of `block_chars` characters (chars, not bytes; the
/// last partial block is not hashed): hash `i` covers `text[0 .. (i+1)*block_chars]`, as
/// the engine chains its KV block hashes. `block_chars == 0` gives no blocks.
///
/// Each hash is the first 8 bytes of SHA-256 over (parent hash, block text), like the
/// engine's block hashes, so the same prompt gives the same hashes on every router
/// replica and build. The cost is small next to the request itself (one digest per
/// block of ~64 characters).
#[must_use]
pub fn block_hashes(text: &str, block_chars: usize) -> Vec<u64> {
    if block_chars == 0 {
        return Vec::new();
    }
    let mut hashes = Vec::with_capacity(text.len() / block_chars);
    let mut parent: Option<u64> = None;
    let mut block_start = 0usize;
    let mut chars_in_block = 0usize;
    for (offset, c) in text.char_indices() {
        chars_in_block += 1;
        if chars_in_block == block_chars {
            let block_end = offset + c.len_utf8();
            let hash = chain(parent, &text[block_start..block_end]);
            hashes.push(hash);
            parent = Some(hash);
            block_start = block_end;
            chars_in_block = 0;
        }
    }
    hashes
}

fn chain(parent: Option<u64>, block: &str) -> u64 {
    let mut h = Sha256::new();
    // A tag byte, so the first block and a block whose parent hash happens to be its
    // own prefix bytes cannot collide by construction.
    match parent {
        None => h.update([0u8]),
        Some(p) => {
            h.update([1u8]);
            h.update(p.to_le_bytes());
        }
    }
    h.update(block.as_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// Per endpoint, the block hashes the router sent there, bounded by an LRU and a TTL.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    max_blocks_per_endpoint: usize,
    ttl: Duration,
    endpoints: HashMap<String, EndpointBlocks>,
}

/// One endpoint's blocks.
///
/// The LRU is a generation counter: every insert or refresh takes the next generation,
/// `blocks` maps a hash to its generation and last use, and `by_generation` orders hashes
/// oldest first, so both a refresh and an eviction cost O(log n) and one `record` is
/// O(blocks · log n). A `BTreeMap` keyed by generation rather than by `Instant`, because
/// many blocks share one `now` and generations are unique.
#[derive(Debug, Clone, Default)]
struct EndpointBlocks {
    blocks: HashMap<u64, Entry>,
    by_generation: BTreeMap<u64, u64>,
    next_generation: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    generation: u64,
    last_used: Instant,
}

impl PrefixIndex {
    /// An empty index that keeps at most `max_blocks_per_endpoint` blocks per endpoint,
    /// each for `ttl` after the router last sent it there.
    #[must_use]
    pub fn new(max_blocks_per_endpoint: usize, ttl: Duration) -> Self {
        Self {
            max_blocks_per_endpoint,
            ttl,
            endpoints: HashMap::new(),
        }
    }

    /// Leading blocks of `hashes` this endpoint is believed to hold (stops at the first
    /// miss or expired entry).
    #[must_use]
    pub fn overlap(&self, endpoint: &str, hashes: &[u64], now: Instant) -> usize {
        let Some(ep) = self.endpoints.get(endpoint) else {
            return 0;
        };
        hashes
            .iter()
            .take_while(|h| {
                ep.blocks
                    .get(h)
                    .is_some_and(|e| !expired(e.last_used, now, self.ttl))
            })
            .count()
    }

    /// The router sent these blocks to this endpoint: insert/refresh them (LRU eviction
    /// beyond `max_blocks_per_endpoint`).
    ///
    /// Generations are assigned from the last block to the first, so within one prompt
    /// the leading blocks are the most recently used and the tail is evicted first: the
    /// engine needs block 0 to use block 1, never the reverse (vLLM frees a request's
    /// blocks tail first for the same reason). Entries past their TTL are dropped from
    /// the old end as well, so an idle endpoint's memory shrinks with the next record.
    pub fn record(&mut self, endpoint: &str, hashes: &[u64], now: Instant) {
        if self.max_blocks_per_endpoint == 0 || hashes.is_empty() {
            return;
        }
        let ep = match self.endpoints.get_mut(endpoint) {
            Some(ep) => ep,
            None => self.endpoints.entry(endpoint.to_owned()).or_default(),
        };
        for &hash in hashes.iter().rev() {
            let generation = ep.next_generation;
            ep.next_generation += 1;
            let entry = Entry {
                generation,
                last_used: now,
            };
            if let Some(old) = ep.blocks.insert(hash, entry) {
                ep.by_generation.remove(&old.generation);
            }
            ep.by_generation.insert(generation, hash);
        }
        while let Some((&generation, &hash)) = ep.by_generation.first_key_value() {
            let over = ep.blocks.len() > self.max_blocks_per_endpoint;
            let stale = ep
                .blocks
                .get(&hash)
                .is_none_or(|e| expired(e.last_used, now, self.ttl));
            if !over && !stale {
                break;
            }
            ep.by_generation.remove(&generation);
            ep.blocks.remove(&hash);
        }
    }

    /// Drop everything known about this endpoint (it went away or restarted with an
    /// empty cache).
    pub fn forget(&mut self, endpoint: &str) {
        self.endpoints.remove(endpoint);
    }

    /// Blocks held for this endpoint, expired ones included until a `record` drops them.
    #[must_use]
    pub fn blocks(&self, endpoint: &str) -> usize {
        self.endpoints.get(endpoint).map_or(0, |ep| ep.blocks.len())
    }
}

fn expired(last_used: Instant, now: Instant, ttl: Duration) -> bool {
    now.saturating_duration_since(last_used) > ttl
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const TTL: Duration = Duration::from_secs(60);

    #[test]
    fn chat_text_is_roles_and_contents_in_order() {
        let body = json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [
                    {"type": "text", "text": "Hello "},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "there"}
                ]},
                {"role": "assistant", "content": null, "tool_calls": []},
            ]
        });
        assert_eq!(
            prompt_text(&body),
            "\u{1}system\u{2}You are terse.\u{1}user\u{2}Hello there\u{1}assistant\u{2}"
        );
    }

    #[test]
    fn a_longer_conversation_extends_the_shorter_ones_text() {
        let short = json!({"messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "first question"},
        ]});
        let long = json!({"messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second"},
        ]});
        assert!(prompt_text(&long).starts_with(&prompt_text(&short)));
    }

    #[test]
    fn role_changes_the_text() {
        let a = json!({"messages": [{"role": "user", "content": "x"}]});
        let b = json!({"messages": [{"role": "system", "content": "x"}]});
        assert_ne!(prompt_text(&a), prompt_text(&b));
    }

    #[test]
    fn completion_prompt_is_the_string_or_the_first_of_an_array() {
        assert_eq!(prompt_text(&json!({"prompt": "Once upon"})), "Once upon");
        assert_eq!(
            prompt_text(&json!({"prompt": ["first", "second"]})),
            "first"
        );
    }

    #[test]
    fn no_visible_prompt_is_empty() {
        for body in [
            json!({}),
            json!({"prompt": []}),
            json!({"prompt": [[1, 2, 3]]}),
            json!({"prompt": 42}),
            json!({"messages": "not an array"}),
            json!("just a string"),
        ] {
            assert_eq!(prompt_text(&body), "", "{body}");
        }
        assert_eq!(prompt_text(&json!({"messages": []})), "");
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert!(block_hashes("", 4).is_empty());
        assert!(block_hashes("abc", 4).is_empty());
        assert_eq!(block_hashes("abcd", 4).len(), 1);
        assert_eq!(block_hashes("abcdefg", 4).len(), 1);
        assert_eq!(block_hashes("abcdefgh", 4).len(), 2);
        assert!(block_hashes("abcdefgh", 0).is_empty());
    }

    #[test]
    fn blocks_count_characters_not_bytes() {
        // 8 characters, 24 bytes.
        let text = "日本語のテキスト";
        assert_eq!(text.len(), 24);
        assert_eq!(block_hashes(text, 4).len(), 2);
        // Equal to the hashes of the same characters as separate blocks.
        assert_eq!(
            block_hashes(text, 4)[0],
            block_hashes("日本語の", 4)[0],
            "the first block is its four characters"
        );
    }

    #[test]
    fn hashes_chain_on_the_whole_prefix() {
        let a = block_hashes("AAAABBBB", 4);
        let b = block_hashes("CCCCBBBB", 4);
        // Same second block text, different prefix: different hash.
        assert_ne!(a[1], b[1]);
        // A shared prefix gives shared leading hashes, and the tail does not matter.
        let c = block_hashes("AAAABBBBCCCC", 4);
        assert_eq!(&c[..2], &a[..]);
        // Same block text at another position is another hash.
        let d = block_hashes("AAAAAAAA", 4);
        assert_ne!(d[0], d[1]);
        // Deterministic.
        assert_eq!(block_hashes("AAAABBBB", 4), a);
    }

    #[test]
    fn overlap_counts_leading_blocks_recorded_for_that_endpoint() {
        let now = Instant::now();
        let mut index = PrefixIndex::new(100, TTL);
        let prompt = block_hashes("system prompt, shared by all.. user turn one", 8);
        assert_eq!(prompt.len(), 5);
        index.record("http://a", &prompt[..3], now);
        assert_eq!(index.overlap("http://a", &prompt, now), 3);
        assert_eq!(index.overlap("http://b", &prompt, now), 0);
        // Stops at the first miss even if later blocks are known.
        index.record("http://b", &prompt[1..], now);
        assert_eq!(index.overlap("http://b", &prompt, now), 0);
        assert_eq!(index.overlap("http://b", &prompt[1..], now), 4);
        assert_eq!(index.overlap("http://a", &[], now), 0);
    }

    #[test]
    fn entries_expire_after_the_ttl_and_a_record_refreshes_them() {
        let t0 = Instant::now();
        let mut index = PrefixIndex::new(100, TTL);
        let h = block_hashes("0123456789abcdef", 4);
        index.record("e", &h, t0);
        assert_eq!(
            index.overlap("e", &h, t0 + TTL),
            4,
            "at the TTL, still held"
        );
        assert_eq!(
            index.overlap("e", &h, t0 + TTL + Duration::from_millis(1)),
            0
        );
        // Refreshing the first two blocks later keeps only those alive past the TTL.
        index.record("e", &h[..2], t0 + Duration::from_secs(30));
        let later = t0 + TTL + Duration::from_secs(10);
        assert_eq!(index.overlap("e", &h, later), 2);
    }

    #[test]
    fn an_expired_entry_in_the_middle_stops_the_overlap() {
        let t0 = Instant::now();
        let mut index = PrefixIndex::new(100, TTL);
        let h = block_hashes("aaaabbbbcccc", 4);
        index.record("e", &h, t0);
        let t1 = t0 + Duration::from_secs(50);
        index.record("e", &[h[0]], t1);
        index.record("e", &[h[2]], t1);
        // h[1] was last used at t0 and expired at t0 + 60 s.
        assert_eq!(index.overlap("e", &h, t0 + Duration::from_secs(70)), 1);
    }

    #[test]
    fn record_drops_expired_entries() {
        let t0 = Instant::now();
        let mut index = PrefixIndex::new(100, TTL);
        index.record("e", &block_hashes("aaaabbbbcccc", 4), t0);
        assert_eq!(index.blocks("e"), 3);
        index.record("e", &block_hashes("dddd", 4), t0 + TTL * 2);
        assert_eq!(index.blocks("e"), 1);
    }

    #[test]
    fn lru_evicts_the_least_recently_used_and_the_tail_of_a_prompt_first() {
        let now = Instant::now();
        let mut index = PrefixIndex::new(4, TTL);
        let old = block_hashes("aaaabbbb", 4);
        let new = block_hashes("ccccddddeeee", 4);
        index.record("e", &old, now);
        index.record("e", &new, now);
        assert_eq!(index.blocks("e"), 4);
        // The three new blocks survive; of the old prompt, its head is kept (it was used
        // more recently than its tail).
        assert_eq!(index.overlap("e", &new, now), 3);
        assert_eq!(index.overlap("e", &old, now), 1);

        // Touching the old head again makes the oldest new block (its tail) go next.
        index.record("e", &old[..1], now);
        index.record("e", &block_hashes("ffff", 4), now);
        assert_eq!(index.overlap("e", &old, now), 1);
        assert_eq!(index.overlap("e", &new, now), 2);
    }

    #[test]
    fn a_prompt_longer_than_the_bound_keeps_its_head() {
        let now = Instant::now();
        let mut index = PrefixIndex::new(3, TTL);
        let h = block_hashes(&"x".repeat(40), 4);
        index.record("e", &h, now);
        assert_eq!(index.blocks("e"), 3);
        assert_eq!(index.overlap("e", &h, now), 3);
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        let now = Instant::now();
        let mut index = PrefixIndex::new(0, TTL);
        let h = block_hashes("aaaabbbb", 4);
        index.record("e", &h, now);
        assert_eq!(index.overlap("e", &h, now), 0);
        assert_eq!(index.blocks("e"), 0);
    }

    #[test]
    fn forget_drops_one_endpoint_only() {
        let now = Instant::now();
        let mut index = PrefixIndex::new(10, TTL);
        let h = block_hashes("aaaabbbb", 4);
        index.record("a", &h, now);
        index.record("b", &h, now);
        index.forget("a");
        assert_eq!(index.overlap("a", &h, now), 0);
        assert_eq!(index.overlap("b", &h, now), 2);
        index.forget("never-seen");
    }

    #[test]
    fn endpoints_have_separate_bounds() {
        let now = Instant::now();
        let mut index = PrefixIndex::new(2, TTL);
        let h = block_hashes("aaaabbbb", 4);
        index.record("a", &h, now);
        index.record("b", &block_hashes("ccccdddd", 4), now);
        assert_eq!(index.overlap("a", &h, now), 2);
    }

    proptest! {
        /// Whatever is recorded, an endpoint never holds more than the bound, the two maps
        /// agree, and the most recent record's head is always found.
        #[test]
        fn bound_and_consistency_hold(
            cap in 1usize..8,
            records in proptest::collection::vec(
                (0u8..3, proptest::collection::vec(0u64..20, 0..10), 0u64..120),
                1..40,
            ),
        ) {
            let t0 = Instant::now();
            let mut index = PrefixIndex::new(cap, TTL);
            let mut elapsed = 0u64;
            for (ep, hashes, step) in records {
                elapsed += step;
                let now = t0 + Duration::from_secs(elapsed);
                let name = format!("ep-{ep}");
                index.record(&name, &hashes, now);
                let Some(blocks) = index.endpoints.get(&name) else {
                    prop_assert!(hashes.is_empty());
                    continue;
                };
                prop_assert!(blocks.blocks.len() <= cap);
                prop_assert_eq!(blocks.blocks.len(), blocks.by_generation.len());
                for (generation, hash) in &blocks.by_generation {
                    prop_assert_eq!(blocks.blocks[hash].generation, *generation);
                }
                // The first min(cap, distinct-leading) blocks of what was just sent are held.
                let mut distinct = Vec::new();
                for h in &hashes {
                    if distinct.contains(h) { break; }
                    distinct.push(*h);
                }
                let expect = distinct.len().min(cap);
                prop_assert!(index.overlap(&name, &hashes, now) >= expect);
            }
        }
    }
}
