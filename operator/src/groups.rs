//! How one group (`tensor × pipeline` ranks, one replica) is split into pods.
//!
//! On CPU (`release.engine.device: CPU`) every rank is a pod of its own: the engine
//! runs one rank per process, and several processes in one pod would buy nothing a
//! CPU scheduler does not already give (`gpusPerNode` is a GPU notion and is ignored).
//! Pod `r` is engine rank `r`, numbered `stage × tensor + tensor_rank` as the engine
//! numbers them.
//!
//! On CUDA the rule (issue 4): a group that fits on one node is one pod requesting all its
//! GPUs. A larger group is split into the fewest pods of at most `gpusPerNode` GPUs,
//! keeping every tensor-parallel set inside one pod whenever `tensor ≤ gpusPerNode`
//! (tensor parallelism needs NVLink bandwidth; pipeline stages only pass activations,
//! so stage boundaries are where a group may cross nodes). When `tensor >
//! gpusPerNode` the tensor set itself must cross nodes, in pods of whole nodes. A
//! group larger than one node must fill whole nodes (`tensor × pipeline` a multiple of
//! `gpusPerNode`): the CRD's rule, checked here by its Rust twin
//! [`Parallelism::fills_whole_nodes`] (the crds tests hold the two to the same
//! verdicts), so the operator refuses exactly what the API server does.
//!
//! A CUDA pod holds one engine rank per GPU, in rank order, so a pod of several GPUs
//! would need one process driving several ranks; that comes with the NCCL transport
//! (see [`crate::pod`], which tells such pods nothing of their group).
//!
//! Invariants: the pods' engine ranks are `0..tensor × pipeline`, consecutive in pod
//! order; on CUDA the pods' GPUs sum to `tensor × pipeline` and no pod exceeds
//! `gpusPerNode`; pod rank 0 is the leader (it holds engine rank 0); pod ranks are
//! `0..pods`.

use slipway_api::spec::{Device, Parallelism};

/// One pod of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodShape {
    /// Rank of the pod inside its group (its name's `r<rank>`); 0 is the leader.
    pub rank: u32,
    /// GPUs this pod requests (none on CPU).
    pub gpus: u32,
    /// The engine ranks this pod holds: `first_rank..first_rank + ranks`.
    pub first_rank: u32,
    pub ranks: u32,
    /// Pipeline stages this pod runs, `first..first + count`. When a tensor set spans
    /// pods, every pod takes part in the same stages and this is the whole pipeline.
    pub first_stage: u32,
    pub stage_count: u32,
}

/// The pods of one group, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupShape {
    pub tensor: u32,
    pub pipeline: u32,
    pub pods: Vec<PodShape>,
}

impl GroupShape {
    /// Pods in one group (the group's world size, in pods).
    pub fn world_size(&self) -> u32 {
        // At most 512 GPUs per group, so the count fits any integer type.
        u32::try_from(self.pods.len()).unwrap_or(u32::MAX)
    }

    /// GPUs in one group.
    pub fn gpus(&self) -> u32 {
        self.pods.iter().map(|pod| pod.gpus).sum()
    }

    /// Engine ranks in one group: tensor × pipeline.
    pub fn ranks(&self) -> u32 {
        self.tensor.saturating_mul(self.pipeline)
    }

    /// The engine rank `pod`'s process is, when it is exactly one rank of a group of
    /// several; `None` for a single-process group and for a pod holding several ranks.
    pub fn engine_rank(&self, pod: &PodShape) -> Option<u32> {
        (self.ranks() > 1 && pod.ranks == 1).then_some(pod.first_rank)
    }
}

/// Why a parallelism cannot be split (the CRD rejects all of these; the operator
/// still refuses them rather than guess).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error(
        "tensor, pipeline and gpusPerNode must all be at least 1 (got {tensor}, {pipeline}, {gpus_per_node})"
    )]
    NotPositive {
        tensor: i32,
        pipeline: i32,
        gpus_per_node: i32,
    },
    #[error(
        "a CUDA group of tensor {tensor} × pipeline {pipeline} = {} GPUs spans nodes of {gpus_per_node} GPUs without filling them: tensor × pipeline must be a multiple of gpusPerNode",
        i64::from(*tensor) * i64::from(*pipeline)
    )]
    PartialNode {
        tensor: i32,
        pipeline: i32,
        gpus_per_node: i32,
    },
}

/// Splits a group on `device` into pods.
///
/// # Errors
/// [`ShapeError`] for non-positive degrees or, on CUDA, a group that spans nodes
/// without filling them.
pub fn group_shape(parallelism: &Parallelism, device: Device) -> Result<GroupShape, ShapeError> {
    let positive = |value: i32| u32::try_from(value).ok().filter(|&v| v > 0);
    let (Some(tensor), Some(pipeline), Some(per_node)) = (
        positive(parallelism.tensor),
        positive(parallelism.pipeline),
        positive(parallelism.gpus_per_node),
    ) else {
        return Err(ShapeError::NotPositive {
            tensor: parallelism.tensor,
            pipeline: parallelism.pipeline,
            gpus_per_node: parallelism.gpus_per_node,
        });
    };
    if !parallelism.fills_whole_nodes(device) {
        return Err(ShapeError::PartialNode {
            tensor: parallelism.tensor,
            pipeline: parallelism.pipeline,
            gpus_per_node: parallelism.gpus_per_node,
        });
    }
    let total = tensor.saturating_mul(pipeline);
    let pods = if device == Device::Cpu {
        (0..total)
            .map(|rank| PodShape {
                rank,
                gpus: 0,
                first_rank: rank,
                ranks: 1,
                first_stage: rank / tensor,
                stage_count: 1,
            })
            .collect()
    } else if total <= per_node {
        vec![PodShape {
            rank: 0,
            gpus: total,
            first_rank: 0,
            ranks: total,
            first_stage: 0,
            stage_count: pipeline,
        }]
    } else if tensor <= per_node {
        // Whole tensor sets per pod: as many stages as fit on one node.
        let stages_per_pod = per_node / tensor;
        let pod_count = pipeline.div_ceil(stages_per_pod);
        (0..pod_count)
            .map(|rank| {
                let first_stage = rank * stages_per_pod;
                let stage_count = stages_per_pod.min(pipeline - first_stage);
                PodShape {
                    rank,
                    gpus: stage_count * tensor,
                    first_rank: first_stage * tensor,
                    ranks: stage_count * tensor,
                    first_stage,
                    stage_count,
                }
            })
            .collect()
    } else {
        // `fills_whole_nodes`: `total` is a multiple of `per_node`.
        (0..total / per_node)
            .map(|rank| PodShape {
                rank,
                gpus: per_node,
                first_rank: rank * per_node,
                ranks: per_node,
                first_stage: 0,
                stage_count: pipeline,
            })
            .collect()
    };
    Ok(GroupShape {
        tensor,
        pipeline,
        pods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tensor: i32, pipeline: i32, gpus_per_node: i32) -> Vec<(u32, u32, u32)> {
        let parallelism = Parallelism {
            tensor,
            pipeline,
            gpus_per_node,
            ..Parallelism::default()
        };
        group_shape(&parallelism, Device::Cuda)
            .unwrap_or_else(|error| panic!("{tensor}×{pipeline}/{gpus_per_node}: {error}"))
            .pods
            .iter()
            .map(|pod| (pod.gpus, pod.first_stage, pod.stage_count))
            .collect()
    }

    #[test]
    fn the_issues_examples() {
        // (gpus, first stage, stages) per pod, rank order.
        assert_eq!(shape(8, 2, 8), vec![(8, 0, 1), (8, 1, 1)]);
        assert_eq!(shape(4, 4, 8), vec![(8, 0, 2), (8, 2, 2)]);
        assert_eq!(shape(16, 1, 8), vec![(8, 0, 1), (8, 0, 1)]);
        assert_eq!(shape(4, 2, 8), vec![(8, 0, 2)]);
        assert_eq!(shape(1, 1, 8), vec![(1, 0, 1)]);
    }

    #[test]
    fn tensor_sets_never_straddle_pods_when_they_fit() {
        // 3 does not divide 8: two stages (6 GPUs) per pod, never 8 with a set cut.
        assert_eq!(
            shape(3, 8, 8),
            vec![(6, 0, 2), (6, 2, 2), (6, 4, 2), (6, 6, 2)]
        );
        // 3 × 10 on 10-GPU nodes: three stages per pod, the last pod holds the rest.
        assert_eq!(
            shape(3, 10, 10),
            vec![(9, 0, 3), (9, 3, 3), (9, 6, 3), (3, 9, 1)]
        );
    }

    #[test]
    fn invariants_hold_over_every_valid_shape() {
        for per_node in 1..=16 {
            for tensor in 1..=32 {
                for pipeline in 1..=16 {
                    let parallelism = Parallelism {
                        tensor,
                        pipeline,
                        gpus_per_node: per_node,
                        ..Parallelism::default()
                    };
                    let total = (tensor * pipeline) as u32;
                    let cpu = group_shape(&parallelism, Device::Cpu)
                        .unwrap_or_else(|e| panic!("{tensor}×{pipeline} on CPU: {e}"));
                    assert_eq!(cpu.world_size(), total);
                    assert_eq!(cpu.gpus(), 0);
                    assert_ranks_are_consecutive(&cpu);
                    let Ok(group) = group_shape(&parallelism, Device::Cuda) else {
                        assert!(total > per_node as u32 && !total.is_multiple_of(per_node as u32));
                        continue;
                    };
                    assert_eq!(group.gpus(), total, "{tensor}×{pipeline}/{per_node}");
                    assert!(group.pods.iter().all(|pod| pod.ranks == pod.gpus));
                    assert_ranks_are_consecutive(&group);
                    assert!(group.pods.iter().all(|pod| pod.gpus <= per_node as u32));
                    assert!(
                        group
                            .pods
                            .iter()
                            .enumerate()
                            .all(|(i, pod)| pod.rank == i as u32)
                    );
                    if tensor <= per_node {
                        assert!(group.pods.iter().all(|pod| pod.gpus % tensor as u32 == 0));
                    }
                }
            }
        }
    }

    /// The pods' engine ranks cover `0..tensor × pipeline` in pod order.
    fn assert_ranks_are_consecutive(group: &GroupShape) {
        let mut next = 0;
        for pod in &group.pods {
            assert_eq!(pod.first_rank, next, "{group:?}");
            assert!(pod.ranks > 0, "{group:?}");
            next += pod.ranks;
        }
        assert_eq!(next, group.ranks(), "{group:?}");
    }

    /// (pod rank, engine rank, stage) of every pod of a CPU group.
    fn cpu_pods(tensor: i32, pipeline: i32) -> Vec<(u32, Option<u32>, u32)> {
        let parallelism = Parallelism {
            tensor,
            pipeline,
            ..Parallelism::default()
        };
        let group = group_shape(&parallelism, Device::Cpu)
            .unwrap_or_else(|error| panic!("{tensor}×{pipeline}: {error}"));
        assert!(group.pods.iter().all(|pod| pod.gpus == 0 && pod.ranks == 1));
        group
            .pods
            .iter()
            .map(|pod| (pod.rank, group.engine_rank(pod), pod.first_stage))
            .collect()
    }

    #[test]
    fn a_cpu_group_is_one_pod_per_rank_numbered_stage_times_tensor_plus_tensor_rank() {
        assert_eq!(cpu_pods(1, 1), vec![(0, None, 0)]);
        assert_eq!(cpu_pods(1, 2), vec![(0, Some(0), 0), (1, Some(1), 1)]);
        assert_eq!(
            cpu_pods(3, 1),
            vec![(0, Some(0), 0), (1, Some(1), 0), (2, Some(2), 0)]
        );
        let pods = cpu_pods(3, 2);
        assert_eq!(pods.len(), 6);
        for stage in 0..2 {
            for tensor_rank in 0..3 {
                let rank = stage * 3 + tensor_rank;
                assert_eq!(pods[rank as usize], (rank, Some(rank), stage));
            }
        }
        // gpusPerNode is a GPU notion: 12 ranks on "8-GPU nodes" are 12 CPU pods.
        let parallelism = Parallelism {
            tensor: 12,
            pipeline: 1,
            gpus_per_node: 8,
            ..Parallelism::default()
        };
        let group = group_shape(&parallelism, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(group.world_size(), 12);
    }

    #[test]
    fn cuda_pods_of_several_gpus_are_no_single_engine_rank() {
        let group = |tensor, pipeline, gpus_per_node| {
            let parallelism = Parallelism {
                tensor,
                pipeline,
                gpus_per_node,
                ..Parallelism::default()
            };
            group_shape(&parallelism, Device::Cuda).unwrap_or_else(|e| panic!("{e}"))
        };
        let ranks = |g: &GroupShape| g.pods.iter().map(|p| g.engine_rank(p)).collect::<Vec<_>>();
        assert_eq!(ranks(&group(8, 2, 8)), vec![None, None]);
        assert_eq!(ranks(&group(4, 2, 8)), vec![None]);
        assert_eq!(ranks(&group(1, 1, 8)), vec![None]);
        // One GPU per node: each pod is one process, one rank.
        assert_eq!(ranks(&group(1, 2, 1)), vec![Some(0), Some(1)]);
        assert_eq!(
            ranks(&group(2, 2, 1)),
            vec![Some(0), Some(1), Some(2), Some(3)]
        );
    }

    #[test]
    fn nonsense_is_refused() {
        let parallelism = Parallelism {
            tensor: 0,
            pipeline: 1,
            gpus_per_node: 8,
            ..Parallelism::default()
        };
        assert!(group_shape(&parallelism, Device::Cuda).is_err());
        assert!(group_shape(&parallelism, Device::Cpu).is_err());
        let parallelism = Parallelism {
            tensor: 12,
            pipeline: 1,
            gpus_per_node: 8,
            ..Parallelism::default()
        };
        assert_eq!(
            group_shape(&parallelism, Device::Cuda),
            Err(ShapeError::PartialNode {
                tensor: 12,
                pipeline: 1,
                gpus_per_node: 8
            })
        );
        // Whole tensor sets, but 12 GPUs do not fill two 8-GPU nodes: the CRD refuses
        // it, and so does the operator.
        let parallelism = Parallelism {
            tensor: 4,
            pipeline: 3,
            gpus_per_node: 8,
            ..Parallelism::default()
        };
        assert!(group_shape(&parallelism, Device::Cuda).is_err());
        assert!(group_shape(&parallelism, Device::Cpu).is_ok());
    }
}
