//! Paged key/value storage and a minimal block allocator.
//!
//! [`KvCache`] is only storage: `num_blocks` fixed-size blocks per layer, addressed by
//! block id through each sequence's block table (position `p` lives in block
//! `table[p / block_size]`, slot `p % block_size`). Which blocks a sequence owns is
//! decided outside it — by [`BlockAllocator`] here, and by the serving scheduler's
//! block manager later — so allocation policy never touches the tensors.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use half::f16;
use half::slice::HalfFloatSliceExt as _;

use crate::kernels::attention::KvLayout;
use crate::kernels::buffer::ZeroedBuffer;
use crate::kernels::{CacheLevel, prefetch};

/// Errors from the allocator.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    /// Not enough free blocks.
    #[error("out of KV blocks: need {need}, {free} free")]
    OutOfBlocks {
        /// Blocks requested.
        need: usize,
        /// Blocks free.
        free: usize,
    },
    /// A block returned that was not handed out (double free or foreign id).
    #[error("block {0} is not allocated")]
    NotAllocated(u32),
}

/// f16 storage for keys and values of every layer, in blocks (llama.cpp's default
/// KV cache type: half the bytes of f32 for attention to read, twice the blocks in
/// the same memory).
///
/// Each layer is its own buffer behind its own lock, so the parts of a split decode
/// step (see [`crate::backend::cpu`]), each running its own sequences through every
/// layer, share one store: a part holds a layer's lock only to write its tokens'
/// keys and values (exclusive, microseconds) or for its attention over the layer
/// (shared), never two layers at once.
#[derive(Debug)]
pub struct KvCache {
    num_blocks: usize,
    layout: KvLayout,
    /// Per layer, f16 elements, in huge pages when large: attention reads every live
    /// block of every layer once per step, from wherever the allocator put it.
    layers: Vec<RwLock<ZeroedBuffer>>,
}

/// One layer's blocks, read ([`KvCache::layer`]): the layer cannot be written while
/// this is held.
#[derive(Debug)]
pub struct KvLayer<'a>(RwLockReadGuard<'a, ZeroedBuffer>);

impl std::ops::Deref for KvLayer<'_> {
    type Target = [f16];

    fn deref(&self) -> &[f16] {
        // A buffer from `ZeroedBuffer` is 64-byte aligned and a whole number of
        // elements long, so the cast cannot fail.
        bytemuck::cast_slice(self.0.bytes())
    }
}

/// One layer's blocks, to store positions into ([`KvCache::layer_writer`]): the
/// layer cannot be read or written elsewhere while this is held.
#[derive(Debug)]
pub struct KvLayerWriter<'a> {
    layout: KvLayout,
    num_blocks: usize,
    data: RwLockWriteGuard<'a, ZeroedBuffer>,
}

impl KvLayerWriter<'_> {
    /// Stores the keys and values (`kv_heads * head_dim` each) of one position.
    ///
    /// # Panics
    /// When `block` or `slot` is out of range or the vectors have the wrong size.
    pub fn write(&mut self, block: u32, slot: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        assert!(slot < l.block_size && (block as usize) < self.num_blocks);
        assert!(k.len() == l.kv_heads * l.head_dim && v.len() == k.len());
        let data: &mut [f16] = bytemuck::cast_slice_mut(self.data.bytes_mut());
        // Stored as f16, as llama.cpp's default KV cache stores them, so our attention
        // sees the numbers llama.cpp's does. Converted a slice at a time: `half`
        // converts eight values per call that way, against one per call element by
        // element, which made these writes a few percent of prompt processing. Keys
        // go through a small buffer, as they are scattered over the slots.
        const KEY_CHUNK: usize = 64;
        let mut keys = [f16::ZERO; KEY_CHUNK];
        for h in 0..l.kv_heads {
            let head = h * l.head_dim..(h + 1) * l.head_dim;
            // Keys are stored transposed ([dim][slot]) so scoring a block is a
            // broadcast-multiply over slots; values row by row ([slot][dim]).
            let at = l.offset(block as usize, false, h) + slot;
            for (c, chunk) in k[head.clone()].chunks(KEY_CHUNK).enumerate() {
                let converted = &mut keys[..chunk.len()];
                converted.convert_from_f32_slice(chunk);
                let first = c * KEY_CHUNK;
                for (d, &kv) in converted.iter().enumerate() {
                    data[at + (first + d) * l.block_size] = kv;
                }
            }
            let at = l.offset(block as usize, true, h) + slot * l.head_dim;
            data[at..at + l.head_dim].convert_from_f32_slice(&v[head]);
        }
    }
}

impl KvCache {
    /// Zeroed storage for `num_blocks` blocks in each of `layers` layers.
    #[must_use]
    pub fn new(layers: usize, num_blocks: usize, layout: KvLayout) -> Self {
        let layers = (0..layers)
            .map(|_| RwLock::new(ZeroedBuffer::new(num_blocks * layout.block_bytes())))
            .collect();
        Self {
            num_blocks,
            layout,
            layers,
        }
    }

    /// Block geometry.
    #[must_use]
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Blocks per layer.
    #[must_use]
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Layers.
    #[must_use]
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of the whole store.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.layers.len() * self.num_blocks * self.layout.block_bytes()
    }

    /// All blocks of one layer, to read; waits while the layer is being written.
    ///
    /// # Panics
    /// When `layer` is out of range.
    #[must_use]
    pub fn layer(&self, layer: usize) -> KvLayer<'_> {
        // A step that panicked left numbers, not broken invariants: the lock's
        // poison carries nothing to act on.
        KvLayer(
            self.layers[layer]
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// One layer, to store positions into; waits while the layer is being read or
    /// written.
    ///
    /// # Panics
    /// When `layer` is out of range.
    #[must_use]
    pub fn layer_writer(&self, layer: usize) -> KvLayerWriter<'_> {
        KvLayerWriter {
            layout: self.layout,
            num_blocks: self.num_blocks,
            data: self.layers[layer]
                .write()
                .unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// Stores the keys and values (`kv_heads * head_dim` each) of one position
    /// ([`KvLayerWriter::write`]).
    ///
    /// # Panics
    /// When `layer`, `block` or `slot` is out of range or the vectors have the wrong size.
    pub fn write(&self, layer: usize, block: u32, slot: usize, k: &[f32], v: &[f32]) {
        self.layer_writer(layer).write(block, slot, k, v);
    }

    /// Asks the CPU to bring into level 2 the lines that [`KvLayerWriter::write`] will
    /// store `slots` (block, slot) of `layer` into, so the writes, issued a product
    /// later, find them there. Keys are stored transposed, so one position's keys
    /// touch every line of its block's keys: a decode step's writes were a hundred
    /// misses per sequence and layer, each line last seen a whole step ago, on one
    /// thread while the others waited (4–6 % of a decode step of 16 sequences).
    pub fn prefetch_slots(&self, layer: usize, slots: impl IntoIterator<Item = (u32, usize)>) {
        let l = self.layout;
        let data = self.layer(layer);
        let mut last = None;
        for (block, slot) in slots {
            let b = block as usize;
            if b >= self.num_blocks || slot >= l.block_size {
                continue;
            }
            for h in 0..l.kv_heads {
                if last != Some(b) {
                    let keys = l.offset(b, false, h);
                    prefetch(
                        &data[keys..keys + l.block_size * l.head_dim],
                        CacheLevel::L2,
                    );
                }
                let values = l.offset(b, true, h) + slot * l.head_dim;
                prefetch(&data[values..values + l.head_dim], CacheLevel::L2);
            }
            last = Some(b);
        }
    }
}

/// A free list of block ids (the serving issue replaces it with a reference-counted
/// block manager; this one serves the CLI, tests and benchmarks).
#[derive(Debug)]
pub struct BlockAllocator {
    free: Vec<u32>,
    used: Vec<bool>,
}

impl BlockAllocator {
    /// All `num_blocks` blocks free.
    #[must_use]
    pub fn new(num_blocks: usize) -> Self {
        let free = (0..num_blocks as u32).rev().collect();
        Self {
            free,
            used: vec![false; num_blocks],
        }
    }

    /// Free blocks.
    #[must_use]
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` blocks.
    ///
    /// # Errors
    /// [`KvError::OutOfBlocks`] (taking none) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, KvError> {
        if n > self.free.len() {
            return Err(KvError::OutOfBlocks {
                need: n,
                free: self.free.len(),
            });
        }
        let out = self.free.split_off(self.free.len() - n);
        for &b in &out {
            self.used[b as usize] = true;
        }
        Ok(out)
    }

    /// Grows `table` so it covers `positions` positions of `block_size`.
    ///
    /// # Errors
    /// [`KvError::OutOfBlocks`] when the blocks are not there (the table is unchanged).
    pub fn ensure(
        &mut self,
        table: &mut Vec<u32>,
        positions: usize,
        block_size: usize,
    ) -> Result<(), KvError> {
        let need = positions.div_ceil(block_size).saturating_sub(table.len());
        table.extend(self.allocate(need)?);
        Ok(())
    }

    /// Returns blocks.
    ///
    /// # Errors
    /// [`KvError::NotAllocated`] for an id that is not currently allocated; the ids
    /// before it are freed.
    pub fn release(&mut self, blocks: &[u32]) -> Result<(), KvError> {
        for &b in blocks {
            match self.used.get_mut(b as usize) {
                Some(u) if *u => {
                    *u = false;
                    self.free.push(b);
                }
                _ => return Err(KvError::NotAllocated(b)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn free_plus_used_is_total(ops in proptest::collection::vec((any::<bool>(), 0usize..5), 1..60)) {
            let total = 16;
            let mut a = BlockAllocator::new(total);
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (alloc, n) in ops {
                if alloc {
                    if let Ok(b) = a.allocate(n) { held.push(b) }
                } else if let Some(b) = held.pop() {
                    a.release(&b).unwrap();
                }
                let used: Vec<u32> = held.iter().flatten().copied().collect();
                let mut dedup = used.clone();
                dedup.sort_unstable();
                dedup.dedup();
                prop_assert_eq!(dedup.len(), used.len(), "a block was handed out twice");
                prop_assert_eq!(used.len() + a.free_blocks(), total);
            }
        }
    }

    #[test]
    fn double_free_and_exhaustion_are_errors() {
        let mut a = BlockAllocator::new(2);
        let b = a.allocate(2).unwrap();
        assert_eq!(
            a.allocate(1),
            Err(KvError::OutOfBlocks { need: 1, free: 0 })
        );
        a.release(&b).unwrap();
        assert_eq!(a.release(&b[..1]), Err(KvError::NotAllocated(b[0])));
        let mut table = Vec::new();
        a.ensure(&mut table, 17, 16).unwrap();
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn writes_land_where_the_layout_says() {
        let layout = KvLayout {
            block_size: 4,
            kv_heads: 2,
            head_dim: 3,
        };
        let kv = KvCache::new(2, 3, layout);
        kv.write(
            1,
            2,
            3,
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            &[7.0, 8.0, 9.0, 10.0, 11.0, 12.0],
        );
        let l: Vec<f32> = kv.layer(1).iter().map(|v| v.to_f32()).collect();
        let k1 = layout.offset(2, false, 1);
        assert_eq!([l[k1 + 3], l[k1 + 4 + 3], l[k1 + 8 + 3]], [4.0, 5.0, 6.0]);
        assert_eq!(&l[layout.offset(2, true, 0) + 9..][..3], &[7.0, 8.0, 9.0]);
        assert!(kv.layer(0).iter().all(|&v| v == f16::ZERO));
        assert_eq!(kv.bytes(), 2 * 3 * layout.block_bytes());
        assert_eq!(layout.block_bytes(), 2 * 2 * 4 * 3 * 2);
    }

    #[test]
    fn keys_wider_than_one_conversion_chunk_land_in_every_dimension() {
        // 100 dimensions: a whole chunk of keys and a partial one.
        let layout = KvLayout {
            block_size: 2,
            kv_heads: 2,
            head_dim: 100,
        };
        let kv = KvCache::new(1, 2, layout);
        let k: Vec<f32> = (0..200u16).map(f32::from).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        kv.write(0, 1, 1, &k, &v);
        let l = kv.layer(0);
        for h in 0..2 {
            let (keys, values) = (layout.offset(1, false, h), layout.offset(1, true, h));
            for d in 0..100 {
                let expected = f32::from(u16::try_from(h * 100 + d).expect("small"));
                assert_eq!(l[keys + d * 2 + 1].to_f32(), expected, "key {h}/{d}");
                assert_eq!(l[values + 100 + d].to_f32(), -expected, "value {h}/{d}");
            }
        }
    }
}
