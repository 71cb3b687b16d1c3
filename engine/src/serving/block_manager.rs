//! KV block manager: which sequence owns which paged-KV block, and the prefix cache.
//!
//! The pool is flat: `num_blocks` blocks of `block_size` positions, each with a
//! reference count. Blocks with count 0 sit on one intrusive doubly-linked free list,
//! so taking, returning and reclaiming a block are all O(1):
//! - blocks that hold nothing reusable are returned at the *head* and are handed out
//!   first;
//! - blocks registered in the prefix cache are returned at the *tail*, so the head
//!   side of the cached part is the least recently used; a cached block that is
//!   handed out for new data is evicted from the cache at that moment (LRU eviction).
//!
//! Prefix cache (the scheme of vLLM's automatic prefix caching): a FULL block whose
//! KV has been written is keyed by `h(parent hash, block tokens, extras)`, where
//! `extras` digests the KV namespace, the adapter id and the request's `cache_salt`
//! ([`CacheKey`]). Because every key includes the extras, two requests with different
//! namespaces or salts can never share a block.
//!
//! Invariants (checked by the property tests in `block_manager_props`):
//! - free + used = total; no block is in two sequences' tables unless it is a cached
//!   (full, written, immutable) block shared by reference;
//! - a block is registered in the cache only after it is full and written, and its
//!   owner never writes it again (writes go to positions past it), so a block handed
//!   out by a cache hit is never written by anyone;
//! - allocation is all-or-nothing: a failed call changes nothing.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

/// Identifier of a sequence (a request) in the manager.
pub type SeqId = u64;

/// A block's prefix-cache key (the first 16 bytes of a SHA-256).
pub type BlockHash = u128;

const NIL: u32 = u32::MAX;

/// Errors of the block manager.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// Not enough free blocks; nothing was allocated.
    #[error("out of KV blocks: need {need}, {free} free")]
    OutOfBlocks {
        /// Blocks the call needed.
        need: usize,
        /// Blocks that were free.
        free: usize,
    },
    /// The sequence already has blocks (allocate twice).
    #[error("sequence {0} already holds blocks")]
    AlreadyAllocated(SeqId),
    /// The sequence holds no blocks.
    #[error("sequence {0} is unknown to the block manager")]
    UnknownSeq(SeqId),
}

/// Settings of the block pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockManagerConfig {
    /// Blocks in the pool (the runner's `kv_geometry().num_blocks`).
    pub num_blocks: usize,
    /// Positions per block (the runner's `kv_geometry().block_size`).
    pub block_size: usize,
    /// Reuse full blocks across requests with the same prefix and [`CacheKey`].
    pub enable_prefix_cache: bool,
}

impl Default for BlockManagerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            enable_prefix_cache: true,
        }
    }
}

impl BlockManagerConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// The first bad value.
    pub fn validate(&self) -> Result<(), BlockConfigError> {
        if self.num_blocks == 0 || self.block_size == 0 {
            return Err(BlockConfigError::EmptyPool {
                num_blocks: self.num_blocks,
                block_size: self.block_size,
            });
        }
        if self.num_blocks >= NIL as usize {
            return Err(BlockConfigError::TooManyBlocks(self.num_blocks));
        }
        Ok(())
    }
}

/// A bad [`BlockManagerConfig`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockConfigError {
    /// No position to store: zero blocks, or zero positions per block.
    #[error(
        "the KV pool needs at least one block of one position, got {num_blocks} blocks of {block_size}"
    )]
    EmptyPool {
        /// Blocks in the pool.
        num_blocks: usize,
        /// Positions per block.
        block_size: usize,
    },
    /// More blocks than a block id can name.
    #[error("{0} KV blocks; at most {max}", max = NIL - 1)]
    TooManyBlocks(usize),
}

/// What separates prefix-cache entries besides the tokens: KV namespace (from the
/// release), adapter id and the request's `cache_salt`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// KV namespace of the release (the server's `--kv-namespace`).
    pub namespace: String,
    /// LoRA adapter id, if any.
    pub adapter: Option<String>,
    /// The request's `cache_salt`, if any.
    pub salt: Option<String>,
}

impl CacheKey {
    /// A digest of the key, mixed into every block hash.
    #[must_use]
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        // Length-prefixed fields, so ("ab", "c") and ("a", "bc") differ.
        for part in [
            Some(self.namespace.as_str()),
            self.adapter.as_deref(),
            self.salt.as_deref(),
        ] {
            match part {
                None => h.update([0u8]),
                Some(s) => {
                    h.update([1u8]);
                    h.update((s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
            }
        }
        h.finalize().into()
    }
}

/// `h(parent, block tokens, extras)`: the key of a full block.
#[must_use]
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32], extras: &[u8; 32]) -> BlockHash {
    let mut h = Sha256::new();
    match parent {
        None => h.update([0u8]),
        Some(p) => {
            h.update([1u8]);
            h.update(p.to_le_bytes());
        }
    }
    h.update((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.update(extras);
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    u128::from_le_bytes(b)
}

/// The hash chain of every full block of `tokens`.
#[must_use]
pub fn block_hashes(tokens: &[u32], block_size: usize, key: &CacheKey) -> Vec<BlockHash> {
    let extras = key.digest();
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|chunk| {
            let h = block_hash(parent, chunk, &extras);
            parent = Some(h);
            h
        })
        .collect()
}

/// The cached blocks a new sequence can start from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Cached blocks, in position order.
    pub blocks: Vec<u32>,
    /// Positions they cover (`blocks.len() * block_size`).
    pub tokens: usize,
}

#[derive(Clone, Debug)]
struct BlockMeta {
    refs: u32,
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
    on_free_list: bool,
}

#[derive(Clone, Debug, Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    /// Leading blocks already registered in (or taken from) the cache.
    hashed: usize,
    /// Hash of the last of those, the parent of the next.
    last_hash: Option<BlockHash>,
}

/// Prefix-cache counters, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Tokens looked up.
    pub queries: u64,
    /// Tokens found.
    pub hits: u64,
}

/// The block pool, the per-sequence block tables and the prefix cache.
#[derive(Debug)]
pub struct BlockManager {
    config: BlockManagerConfig,
    meta: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    free: usize,
    cache: HashMap<BlockHash, u32>,
    seqs: HashMap<SeqId, SeqBlocks>,
    stats: PrefixCacheStats,
}

impl BlockManager {
    /// A pool with every block free.
    ///
    /// # Errors
    /// An invalid config.
    pub fn new(config: BlockManagerConfig) -> Result<Self, BlockConfigError> {
        config.validate()?;
        let n = config.num_blocks;
        let meta = (0..n)
            .map(|i| BlockMeta {
                refs: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i as u32 - 1 },
                next: if i + 1 == n { NIL } else { i as u32 + 1 },
                on_free_list: true,
            })
            .collect();
        Ok(Self {
            config,
            meta,
            head: 0,
            tail: n as u32 - 1,
            free: n,
            cache: HashMap::new(),
            seqs: HashMap::new(),
            stats: PrefixCacheStats::default(),
        })
    }

    /// The pool's settings.
    #[must_use]
    pub fn config(&self) -> &BlockManagerConfig {
        &self.config
    }

    /// Positions per block.
    #[must_use]
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Blocks in the pool.
    #[must_use]
    pub fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }

    /// Blocks that can be handed out (including unreferenced cached ones).
    #[must_use]
    pub fn num_free(&self) -> usize {
        self.free
    }

    /// Blocks referenced by at least one sequence.
    #[must_use]
    pub fn num_used(&self) -> usize {
        self.config.num_blocks - self.free
    }

    /// Blocks in every sequence's table, summed: a block shared by n sequences counts n
    /// times. The blocks attention reads per decode step, unlike [`Self::num_used`].
    #[must_use]
    pub fn context_blocks(&self) -> usize {
        self.seqs.values().map(|s| s.blocks.len()).sum()
    }

    /// Fraction of blocks referenced by a sequence (0..=1).
    #[must_use]
    pub fn usage(&self) -> f64 {
        self.num_used() as f64 / self.config.num_blocks as f64
    }

    /// Prefix-cache query and hit counters, in tokens.
    #[must_use]
    pub fn prefix_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Blocks needed to hold `tokens` positions.
    #[must_use]
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    /// The block table of `seq` (empty for an unknown sequence).
    #[must_use]
    pub fn block_table(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| s.blocks.as_slice())
    }

    /// Sequences holding blocks.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Reference count of `block`.
    #[must_use]
    pub fn ref_count(&self, block: u32) -> u32 {
        self.meta.get(block as usize).map_or(0, |m| m.refs)
    }

    /// Whether `block` is registered in the prefix cache.
    #[must_use]
    pub fn is_cached(&self, block: u32) -> bool {
        self.meta
            .get(block as usize)
            .is_some_and(|m| m.hash.is_some())
    }

    /// Looks up the longest cached prefix of `tokens` under `key`. At least the last token is left to compute, since its logits are
    /// needed, so at most `(len - 1) / block_size` blocks can hit. Takes no
    /// references and counts nothing: pass the result to [`BlockManager::allocate`]
    /// before anything else changes the pool, then [`BlockManager::record_query`].
    #[must_use]
    pub fn lookup_prefix(&self, tokens: &[u32], key: &CacheKey) -> PrefixHit {
        if !self.config.enable_prefix_cache || tokens.is_empty() {
            return PrefixHit::default();
        }
        let bs = self.config.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        let mut blocks = Vec::new();
        for h in block_hashes(&tokens[..max_blocks * bs], bs, key) {
            match self.cache.get(&h) {
                Some(&b) => blocks.push(b),
                None => break,
            }
        }
        PrefixHit {
            tokens: blocks.len() * bs,
            blocks,
        }
    }

    /// Counts a lookup that was acted on: `queried` tokens, `hit` of them cached.
    pub fn record_query(&mut self, queried: usize, hit: usize) {
        self.stats.queries += queried as u64;
        self.stats.hits += hit as u64;
    }

    /// Gives `seq` the blocks of `hit` plus fresh blocks up to `num_tokens` positions.
    /// All-or-nothing.
    ///
    /// # Errors
    /// [`BlockError::AlreadyAllocated`], or [`BlockError::OutOfBlocks`] with the pool
    /// unchanged.
    pub fn allocate(
        &mut self,
        seq: SeqId,
        hit: &PrefixHit,
        num_tokens: usize,
    ) -> Result<(), BlockError> {
        if self.seqs.contains_key(&seq) {
            return Err(BlockError::AlreadyAllocated(seq));
        }
        let total = self.blocks_for(num_tokens.max(hit.tokens));
        let fresh = total.saturating_sub(hit.blocks.len());
        // Hit blocks that are unreferenced come off the free list too.
        let reclaimed = hit
            .blocks
            .iter()
            .filter(|&&b| self.meta[b as usize].refs == 0)
            .count();
        if fresh + reclaimed > self.free {
            return Err(BlockError::OutOfBlocks {
                need: fresh + reclaimed,
                free: self.free,
            });
        }
        let mut blocks = Vec::with_capacity(total);
        for &b in &hit.blocks {
            self.retain(b);
            blocks.push(b);
        }
        for _ in 0..fresh {
            blocks.push(self.take_free());
        }
        let last_hash = hit.blocks.last().and_then(|&b| self.meta[b as usize].hash);
        self.seqs.insert(
            seq,
            SeqBlocks {
                blocks,
                hashed: hit.blocks.len(),
                last_hash,
            },
        );
        Ok(())
    }

    /// Grows `seq`'s table to hold `num_tokens` positions. All-or-nothing.
    ///
    /// # Errors
    /// [`BlockError::UnknownSeq`], or [`BlockError::OutOfBlocks`] with nothing taken.
    pub fn grow(&mut self, seq: SeqId, num_tokens: usize) -> Result<(), BlockError> {
        let need_total = self.blocks_for(num_tokens);
        let have = self
            .seqs
            .get(&seq)
            .ok_or(BlockError::UnknownSeq(seq))?
            .blocks
            .len();
        let need = need_total.saturating_sub(have);
        if need > self.free {
            return Err(BlockError::OutOfBlocks {
                need,
                free: self.free,
            });
        }
        let fresh: Vec<u32> = (0..need).map(|_| self.take_free()).collect();
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.blocks.extend(fresh);
        }
        Ok(())
    }

    /// Registers in the prefix cache every block of `seq` that is now full and
    /// written: `tokens` are the sequence's tokens whose KV is in the store. A block
    /// whose key is already cached (another sequence computed the same prefix) stays
    /// private to `seq`.
    ///
    /// # Errors
    /// [`BlockError::UnknownSeq`].
    pub fn commit(&mut self, seq: SeqId, tokens: &[u32], key: &CacheKey) -> Result<(), BlockError> {
        if !self.config.enable_prefix_cache {
            return Ok(());
        }
        let bs = self.config.block_size;
        let s = self.seqs.get_mut(&seq).ok_or(BlockError::UnknownSeq(seq))?;
        let full = (tokens.len() / bs).min(s.blocks.len());
        if full <= s.hashed {
            return Ok(());
        }
        let extras = key.digest();
        let mut parent = s.last_hash;
        for i in s.hashed..full {
            let h = block_hash(parent, &tokens[i * bs..(i + 1) * bs], &extras);
            let b = s.blocks[i];
            if let std::collections::hash_map::Entry::Vacant(e) = self.cache.entry(h) {
                e.insert(b);
                self.meta[b as usize].hash = Some(h);
            }
            parent = Some(h);
        }
        s.hashed = full;
        s.last_hash = parent;
        Ok(())
    }

    /// Drops `seq`'s references; blocks no one references return to the free list
    /// (cached ones at the LRU tail, last block first so a prefix outlives its
    /// suffixes).
    ///
    /// # Errors
    /// [`BlockError::UnknownSeq`].
    pub fn free(&mut self, seq: SeqId) -> Result<(), BlockError> {
        let s = self.seqs.remove(&seq).ok_or(BlockError::UnknownSeq(seq))?;
        for &b in s.blocks.iter().rev() {
            self.release(b);
        }
        Ok(())
    }

    /// Forgets every cached block that no one references (e.g. after a reload).
    pub fn reset_prefix_cache(&mut self) {
        let ids: Vec<u32> = self.cache.values().copied().collect();
        for b in ids {
            if self.meta[b as usize].refs == 0 {
                self.uncache(b);
            }
        }
    }

    fn retain(&mut self, b: u32) {
        if self.meta[b as usize].refs == 0 {
            self.unlink(b);
        }
        self.meta[b as usize].refs += 1;
    }

    fn release(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        debug_assert!(m.refs > 0, "block {b} released more often than taken");
        m.refs = m.refs.saturating_sub(1);
        if m.refs == 0 {
            if m.hash.is_some() {
                self.push_tail(b);
            } else {
                self.push_head(b);
            }
        }
    }

    /// Takes the head of the free list, evicting it from the cache if it was cached.
    /// The caller has checked `self.free > 0`.
    fn take_free(&mut self) -> u32 {
        let b = self.head;
        debug_assert_ne!(b, NIL, "take_free on an empty free list");
        self.unlink(b);
        self.uncache(b);
        self.meta[b as usize].refs = 1;
        b
    }

    fn uncache(&mut self, b: u32) {
        if let Some(h) = self.meta[b as usize].hash.take() {
            self.cache.remove(&h);
        }
    }

    fn unlink(&mut self, b: u32) {
        let (prev, next) = {
            let m = &self.meta[b as usize];
            debug_assert!(m.on_free_list);
            (m.prev, m.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        let m = &mut self.meta[b as usize];
        m.prev = NIL;
        m.next = NIL;
        m.on_free_list = false;
        self.free -= 1;
    }

    fn push_head(&mut self, b: u32) {
        let old = self.head;
        {
            let m = &mut self.meta[b as usize];
            m.prev = NIL;
            m.next = old;
            m.on_free_list = true;
        }
        if old == NIL {
            self.tail = b;
        } else {
            self.meta[old as usize].prev = b;
        }
        self.head = b;
        self.free += 1;
    }

    fn push_tail(&mut self, b: u32) {
        let old = self.tail;
        {
            let m = &mut self.meta[b as usize];
            m.prev = old;
            m.next = NIL;
            m.on_free_list = true;
        }
        if old == NIL {
            self.head = b;
        } else {
            self.meta[old as usize].next = b;
        }
        self.tail = b;
        self.free += 1;
    }

    /// Checks every invariant of the pool; for tests.
    ///
    /// # Errors
    /// The first broken invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        // Walk the free list.
        let mut seen = vec![false; self.meta.len()];
        let mut n = 0;
        let mut cur = self.head;
        let mut prev = NIL;
        while cur != NIL {
            let m = &self.meta[cur as usize];
            if seen[cur as usize] {
                return Err(format!("free list loops at {cur}"));
            }
            seen[cur as usize] = true;
            if m.refs != 0 || !m.on_free_list || m.prev != prev {
                return Err(format!("bad free-list entry {cur}: {m:?}"));
            }
            n += 1;
            prev = cur;
            cur = m.next;
        }
        if prev != self.tail {
            return Err("tail does not end the free list".into());
        }
        if n != self.free {
            return Err(format!("free count {} but {n} on the list", self.free));
        }
        // References equal the number of tables holding each block.
        let mut refs = vec![0u32; self.meta.len()];
        for (id, s) in &self.seqs {
            let mut own = std::collections::HashSet::new();
            for &b in &s.blocks {
                if !own.insert(b) {
                    return Err(format!("sequence {id} holds block {b} twice"));
                }
                refs[b as usize] += 1;
            }
            // Only cached (immutable) blocks may be shared; a sequence writes only
            // past its hashed blocks, which no one else holds.
            for &b in &s.blocks[s.hashed.min(s.blocks.len())..] {
                if refs[b as usize] > 1 || self.meta[b as usize].refs > 1 {
                    return Err(format!("sequence {id} writes shared block {b}"));
                }
            }
        }
        for (b, m) in self.meta.iter().enumerate() {
            if m.refs != refs[b] {
                return Err(format!(
                    "block {b}: refs {} but held {} times",
                    m.refs, refs[b]
                ));
            }
            if (m.refs == 0) != seen[b] {
                return Err(format!(
                    "block {b}: refs {} but on free list {}",
                    m.refs, seen[b]
                ));
            }
            if let Some(h) = m.hash
                && self.cache.get(&h) != Some(&(b as u32))
            {
                return Err(format!("block {b} has a hash the cache does not map to it"));
            }
        }
        for (&h, &b) in &self.cache {
            if self.meta[b as usize].hash != Some(h) {
                return Err(format!(
                    "cache entry for block {b} does not match the block"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "block_manager_tests.rs"]
mod tests;
