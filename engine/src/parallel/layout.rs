//! Which part of the model each rank of a `tensor × pipeline` group holds: plain data
//! computed once from the model's shape, before anything is loaded.
//!
//! - Pipeline: the layers are split into `pipeline` contiguous stages, as even as
//!   possible; when they do not divide, the extra layers go to the *first* stages,
//!   because the last stage also runs the final norm and the output head (for
//!   SmolLM2-135M the head alone is about eight layers' worth of weights).
//! - Tensor: query heads and KV heads are split evenly (a `tensor` that does not divide
//!   both is refused, naming both numbers), so each rank's query heads read only its
//!   own KV heads; the MLP's hidden width is split into contiguous column ranges, as
//!   even as possible in whole quantisation blocks, since the row-parallel down
//!   projection cuts every weight row at those columns.
//! - Embedding: replicated on every tensor rank of the first stage (a lookup costs
//!   nothing; a vocab-parallel embedding would need one more all-reduce).
//! - Output head: whole, on tensor rank 0 of the last stage only (the other tensor
//!   ranks of that stage hold no head). Sampling needs a sequence's whole row of
//!   logits in one place, and the head rank samples beside them and sends the leader
//!   only the tokens; a vocab-parallel head would save that rank the head's memory
//!   (SmolLM2's is tied to the 28 MB embedding) at the price of gathering every
//!   logits row, 192 KiB per sequence per step.
//! - Ranks: `rank = stage × tensor + tensor_rank` (the contract's `--rank`); rank 0 is
//!   the leader. Hidden states go from a rank to the rank with the same tensor rank in
//!   the next stage: after the all-reduce every tensor rank holds the same hidden
//!   state, so the `tensor` transfers run side by side with no broadcast hop.

use std::ops::Range;

use crate::model::gguf::TensorInfo;
use crate::model::llama::LlamaConfig;

/// The dimensions of a model that decide how it can be split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// MLP hidden width.
    pub ffn_dim: usize,
    /// Vocabulary size (rows of the output head).
    pub vocab: usize,
    /// Elements per quantisation block along a weight row (32 for Q4_1 and Q8_0, 1 for
    /// float weights): a row-parallel shard must start and end on a block boundary.
    pub row_block: usize,
}

impl ModelShape {
    /// The shape of `config` with weights quantised in blocks of `row_block` elements.
    #[must_use]
    pub fn new(config: &LlamaConfig, row_block: usize) -> Self {
        Self {
            n_layers: config.n_layers,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
            ffn_dim: config.ffn_dim,
            vocab: config.vocab,
            row_block,
        }
    }

    /// The shape of `config`, with [`ModelShape::row_block`] the largest quantisation
    /// block of the matrices tensor parallelism cuts along their rows (each layer's
    /// attention output and MLP down projections) among `tensors`.
    #[must_use]
    pub fn from_tensors<'a>(
        config: &LlamaConfig,
        tensors: impl IntoIterator<Item = &'a TensorInfo>,
    ) -> Self {
        let row_block = tensors
            .into_iter()
            .filter(|t| {
                t.name.ends_with(".attn_output.weight") || t.name.ends_with(".ffn_down.weight")
            })
            .map(|t| usize::try_from(t.dtype.block_size()).unwrap_or(usize::MAX))
            .max()
            .unwrap_or(1);
        Self::new(config, row_block)
    }
}

/// Why a model cannot be split as asked. Every message names the numbers involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("tensor and pipeline must be at least 1 (got tensor {tensor}, pipeline {pipeline})")]
    ZeroDegree { tensor: usize, pipeline: usize },
    #[error("the model's shape cannot be split: {0}")]
    InvalidShape(String),
    #[error(
        "tensor {tensor} does not divide the model's {kv_heads} KV heads ({heads} query heads)"
    )]
    KvHeadsNotDivisible {
        tensor: usize,
        heads: usize,
        kv_heads: usize,
    },
    #[error(
        "tensor {tensor} gives each rank {heads_per_rank} query heads of {head_dim} dimensions, \
which is not a whole number of {row_block}-element quantisation blocks of the output projection's rows"
    )]
    AttentionNotBlockAligned {
        tensor: usize,
        heads_per_rank: usize,
        head_dim: usize,
        row_block: usize,
    },
    #[error(
        "tensor {tensor} cannot split the MLP's {ffn_dim} hidden columns into whole \
{row_block}-element quantisation blocks, at least one per rank"
    )]
    FfnNotSplittable {
        tensor: usize,
        ffn_dim: usize,
        row_block: usize,
    },
    #[error("pipeline {pipeline} is more stages than the model's {layers} layers")]
    PipelineExceedsLayers { pipeline: usize, layers: usize },
    #[error("rank {rank} is outside a group of {world} ranks")]
    RankOutOfRange { rank: usize, world: usize },
}

/// How one model is split over a group. Build with [`ParallelLayout::new`]; every
/// range it hands out is non-empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelLayout {
    shape: ModelShape,
    tensor: usize,
    pipeline: usize,
    /// Layer range of each stage, in stage order; they tile `0..n_layers`.
    stages: Vec<Range<usize>>,
    /// MLP column range of each tensor rank; they tile `0..ffn_dim`.
    ffn: Vec<Range<usize>>,
}

/// What one rank holds and computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLayout {
    /// `stage × tensor + tensor_rank`.
    pub rank: usize,
    /// Pipeline stage, `0..pipeline`.
    pub stage: usize,
    /// Position inside the stage's tensor group, `0..tensor`.
    pub tensor_rank: usize,
    /// Layers of this rank's stage.
    pub layers: Range<usize>,
    /// Whether this rank embeds tokens (the first stage).
    pub embeds: bool,
    /// Whether this rank holds and runs the final norm and the output head (tensor
    /// rank 0 of the last stage).
    pub head: bool,
    /// Query heads of this rank.
    pub q_heads: Range<usize>,
    /// KV heads of this rank (the ones its query heads read).
    pub kv_heads: Range<usize>,
    /// MLP hidden columns of this rank.
    pub ffn: Range<usize>,
    /// Ranks of this rank's all-reduce (its stage's tensor group), this one included.
    pub tensor_group: Range<usize>,
    /// Rank this one receives hidden states from (the previous stage), if any.
    pub receives_from: Option<usize>,
    /// Rank this one sends hidden states to (the next stage), if any.
    pub sends_to: Option<usize>,
}

impl RankLayout {
    /// Whether this rank is the leader (rank 0).
    #[must_use]
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// `0..len` in `parts` contiguous ranges of whole `unit`s, the first `len/unit % parts`
/// one unit longer; `None` when `len` is not whole units or there are fewer units than
/// parts.
fn split(len: usize, parts: usize, unit: usize) -> Option<Vec<Range<usize>>> {
    if parts == 0 || unit == 0 || !len.is_multiple_of(unit) {
        return None;
    }
    let units = len / unit;
    if units < parts {
        return None;
    }
    let (base, extra) = (units / parts, units % parts);
    let mut start = 0;
    Some(
        (0..parts)
            .map(|i| {
                let end = start + (base + usize::from(i < extra)) * unit;
                let range = start..end;
                start = end;
                range
            })
            .collect(),
    )
}

impl ParallelLayout {
    /// Splits `shape` over `tensor × pipeline` ranks.
    ///
    /// # Errors
    /// [`LayoutError`] naming the numbers that do not fit: a `tensor` that does not
    /// divide the query or KV heads, more stages than layers, shards that would cut a
    /// quantisation block.
    pub fn new(shape: &ModelShape, tensor: usize, pipeline: usize) -> Result<Self, LayoutError> {
        let s = *shape;
        if tensor == 0 || pipeline == 0 {
            return Err(LayoutError::ZeroDegree { tensor, pipeline });
        }
        if s.n_layers == 0 || s.head_dim == 0 || s.vocab == 0 || s.row_block == 0 {
            return Err(LayoutError::InvalidShape(format!(
                "zero-sized dimension in {s:?}"
            )));
        }
        if s.n_kv_heads == 0 || !s.n_heads.is_multiple_of(s.n_kv_heads) {
            return Err(LayoutError::InvalidShape(format!(
                "{} query heads cannot share {} KV heads",
                s.n_heads, s.n_kv_heads
            )));
        }
        let (heads, kv_heads) = (s.n_heads, s.n_kv_heads);
        // The KV heads divide the query heads (checked above), so a tensor that divides
        // the KV heads divides both; the message still names both counts.
        if !kv_heads.is_multiple_of(tensor) {
            return Err(LayoutError::KvHeadsNotDivisible {
                tensor,
                heads,
                kv_heads,
            });
        }
        let heads_per_rank = heads / tensor;
        if tensor > 1 && !(heads_per_rank * s.head_dim).is_multiple_of(s.row_block) {
            return Err(LayoutError::AttentionNotBlockAligned {
                tensor,
                heads_per_rank,
                head_dim: s.head_dim,
                row_block: s.row_block,
            });
        }
        // One rank keeps whole rows, so any width works; more must cut at blocks.
        let ffn_unit = if tensor > 1 { s.row_block } else { 1 };
        let ffn = split(s.ffn_dim, tensor, ffn_unit).ok_or(LayoutError::FfnNotSplittable {
            tensor,
            ffn_dim: s.ffn_dim,
            row_block: s.row_block,
        })?;
        let stages = split(s.n_layers, pipeline, 1).ok_or(LayoutError::PipelineExceedsLayers {
            pipeline,
            layers: s.n_layers,
        })?;
        Ok(Self {
            shape: s,
            tensor,
            pipeline,
            stages,
            ffn,
        })
    }

    /// Tensor ranks per stage.
    #[must_use]
    pub fn tensor(&self) -> usize {
        self.tensor
    }

    /// Pipeline stages.
    #[must_use]
    pub fn pipeline(&self) -> usize {
        self.pipeline
    }

    /// Ranks in the group: tensor × pipeline.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.tensor * self.pipeline
    }

    /// The shape this layout splits.
    #[must_use]
    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// Layer range of every stage, in stage order.
    #[must_use]
    pub fn stage_layers(&self) -> &[Range<usize>] {
        &self.stages
    }

    /// The rank at `stage`, `tensor_rank`.
    #[must_use]
    pub fn rank_at(&self, stage: usize, tensor_rank: usize) -> usize {
        stage * self.tensor + tensor_rank
    }

    /// The rank that computes the output head and samples: tensor rank 0 of the
    /// last stage.
    #[must_use]
    pub fn head_rank(&self) -> usize {
        self.rank_at(self.pipeline - 1, 0)
    }

    /// What `rank` holds and computes.
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] for a rank outside the group.
    pub fn rank(&self, rank: usize) -> Result<RankLayout, LayoutError> {
        let world = self.world_size();
        if rank >= world {
            return Err(LayoutError::RankOutOfRange { rank, world });
        }
        let (stage, tensor_rank) = (rank / self.tensor, rank % self.tensor);
        let last = stage + 1 == self.pipeline;
        let heads = self.shape.n_heads / self.tensor;
        let kv_heads = self.shape.n_kv_heads / self.tensor;
        let group_start = self.rank_at(stage, 0);
        Ok(RankLayout {
            rank,
            stage,
            tensor_rank,
            layers: self.stages[stage].clone(),
            embeds: stage == 0,
            head: last && tensor_rank == 0,
            q_heads: tensor_rank * heads..(tensor_rank + 1) * heads,
            kv_heads: tensor_rank * kv_heads..(tensor_rank + 1) * kv_heads,
            ffn: self.ffn[tensor_rank].clone(),
            tensor_group: group_start..group_start + self.tensor,
            receives_from: (stage > 0).then(|| self.rank_at(stage - 1, tensor_rank)),
            sends_to: (!last).then(|| self.rank_at(stage + 1, tensor_rank)),
        })
    }

    /// Every rank's layout, in rank order.
    #[must_use]
    pub fn ranks(&self) -> Vec<RankLayout> {
        (0..self.world_size())
            .filter_map(|rank| self.rank(rank).ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M, Q4_1.
    fn smollm2() -> ModelShape {
        ModelShape::new(&LlamaConfig::default(), 32)
    }

    fn layout(shape: &ModelShape, tensor: usize, pipeline: usize) -> ParallelLayout {
        ParallelLayout::new(shape, tensor, pipeline)
            .unwrap_or_else(|e| panic!("tensor {tensor} × pipeline {pipeline}: {e}"))
    }

    #[test]
    fn the_row_block_is_that_of_the_row_cut_matrices() {
        use crate::model::gguf::GgmlType;
        let tensor = |name: &str, dtype| TensorInfo {
            name: name.to_owned(),
            dtype,
            dims: vec![64, 64],
            offset: 0,
            size: 0,
        };
        let tensors = [
            // Cut by rows only through the head, never along a row: not counted.
            tensor("token_embd.weight", GgmlType::Q6K),
            tensor("blk.0.attn_q.weight", GgmlType::Q6K),
            tensor("blk.0.attn_output.weight", GgmlType::Q4_1),
            tensor("blk.0.ffn_down.weight", GgmlType::Q8_0),
        ];
        let config = LlamaConfig::default();
        assert_eq!(ModelShape::from_tensors(&config, &tensors).row_block, 32);
        let float = [tensor("blk.0.ffn_down.weight", GgmlType::F32)];
        assert_eq!(ModelShape::from_tensors(&config, &float).row_block, 1);
        assert_eq!(
            ModelShape::from_tensors(&config, &[]),
            ModelShape::new(&config, 1)
        );
    }

    #[test]
    fn smollm2_tensor_3_splits_heads_and_mlp_evenly() {
        let l = layout(&smollm2(), 3, 1);
        let ranks = l.ranks();
        assert_eq!(ranks.len(), 3);
        let got: Vec<_> = ranks
            .iter()
            .map(|r| (r.q_heads.clone(), r.kv_heads.clone(), r.ffn.clone()))
            .collect();
        assert_eq!(
            got,
            [
                (0..3, 0..1, 0..512),
                (3..6, 1..2, 512..1024),
                (6..9, 2..3, 1024..1536)
            ]
        );
        for r in &ranks {
            assert_eq!(r.layers, 0..30);
            assert!(r.embeds);
            assert_eq!(r.tensor_group, 0..3);
            assert_eq!((r.receives_from, r.sends_to), (None, None));
            // Query head h reads KV head h / 3: each rank's queries read its own KV heads.
            assert!(r.q_heads.clone().all(|h| r.kv_heads.contains(&(h / 3))));
        }
        let heads: Vec<_> = ranks.iter().map(|r| r.head).collect();
        assert_eq!(heads, [true, false, false]);
        assert_eq!(l.head_rank(), 0);
    }

    #[test]
    fn smollm2_tensor_2_is_refused_naming_both_head_counts() {
        let error = ParallelLayout::new(&smollm2(), 2, 1).expect_err("3 KV heads over 2 ranks");
        assert_eq!(
            error.to_string(),
            "tensor 2 does not divide the model's 3 KV heads (9 query heads)"
        );
    }

    #[test]
    fn multi_head_attention_shapes_are_refused_the_same_way() {
        let shape = ModelShape {
            n_heads: 4,
            n_kv_heads: 4,
            ..smollm2()
        };
        let error = ParallelLayout::new(&shape, 3, 1).expect_err("3 over 4 heads");
        assert_eq!(
            error.to_string(),
            "tensor 3 does not divide the model's 4 KV heads (4 query heads)"
        );
    }

    #[test]
    fn smollm2_pipeline_2_splits_layers_and_chains_the_stages() {
        let l = layout(&smollm2(), 1, 2);
        assert_eq!(l.stage_layers(), [0..15, 15..30]);
        let (first, last) = (l.rank(0).expect("rank 0"), l.rank(1).expect("rank 1"));
        assert!(first.embeds && !first.head && first.is_leader());
        assert_eq!(first.sends_to, Some(1));
        assert!(!last.embeds);
        assert!(last.head);
        assert_eq!(last.receives_from, Some(0));
        assert_eq!(l.head_rank(), 1);
    }

    #[test]
    fn smollm2_tensor_3_pipeline_2_numbers_ranks_stage_major() {
        let l = layout(&smollm2(), 3, 2);
        assert_eq!(l.world_size(), 6);
        let r4 = l.rank(4).expect("rank 4");
        assert_eq!((r4.stage, r4.tensor_rank), (1, 1));
        assert_eq!(r4.layers, 15..30);
        assert_eq!(r4.tensor_group, 3..6);
        assert_eq!(r4.receives_from, Some(1));
        assert_eq!(r4.q_heads, 3..6);
        assert!(!r4.head && l.rank(3).expect("rank 3").head);
        assert_eq!(l.rank(1).expect("rank 1").sends_to, Some(4));
        assert_eq!(l.head_rank(), 3);
        assert_eq!(
            l.rank(6),
            Err(LayoutError::RankOutOfRange { rank: 6, world: 6 })
        );
    }

    #[test]
    fn uneven_layers_give_the_extra_ones_to_the_first_stages() {
        let l = layout(&smollm2(), 1, 4);
        assert_eq!(l.stage_layers(), [0..8, 8..16, 16..23, 23..30]);
        let l = layout(&smollm2(), 1, 30);
        assert!(l.stage_layers().iter().all(|r| r.len() == 1));
    }

    #[test]
    fn more_stages_than_layers_are_refused() {
        let error = ParallelLayout::new(&smollm2(), 1, 31).expect_err("31 stages");
        assert_eq!(
            error.to_string(),
            "pipeline 31 is more stages than the model's 30 layers"
        );
    }

    #[test]
    fn zero_degrees_are_refused() {
        assert_eq!(
            ParallelLayout::new(&smollm2(), 0, 1),
            Err(LayoutError::ZeroDegree {
                tensor: 0,
                pipeline: 1
            })
        );
    }

    #[test]
    fn shards_never_cut_a_quantisation_block() {
        // 3 × 32-element blocks over 2 ranks: 64 + 32 columns, on block boundaries.
        let shape = ModelShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_dim: 96,
            ..smollm2()
        };
        let l = layout(&shape, 2, 1);
        let ffn: Vec<_> = l.ranks().iter().map(|r| r.ffn.clone()).collect();
        assert_eq!(ffn, [0..64, 64..96]);
        // 2 heads of 8 dims per rank is half a block of the output projection's rows.
        let narrow = ModelShape {
            head_dim: 8,
            ..shape
        };
        assert!(matches!(
            ParallelLayout::new(&narrow, 2, 1),
            Err(LayoutError::AttentionNotBlockAligned {
                heads_per_rank: 2,
                ..
            })
        ));
        // A width that is not whole blocks cannot be cut at all...
        let ragged = ModelShape {
            ffn_dim: 100,
            ..shape
        };
        assert!(matches!(
            ParallelLayout::new(&ragged, 2, 1),
            Err(LayoutError::FfnNotSplittable { ffn_dim: 100, .. })
        ));
        // ...but one rank keeps whole rows, so it needs no cut.
        assert_eq!(layout(&ragged, 1, 1).ranks()[0].ffn, 0..100);
    }

    #[test]
    fn ranges_tile_the_model_for_every_valid_split_of_smollm2() {
        let shape = smollm2();
        for tensor in [1, 3] {
            for pipeline in 1..=30 {
                let l = layout(&shape, tensor, pipeline);
                let ranks = l.ranks();
                assert_eq!(ranks.len(), tensor * pipeline);
                for (rank, r) in ranks.iter().enumerate() {
                    assert_eq!(r.rank, rank);
                    assert_eq!(l.rank_at(r.stage, r.tensor_rank), rank);
                }
                let mut next_layer = 0;
                for stage in l.stage_layers() {
                    assert_eq!(stage.start, next_layer);
                    assert!(!stage.is_empty());
                    next_layer = stage.end;
                }
                assert_eq!(next_layer, shape.n_layers);
                let stage0 = &ranks[..tensor];
                assert_eq!(
                    stage0.iter().map(|r| r.ffn.len()).sum::<usize>(),
                    shape.ffn_dim
                );
                let heads: Vec<_> = ranks.iter().filter(|r| r.head).map(|r| r.rank).collect();
                assert_eq!(heads, [l.head_rank()]);
            }
        }
    }
}
