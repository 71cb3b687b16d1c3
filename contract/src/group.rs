//! `serve`'s parallel-group flags: which rank of which `tensor × pipeline` group this
//! process is, where the group's leader listens, and how long a rank waits for its
//! peers.
//!
//! The defaults mean "a single process": `--tensor-parallel=1 --pipeline-parallel=1
//! --rank=0`, no leader address. [`GroupArgs::to_args`] writes only the flags that
//! differ from those defaults, so a single-process pod's command line is unchanged.
//!
//! Rank numbering (the engine's `parallel` module relies on it): `rank = stage ×
//! tensor + tensor_rank`, so the ranks of one pipeline stage are consecutive and rank
//! 0 (stage 0, tensor rank 0) is the leader, which serves HTTP and runs the scheduler.

use std::time::Duration;

use clap::Args;

use crate::units::{format_millis, parse_millis};

/// Default of `--rendezvous-timeout-ms`: the pods of a group start at different times
/// (image pulls, model staging), so joining gets minutes, not seconds.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The port a group's leader listens on for its ranks (the port of the
/// `--leader-address` the operator renders, declared on the leader's container as
/// [`GROUP_PORT_NAME`]). Only the leader's port is fixed: the other ranks listen on
/// ports of their own choosing, which the leader tells every rank at rendezvous.
pub const GROUP_PORT: u16 = 29500;

/// The name of [`GROUP_PORT`] on the leader's container, beside `http`.
pub const GROUP_PORT_NAME: &str = "group";

/// Default of `--step-timeout-ms`: long enough for one stage's share of a full prefill
/// chunk on a slow CPU, short enough that a hung peer ends the group's requests
/// within one SLO window.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// The leader's `host:port` (`--leader-address`): a DNS name, an IPv4 address or a
/// bracketed IPv6 address, and a port. Resolved by the engine when it connects, so a
/// pod's DNS name may not exist yet when the flag is parsed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    host: String,
    port: u16,
}

impl HostPort {
    /// The host part, as written (brackets of an IPv6 address included).
    #[must_use]
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl HostPort {
    /// `host` and `port`, checked as `--leader-address` checks them.
    ///
    /// # Errors
    /// The message `--leader-address` would give for `host:port`.
    pub fn new(host: impl Into<String>, port: u16) -> Result<Self, String> {
        let host = host.into();
        let bad = || format!("`{host}:{port}` is not host:port (e.g. leader.group.ns.svc:29500)");
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&host);
        if bare.is_empty() || port == 0 {
            return Err(bad());
        }
        // A colon outside brackets is an IPv6 address without them: `::1:80` is
        // ambiguous, so it is refused rather than guessed.
        if bare == host && host.contains(':') {
            return Err(format!(
                "`{host}:{port}`: write an IPv6 address in brackets, [::1]:29500"
            ));
        }
        if bare != host && bare.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!(
                "`{host}:{port}`: `{host}` is not a bracketed IPv6 address"
            ));
        }
        if bare.chars().any(|c| c.is_whitespace() || c == '/') {
            return Err(bad());
        }
        Ok(Self { host, port })
    }
}

impl std::str::FromStr for HostPort {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not host:port (e.g. leader.group.ns.svc:29500)");
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        Self::new(host, port)
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// A group whose flags contradict each other.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupArgsError {
    #[error(
        "--rank {rank} is outside the group: tensor {tensor} × pipeline {pipeline} has ranks 0..{world}"
    )]
    RankOutOfRange {
        rank: u32,
        tensor: u32,
        pipeline: u32,
        world: u64,
    },
    #[error(
        "a group of {world} ranks (tensor {tensor} × pipeline {pipeline}) needs --leader-address, \
the host:port rank 0 listens on for the others"
    )]
    LeaderAddressMissing {
        tensor: u32,
        pipeline: u32,
        world: u64,
    },
    #[error("--{flag}-ms must be positive: a zero wait fails every group at once")]
    ZeroTimeout { flag: &'static str },
}

/// The parallel-group flags of `serve`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
#[command(next_help_heading = "Parallel group (tensor × pipeline ranks serving one model)")]
pub struct GroupArgs {
    /// Tensor-parallel ranks per pipeline stage: attention heads and the MLP's hidden
    /// width are split across them, with an all-reduce after each. Must divide the
    /// model's query and KV heads (the engine refuses others at start-up, naming both
    /// numbers). 1: no tensor parallelism.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub tensor_parallel: u32,
    /// Pipeline stages: the layers are split into this many contiguous runs, one per
    /// stage; the first stage embeds, the last normalises and produces logits. At
    /// most the model's layer count. 1: no pipeline parallelism.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub pipeline_parallel: u32,
    /// This process's rank in the group, 0..tensor × pipeline, numbered
    /// `stage × tensor + tensor_rank`. Rank 0 is the leader: it serves HTTP, admits
    /// requests and schedules every step; the other ranks only compute.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub rank: u32,
    /// host:port the leader (rank 0) listens on for the other ranks, and they connect
    /// to; required when the group has more than one rank. The leader listens on
    /// this port on all its addresses.
    #[arg(long, value_name = "HOST:PORT")]
    pub leader_address: Option<HostPort>,
    /// Ms every rank waits for the whole group to join at start-up; past it, start-up
    /// fails naming the ranks that did not join, and the process exits non-zero.
    #[arg(long = "rendezvous-timeout-ms", value_name = "MS",
          default_value = "300000", value_parser = parse_millis)]
    pub rendezvous_timeout: Duration,
    /// Ms a rank waits for a peer's next message within a step; a peer that is dead
    /// or silent for longer fails the whole group (every rank exits non-zero, the
    /// leader's in-flight requests end with an explicit error) naming that peer.
    #[arg(long = "step-timeout-ms", value_name = "MS",
          default_value = "30000", value_parser = parse_millis)]
    pub step_timeout: Duration,
}

impl Default for GroupArgs {
    /// A single process.
    fn default() -> Self {
        Self {
            tensor_parallel: 1,
            pipeline_parallel: 1,
            rank: 0,
            leader_address: None,
            rendezvous_timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
            step_timeout: DEFAULT_STEP_TIMEOUT,
        }
    }
}

impl GroupArgs {
    /// Ranks in the group: tensor × pipeline.
    #[must_use]
    pub fn world_size(&self) -> u64 {
        u64::from(self.tensor_parallel) * u64::from(self.pipeline_parallel)
    }

    /// Whether this process is the whole group.
    #[must_use]
    pub fn is_single_process(&self) -> bool {
        self.world_size() == 1
    }

    /// Checks what clap cannot check flag by flag.
    ///
    /// # Errors
    /// A rank outside the group, a multi-rank group without a leader address, or a
    /// zero timeout.
    pub fn validate(&self) -> Result<(), GroupArgsError> {
        let world = self.world_size();
        let (tensor, pipeline) = (self.tensor_parallel, self.pipeline_parallel);
        if u64::from(self.rank) >= world {
            return Err(GroupArgsError::RankOutOfRange {
                rank: self.rank,
                tensor,
                pipeline,
                world,
            });
        }
        if world > 1 && self.leader_address.is_none() {
            return Err(GroupArgsError::LeaderAddressMissing {
                tensor,
                pipeline,
                world,
            });
        }
        if self.rendezvous_timeout.is_zero() {
            return Err(GroupArgsError::ZeroTimeout {
                flag: "rendezvous-timeout",
            });
        }
        if self.step_timeout.is_zero() {
            return Err(GroupArgsError::ZeroTimeout {
                flag: "step-timeout",
            });
        }
        Ok(())
    }

    /// The flags that reproduce `self` when parsed: only those that differ from the
    /// single-process defaults, so a single-process command line carries none.
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        let Self {
            tensor_parallel,
            pipeline_parallel,
            rank,
            leader_address,
            rendezvous_timeout,
            step_timeout,
        } = self;
        let defaults = Self::default();
        let mut out = Vec::new();
        if *tensor_parallel != defaults.tensor_parallel {
            out.push(format!("--tensor-parallel={tensor_parallel}"));
        }
        if *pipeline_parallel != defaults.pipeline_parallel {
            out.push(format!("--pipeline-parallel={pipeline_parallel}"));
        }
        if *rank != defaults.rank {
            out.push(format!("--rank={rank}"));
        }
        if let Some(address) = leader_address {
            out.push(format!("--leader-address={address}"));
        }
        if *rendezvous_timeout != defaults.rendezvous_timeout {
            out.push(format!(
                "--rendezvous-timeout-ms={}",
                format_millis(*rendezvous_timeout)
            ));
        }
        if *step_timeout != defaults.step_timeout {
            out.push(format!(
                "--step-timeout-ms={}",
                format_millis(*step_timeout)
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_takes_names_and_addresses_and_refuses_the_rest() {
        for good in [
            "leader.g0.ns.svc:29500",
            "127.0.0.1:1",
            "[::1]:29500",
            "localhost:65535",
        ] {
            let parsed: HostPort = good.parse().unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(parsed.to_string(), good);
        }
        let parsed: HostPort = "[::1]:80".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((parsed.host(), parsed.port()), ("[::1]", 80));
        for bad in [
            "",
            "leader",
            "leader:",
            ":80",
            "leader:0",
            "leader:70000",
            "::1:80",
            "[x]:80",
            "a b:80",
            "[]:80",
            "http://x:80",
        ] {
            assert!(bad.parse::<HostPort>().is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn host_port_new_checks_as_the_flag_does() {
        let address =
            HostPort::new("m-g0-r0.m-g0.ns.svc", GROUP_PORT).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(address.to_string(), "m-g0-r0.m-g0.ns.svc:29500");
        assert_eq!(address.to_string().parse::<HostPort>(), Ok(address));
        for (host, port) in [("", 1), ("a", 0), ("::1", 1), ("[x]", 1), ("a/b", 1)] {
            assert!(HostPort::new(host, port).is_err(), "{host}:{port}");
        }
    }

    #[test]
    fn validate_refuses_a_rank_outside_the_group_naming_its_size() {
        let args = GroupArgs {
            tensor_parallel: 3,
            pipeline_parallel: 2,
            rank: 6,
            leader_address: "l:1".parse().ok(),
            ..GroupArgs::default()
        };
        let error = args.validate().err().map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("--rank 6 is outside the group: tensor 3 × pipeline 2 has ranks 0..6")
        );
        assert_eq!(GroupArgs { rank: 5, ..args }.validate(), Ok(()));
    }

    #[test]
    fn validate_requires_a_leader_address_for_more_than_one_rank() {
        let args = GroupArgs {
            pipeline_parallel: 2,
            ..GroupArgs::default()
        };
        assert!(matches!(
            args.validate(),
            Err(GroupArgsError::LeaderAddressMissing { world: 2, .. })
        ));
        assert_eq!(GroupArgs::default().validate(), Ok(()));
        assert!(GroupArgs::default().is_single_process());
    }

    #[test]
    fn validate_refuses_zero_timeouts() {
        let args = GroupArgs {
            step_timeout: Duration::ZERO,
            ..GroupArgs::default()
        };
        assert_eq!(
            args.validate(),
            Err(GroupArgsError::ZeroTimeout {
                flag: "step-timeout"
            })
        );
    }

    #[test]
    fn single_process_renders_no_flags() {
        assert!(GroupArgs::default().to_args().is_empty());
    }
}
