//! Unit and property tests of the block manager.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

fn manager(num_blocks: usize, block_size: usize) -> BlockManager {
    BlockManager::new(BlockManagerConfig {
        num_blocks,
        block_size,
        enable_prefix_cache: true,
    })
    .expect("valid config")
}

fn key(ns: &str, salt: Option<&str>) -> CacheKey {
    CacheKey {
        namespace: ns.into(),
        adapter: None,
        salt: salt.map(Into::into),
    }
}

#[test]
fn allocation_is_all_or_nothing() {
    let mut m = manager(4, 4);
    m.allocate(1, &PrefixHit::default(), 9)
        .expect("3 blocks fit");
    assert_eq!(m.num_free(), 1);
    let err = m.allocate(2, &PrefixHit::default(), 8).unwrap_err();
    assert_eq!(err, BlockError::OutOfBlocks { need: 2, free: 1 });
    assert_eq!(m.num_free(), 1);
    assert!(m.block_table(2).is_empty());
    assert_eq!(
        m.grow(1, 17).unwrap_err(),
        BlockError::OutOfBlocks { need: 2, free: 1 }
    );
    assert_eq!(m.block_table(1).len(), 3);
    m.grow(1, 16).expect("one more block fits");
    assert_eq!(m.num_free(), 0);
    m.free(1).expect("known sequence");
    assert_eq!(m.num_free(), 4);
    m.check_invariants().expect("invariants");
}

#[test]
fn prefix_hit_reuses_full_written_blocks_and_counts_tokens() {
    let mut m = manager(16, 4);
    let k = key("ns", None);
    let prompt: Vec<u32> = (0..10).collect();
    let hit = m.lookup_prefix(&prompt, &k);
    assert_eq!(hit.tokens, 0);
    m.allocate(1, &hit, prompt.len()).expect("fits");
    // Nothing is cached before the KV is written.
    assert_eq!(m.lookup_prefix(&prompt, &k).tokens, 0);
    m.commit(1, &prompt, &k).expect("known");
    let first = m.block_table(1).to_vec();
    let hit = m.lookup_prefix(&prompt, &k);
    assert_eq!(hit.tokens, 8, "two full blocks of 4 out of 10 tokens");
    assert_eq!(hit.blocks, first[..2]);
    m.allocate(2, &hit, prompt.len()).expect("fits");
    assert_eq!(m.ref_count(first[0]), 2);
    assert_ne!(
        m.block_table(2)[2],
        first[2],
        "the partial block is private"
    );
    // Memory holds the shared blocks once; attention reads them once per sequence.
    assert_eq!(m.num_used(), 4);
    assert_eq!(m.context_blocks(), 6);
    m.record_query(prompt.len(), 0);
    m.record_query(prompt.len(), hit.tokens);
    let stats = m.prefix_stats();
    assert_eq!(stats.queries, 20);
    assert_eq!(stats.hits, 8);
    m.check_invariants().expect("invariants");
}

#[test]
fn the_last_token_is_never_a_hit() {
    let mut m = manager(16, 4);
    let k = CacheKey::default();
    let prompt: Vec<u32> = (0..8).collect();
    m.allocate(1, &PrefixHit::default(), 8).expect("fits");
    m.commit(1, &prompt, &k).expect("known");
    // 8 tokens = 2 full blocks, but the logits of token 8 must be computed.
    assert_eq!(m.lookup_prefix(&prompt, &k).tokens, 4);
}

#[test]
fn namespaces_and_salts_never_share() {
    let mut m = manager(32, 4);
    let prompt: Vec<u32> = (0..17).collect();
    let a = key("release-a", None);
    m.allocate(1, &PrefixHit::default(), 17).expect("fits");
    m.commit(1, &prompt, &a).expect("known");
    assert_eq!(m.lookup_prefix(&prompt, &a).tokens, 16);
    assert_eq!(m.lookup_prefix(&prompt, &key("release-b", None)).tokens, 0);
    assert_eq!(
        m.lookup_prefix(&prompt, &key("release-a", Some("x")))
            .tokens,
        0
    );
    let adapter = CacheKey {
        adapter: Some("lora".into()),
        ..a.clone()
    };
    assert_eq!(m.lookup_prefix(&prompt, &adapter).tokens, 0);
    // Field boundaries matter: ("ab", None) is not ("a", "b").
    assert_ne!(key("ab", None).digest(), key("a", Some("b")).digest());
}

#[test]
fn unreferenced_cached_blocks_are_evicted_lru() {
    let mut m = manager(4, 2);
    let k = CacheKey::default();
    let a = [1, 2, 3];
    let b = [7, 8, 9];
    m.allocate(1, &PrefixHit::default(), 2).expect("fits");
    m.commit(1, &a[..2], &k).expect("known");
    m.free(1).expect("known");
    m.allocate(2, &PrefixHit::default(), 2).expect("fits");
    m.commit(2, &b[..2], &k).expect("known");
    m.free(2).expect("known");
    // Both cached and free; uncached free blocks are used before any cached one.
    m.allocate(3, &PrefixHit::default(), 4).expect("fits");
    assert_eq!(m.lookup_prefix(&a, &k).tokens, 2);
    assert_eq!(m.lookup_prefix(&b, &k).tokens, 2);
    // Touch `a` again so `b` becomes the least recently used.
    let hit = m.lookup_prefix(&a, &k);
    m.allocate(4, &hit, 3).expect("reuses a, takes one more");
    m.free(4).expect("known");
    m.allocate(5, &PrefixHit::default(), 2).expect("evicts one");
    assert_eq!(m.lookup_prefix(&b, &k).tokens, 0, "b was older");
    assert_eq!(m.lookup_prefix(&a, &k).tokens, 2, "a survives");
    m.check_invariants().expect("invariants");
}

#[test]
fn a_hit_on_a_free_cached_block_counts_against_the_free_pool() {
    let mut m = manager(2, 2);
    let k = CacheKey::default();
    m.allocate(1, &PrefixHit::default(), 2).expect("fits");
    m.commit(1, &[5, 6], &k).expect("known");
    m.free(1).expect("known");
    let hit = m.lookup_prefix(&[5, 6, 7, 8, 9], &k);
    assert_eq!(hit.tokens, 2);
    // Needs the cached block (free) + 2 fresh = 3 > 2.
    assert!(matches!(
        m.allocate(2, &hit, 5),
        Err(BlockError::OutOfBlocks { need: 3, free: 2 })
    ));
    m.check_invariants().expect("invariants");
}

#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence: prompt drawn from a small alphabet so prefixes repeat.
    Start { prompt: Vec<u32>, salt: u8 },
    /// Write `n` more tokens of a live sequence (by index among the live ones).
    Append { which: usize, n: usize },
    /// Finish or preempt a live sequence.
    Free { which: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (prop::collection::vec(0u32..3, 1..24), 0u8..3)
            .prop_map(|(prompt, salt)| Op::Start { prompt, salt }),
        (0usize..8, 1usize..6).prop_map(|(which, n)| Op::Append { which, n }),
        (0usize..8).prop_map(|which| Op::Free { which }),
    ]
}

struct Live {
    tokens: Vec<u32>,
    written: usize,
    key: CacheKey,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn pool_invariants_hold(ops in prop::collection::vec(op(), 1..80)) {
        let mut m = manager(12, 4);
        let mut live: Vec<(SeqId, Live)> = Vec::new();
        let mut next = 0u64;
        // Which (salt-key) wrote each block's current contents, to prove that a
        // hit never crosses keys: block -> (key, tokens of the block).
        let mut contents: HashMap<u32, (CacheKey, Vec<u32>)> = HashMap::new();
        for op in ops {
            match op {
                Op::Start { prompt, salt } => {
                    let k = key(if salt == 2 { "other-ns" } else { "ns" }, (salt == 1).then_some("s"));
                    let hit = m.lookup_prefix(&prompt, &k);
                    let free_before = m.num_free();
                    match m.allocate(next, &hit, prompt.len()) {
                        Ok(()) => {
                            let table = m.block_table(next).to_vec();
                            for (i, &b) in hit.blocks.iter().enumerate() {
                                let (wk, wt) = &contents[&b];
                                prop_assert_eq!(wk, &k, "a hit crossed cache keys");
                                prop_assert_eq!(&wt[..], &prompt[i * 4..(i + 1) * 4]);
                            }
                            prop_assert_eq!(&table[..hit.blocks.len()], &hit.blocks[..]);
                            live.push((next, Live { tokens: prompt, written: hit.tokens, key: k }));
                        }
                        Err(BlockError::OutOfBlocks { .. }) => {
                            prop_assert_eq!(m.num_free(), free_before);
                            prop_assert!(m.block_table(next).is_empty());
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                    next += 1;
                }
                Op::Append { which, n } if !live.is_empty() => {
                    let i = which % live.len();
                    let (id, s) = &mut live[i];
                    let target = (s.written + n).max(s.tokens.len());
                    if m.grow(*id, target).is_ok() {
                        while s.tokens.len() < target {
                            s.tokens.push((s.tokens.len() % 3) as u32);
                        }
                        // "Write" positions written..target: none of them may be in
                        // a block someone else holds or that is cached.
                        let table = m.block_table(*id).to_vec();
                        for p in s.written..target {
                            let b = table[p / 4];
                            prop_assert_eq!(m.ref_count(b), 1, "writing a shared block");
                            prop_assert!(!m.is_cached(b), "writing a cached block");
                            let e = contents.entry(b).or_insert_with(|| (s.key.clone(), Vec::new()));
                            if p % 4 == 0 {
                                *e = (s.key.clone(), Vec::new());
                            }
                            e.1.push(s.tokens[p]);
                        }
                        s.written = target;
                        m.commit(*id, &s.tokens[..s.written], &s.key).expect("live");
                    }
                }
                Op::Free { which } if !live.is_empty() => {
                    let (id, _) = live.remove(which % live.len());
                    m.free(id).expect("live");
                }
                _ => {}
            }
            prop_assert_eq!(m.num_free() + m.num_used(), m.num_blocks());
            if let Err(e) = m.check_invariants() {
                prop_assert!(false, "{}", e);
            }
        }
        for (id, _) in live {
            m.free(id).expect("live");
        }
        prop_assert_eq!(m.num_free(), m.num_blocks());
    }
}
