//! [`Transport`] over TCP, for the CPU backend: a full mesh of blocking sockets formed
//! through the leader, gather-and-broadcast all-reduce.
//!
//! Rendezvous (bounded by `rendezvous_timeout` on every rank):
//! 1. The leader (rank 0) listens on the leader address. Each worker connects to it
//!    (retrying while the leader is not up yet), binds a listener of its own on the
//!    address it reached the leader from, and sends `hello` (its rank, the world size
//!    it was told, its listening port).
//! 2. When every rank has said hello, the leader sends each worker the table of
//!    listening addresses (the IP the leader saw the worker connect from, the port it
//!    announced). A rank missing at the deadline fails the leader with
//!    [`TransportError::RanksMissing`] naming it, and the leader sends an abort naming
//!    it to those that did join.
//! 3. Each worker connects to every worker of lower rank and says hello, then accepts
//!    one connection from every worker of higher rank. Connecting first cannot
//!    deadlock: a listener's backlog completes a connection before it is accepted.
//! 4. Each worker tells the leader `ready`; when all have, the leader answers `go`, so
//!    a formed group means every pair of ranks is connected.
//!
//! A full mesh because a group is small (tens of ranks at most) and every pattern a
//! group needs is then one hop: leader to every rank (the step description), stage
//! to stage (hidden states), last stage to leader (logits), tensor rank to tensor
//! rank (all-reduce).
//!
//! All-reduce: the lowest rank of the set gathers every other rank's buffer, adds
//! them to its own in ascending rank order, and sends the total back. Two hops
//! whatever the set's size, against a ring's 2 × (n − 1): at the sizes of a step
//! (a decode step of 16 sequences over a 576-wide model is 36 KiB) latency dominates,
//! not bandwidth, and tensor sets are small. Every rank receives the root's bits, so
//! the result is identical everywhere, and the order of the sum is fixed.
//!
//! Failure: any error fails the transport for good and is sent, best effort, as an
//! abort frame to every peer it does not blame, so a rank waiting on a live peer
//! learns which rank failed the group rather than timing out on the messenger.
//! Dropping the transport closes every socket, which its peers see at once.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use slipway_contract::{Backoff, GroupArgs, HostPort};

use super::transport::{FrameKind, Phase, Transport, TransportError};
use super::wire::{Link, Wire, add_i64, get_f32, get_i64, io_error, put_f32, put_i64};

/// How often a rendezvous polls its listener for the next connection.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// Retries of the connection to the leader, which may not be up yet.
const CONNECT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
/// The longest single connection attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// Where a rank stands and how long it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// The leader's address: where it listens, where the workers connect.
    pub leader: HostPort,
    /// How long forming the group may take, on every rank.
    pub rendezvous_timeout: Duration,
    /// How long a rank waits for a peer's next frame (and a peer to take a write).
    pub step_timeout: Duration,
}

impl TcpConfig {
    /// The configuration of `serve`'s group flags, or `None` for a single process.
    ///
    /// # Errors
    /// [`TransportError::Local`] with the flags' own validation message.
    pub fn from_args(args: &GroupArgs) -> Result<Option<Self>, TransportError> {
        args.validate()
            .map_err(|e| TransportError::Local(e.to_string()))?;
        if args.is_single_process() {
            return Ok(None);
        }
        // `validate` requires it for more than one rank.
        let Some(leader) = args.leader_address.clone() else {
            return Ok(None);
        };
        let world = usize::try_from(args.world_size())
            .map_err(|_| TransportError::Local(format!("{} ranks", args.world_size())))?;
        Ok(Some(Self {
            rank: args.rank as usize,
            world,
            leader,
            rendezvous_timeout: args.rendezvous_timeout,
            step_timeout: args.step_timeout,
        }))
    }
}

/// The TCP transport of one rank. Dropping it closes its connections.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    world: usize,
    step_timeout: Duration,
    /// The link to every other rank, indexed by rank; `None` at this rank's index.
    links: Vec<Option<Link>>,
    /// The first error; every call after it returns it again.
    failed: Option<TransportError>,
}

impl TcpTransport {
    /// Forms the group: the leader listens on the port of `config.leader` on all its
    /// addresses; a worker connects to it.
    ///
    /// # Errors
    /// [`TransportError`] naming the ranks that did not join in time, the leader when
    /// it cannot be reached, or the peer that broke off the rendezvous.
    pub fn join(config: &TcpConfig) -> Result<Self, TransportError> {
        check_config(config)?;
        if config.rank != 0 {
            return Self::join_worker(config);
        }
        let port = config.leader.port();
        // Dual-stack where the kernel has IPv6, else IPv4.
        let listener = TcpListener::bind((Ipv6Addr::UNSPECIFIED, port))
            .or_else(|_| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)))
            .map_err(|e| TransportError::Local(format!("listening on port {port}: {e}")))?;
        Self::lead(&listener, config)
    }

    /// Forms the group as the leader, on a listener the caller bound (tests bind port 0
    /// on loopback and hand the address to the workers).
    ///
    /// # Errors
    /// As [`TcpTransport::join`].
    pub fn lead(listener: &TcpListener, config: &TcpConfig) -> Result<Self, TransportError> {
        check_config(config)?;
        if config.rank != 0 {
            return Err(TransportError::Usage(format!(
                "rank {} cannot lead; rank 0 does",
                config.rank
            )));
        }
        let mut links: Vec<Option<Link>> = (0..config.world).map(|_| None).collect();
        match lead_rendezvous(listener, config, &mut links) {
            Ok(()) => Ok(Self::formed(config, links)),
            Err(error) => Err(abort_all(&mut links, error)),
        }
    }

    fn join_worker(config: &TcpConfig) -> Result<Self, TransportError> {
        let deadline = Instant::now() + config.rendezvous_timeout;
        let mut links: Vec<Option<Link>> = (0..config.world).map(|_| None).collect();
        match worker_rendezvous(config, deadline, &mut links) {
            Ok(()) => Ok(Self::formed(config, links)),
            Err(error) => Err(abort_all(&mut links, error)),
        }
    }

    fn formed(config: &TcpConfig, links: Vec<Option<Link>>) -> Self {
        tracing::info!(
            rank = config.rank,
            world = config.world,
            leader = %config.leader,
            "parallel group formed"
        );
        Self {
            rank: config.rank,
            world: config.world,
            step_timeout: config.step_timeout,
            links,
            failed: None,
        }
    }

    /// Runs `op` unless the transport already failed; fails it on an error.
    fn run<T>(
        &mut self,
        op: impl FnOnce(&mut Self) -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        op(self).map_err(|error| {
            tracing::error!(rank = self.rank, %error, "parallel group failed");
            let error = abort_all(&mut self.links, error);
            self.failed = Some(error.clone());
            error
        })
    }

    fn link(&mut self, peer: usize) -> Result<&mut Link, TransportError> {
        let (rank, world) = (self.rank, self.world);
        self.links
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| {
                TransportError::Usage(if peer == rank {
                    format!("rank {rank} cannot send to or receive from itself")
                } else {
                    format!("rank {peer} is outside a group of {world}")
                })
            })
    }

    fn deadline(&self) -> Instant {
        Instant::now()
            .checked_add(self.step_timeout)
            .unwrap_or_else(far_future)
    }
}

impl Transport for TcpTransport {
    type Tensor = [f32];
    type SumTensor = [i64];

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send_bytes(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        self.run(|t| {
            let timeout = t.step_timeout;
            t.link(to)?
                .send(Wire::Frame(kind), step, Phase::Step(step), timeout, payload)
        })
    }

    fn recv_bytes(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
    ) -> Result<&[u8], TransportError> {
        self.run(|t| {
            let (deadline, timeout) = (t.deadline(), t.step_timeout);
            t.link(from)?
                .recv(
                    Wire::Frame(kind),
                    step,
                    Phase::Step(step),
                    deadline,
                    timeout,
                    None,
                )
                .map(|_| ())
        })?;
        Ok(self.link(from)?.payload())
    }

    fn send_tensor(
        &mut self,
        to: usize,
        step: u64,
        kind: FrameKind,
        tensor: &[f32],
    ) -> Result<(), TransportError> {
        self.run(|t| {
            let timeout = t.step_timeout;
            t.link(to)?
                .send_with(Wire::Frame(kind), step, Phase::Step(step), timeout, |tx| {
                    put_f32(tx, tensor);
                })
        })
    }

    fn recv_tensor(
        &mut self,
        from: usize,
        step: u64,
        kind: FrameKind,
        out: &mut [f32],
    ) -> Result<(), TransportError> {
        self.run(|t| {
            let (deadline, timeout) = (t.deadline(), t.step_timeout);
            let bytes = t.link(from)?.recv(
                Wire::Frame(kind),
                step,
                Phase::Step(step),
                deadline,
                timeout,
                Some(size_of_val(out)),
            )?;
            get_f32(bytes, out);
            Ok(())
        })
    }

    fn all_reduce_sum(
        &mut self,
        ranks: &[usize],
        step: u64,
        buf: &mut [i64],
    ) -> Result<(), TransportError> {
        self.run(|t| {
            let ascending = ranks.windows(2).all(|w| w[0] < w[1]);
            if !ascending || !ranks.contains(&t.rank) || ranks.iter().any(|&r| r >= t.world) {
                return Err(TransportError::Usage(format!(
                    "all-reduce over {ranks:?} from rank {}: the set must be ascending ranks \
of the group, this one included",
                    t.rank
                )));
            }
            let (phase, timeout, bytes) = (Phase::Step(step), t.step_timeout, size_of_val(buf));
            let Some((&root, others)) = ranks.split_first() else {
                return Ok(());
            };
            if t.rank == root {
                // Integer sums: any order gives the same bits; ascending is simply fixed.
                for &peer in others {
                    let deadline = t.deadline();
                    let partial = t.link(peer)?.recv(
                        Wire::Reduce,
                        step,
                        phase,
                        deadline,
                        timeout,
                        Some(bytes),
                    )?;
                    add_i64(partial, buf);
                }
                for &peer in others {
                    t.link(peer)?
                        .send_with(Wire::Reduce, step, phase, timeout, |tx| put_i64(tx, buf))?;
                }
            } else {
                t.link(root)?
                    .send_with(Wire::Reduce, step, phase, timeout, |tx| put_i64(tx, buf))?;
                let deadline = t.deadline();
                let total = t.link(root)?.recv(
                    Wire::Reduce,
                    step,
                    phase,
                    deadline,
                    timeout,
                    Some(bytes),
                )?;
                get_i64(total, buf);
            }
            Ok(())
        })
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

fn check_config(config: &TcpConfig) -> Result<(), TransportError> {
    if config.world < 2 || config.rank >= config.world {
        return Err(TransportError::Usage(format!(
            "rank {} of a group of {}: a TCP group has at least 2 ranks, numbered from 0",
            config.rank, config.world
        )));
    }
    if config.rendezvous_timeout.is_zero() || config.step_timeout.is_zero() {
        return Err(TransportError::Usage("zero timeouts".to_owned()));
    }
    Ok(())
}

/// Tells every linked peer, but those `error` blames, that this rank fails the group;
/// returns `error`.
fn abort_all(links: &mut [Option<Link>], error: TransportError) -> TransportError {
    let blamed = error.blamed();
    let sender = match &error {
        TransportError::PeerAborted { rank, .. } => Some(*rank),
        _ => None,
    };
    let reason = match &error {
        // Forward the original reason, not "rank N aborted" nested once per hop.
        TransportError::PeerAborted { reason, .. } => reason.clone(),
        other => other.to_string(),
    };
    for link in links.iter_mut().flatten() {
        let peer = link.peer();
        if !blamed.contains(&peer) && sender != Some(peer) {
            link.send_abort(blamed.first().copied(), &reason);
        }
    }
    error
}

/// Bytes of a hello: rank u64, world size u64, listening port u16 (0 between workers).
const HELLO_LEN: usize = 18;

fn hello_payload(rank: usize, world: usize, port: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(HELLO_LEN);
    p.extend_from_slice(&(rank as u64).to_le_bytes());
    p.extend_from_slice(&(world as u64).to_le_bytes());
    p.extend_from_slice(&port.to_le_bytes());
    p
}

/// A hello's rank, world size and port.
fn parse_hello(p: &[u8]) -> Option<(usize, usize, u16)> {
    let (rank, rest) = p.split_first_chunk::<8>()?;
    let (world, rest) = rest.split_first_chunk::<8>()?;
    let port = rest.first_chunk::<2>()?;
    Some((
        usize::try_from(u64::from_le_bytes(*rank)).ok()?,
        usize::try_from(u64::from_le_bytes(*world)).ok()?,
        u16::from_le_bytes(*port),
    ))
}

/// Reads the hello on a fresh connection and checks it names a rank the caller
/// expects (`expected`) in a group of the same size.
fn read_hello(
    stream: TcpStream,
    from: SocketAddr,
    config: &TcpConfig,
    expected: std::ops::Range<usize>,
) -> Result<(Link, u16), HelloError> {
    // Not bounded by the rendezvous deadline alone: a rank whose connection was
    // accepted just before it gets the step timeout to say who it is.
    let deadline = Instant::now() + config.step_timeout;
    // The rank is unknown until the hello is read: errors before it are described
    // by the address, not by the placeholder rank.
    let stray = |error: TransportError| {
        HelloError::Stray(
            from,
            match error {
                TransportError::PeerClosed { .. } => "closed before saying hello".to_owned(),
                TransportError::PeerSilent { .. } => "said nothing".to_owned(),
                TransportError::Protocol { detail, .. } => detail,
                other => other.to_string(),
            },
        )
    };
    let mut link = Link::new(usize::MAX, stream, config.step_timeout).map_err(stray)?;
    let hello = link
        .recv(
            Wire::Hello,
            0,
            Phase::Rendezvous,
            deadline,
            config.step_timeout,
            Some(HELLO_LEN),
        )
        .map_err(stray)?;
    let Some((rank, world, port)) = parse_hello(hello) else {
        return Err(HelloError::Stray(from, "an unreadable hello".to_owned()));
    };
    if world != config.world || !expected.contains(&rank) {
        return Err(HelloError::Fatal(TransportError::Protocol {
            rank,
            phase: Phase::Rendezvous,
            detail: format!(
                "it says it is rank {rank} of {world} (from {from}); rank {} expects ranks \
{expected:?} of {}: the group's flags disagree",
                config.rank, config.world
            ),
        }));
    }
    Ok((link.with_peer(rank), port))
}

/// A connection that did not introduce itself properly.
enum HelloError {
    /// Not a rank of any group (a probe, a port scan, a rank speaking another frame
    /// version): dropped, logged with the address it came from.
    Stray(SocketAddr, String),
    /// A rank of a differently configured group: the group cannot form.
    Fatal(TransportError),
}

/// Accepts one connection per rank of `expected` by `deadline`, reading each hello.
/// Returns each rank's link and announced port.
fn accept_ranks(
    listener: &TcpListener,
    config: &TcpConfig,
    expected: std::ops::Range<usize>,
    deadline: Instant,
    links: &mut [Option<Link>],
    ports: &mut [u16],
    peer_ips: &mut [Option<IpAddr>],
) -> Result<(), TransportError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| TransportError::Local(format!("listener: {e}")))?;
    loop {
        let missing: Vec<usize> = expected.clone().filter(|&r| links[r].is_none()).collect();
        if missing.is_empty() {
            return Ok(());
        }
        match listener.accept() {
            Ok((stream, from)) => match read_hello(stream, from, config, expected.clone()) {
                Ok((link, port)) => {
                    let rank = link.peer();
                    if links[rank].is_some() {
                        return Err(TransportError::Protocol {
                            rank,
                            phase: Phase::Rendezvous,
                            detail: format!("a second rank {rank} joined (from {from})"),
                        });
                    }
                    tracing::debug!(rank, %from, "rank joined");
                    ports[rank] = port;
                    // An IPv4 peer of a dual-stack listener shows as ::ffff:a.b.c.d;
                    // the table carries the plain IPv4 address.
                    peer_ips[rank] = Some(from.ip().to_canonical());
                    links[rank] = Some(link);
                }
                Err(HelloError::Stray(from, reason)) => {
                    tracing::warn!(%from, %reason, "dropped a connection that did not say hello as a rank");
                }
                Err(HelloError::Fatal(error)) => return Err(error),
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(TransportError::RanksMissing {
                        leader: config.leader.to_string(),
                        missing,
                        timeout: config.rendezvous_timeout,
                    });
                }
                std::thread::sleep(ACCEPT_POLL);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TransportError::Local(format!("accepting ranks: {e}"))),
        }
    }
}

fn lead_rendezvous(
    listener: &TcpListener,
    config: &TcpConfig,
    links: &mut [Option<Link>],
) -> Result<(), TransportError> {
    let deadline = Instant::now() + config.rendezvous_timeout;
    let (world, rz, timeout) = (config.world, Phase::Rendezvous, config.rendezvous_timeout);
    let mut ports = vec![0u16; world];
    let mut ips = vec![None; world];
    accept_ranks(
        listener,
        config,
        1..world,
        deadline,
        links,
        &mut ports,
        &mut ips,
    )?;
    let mut table = String::new();
    for rank in 1..world {
        if let Some(ip) = ips[rank] {
            table.push_str(&format!("{rank} {}\n", SocketAddr::new(ip, ports[rank])));
        }
    }
    for link in links.iter_mut().flatten() {
        link.send(Wire::Table, 0, rz, timeout, table.as_bytes())?;
    }
    for link in links.iter_mut().flatten() {
        link.recv(Wire::Ready, 0, rz, deadline, timeout, Some(0))?;
    }
    for link in links.iter_mut().flatten() {
        link.send(Wire::Go, 0, rz, timeout, &[])?;
    }
    Ok(())
}

/// The table's address of every worker (index = rank; rank 0's is unused).
fn parse_table(text: &[u8], world: usize) -> Option<Vec<SocketAddr>> {
    let text = std::str::from_utf8(text).ok()?;
    let mut addresses = vec![SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)); world];
    let mut seen = 1;
    for line in text.lines() {
        let (rank, address) = line.split_once(' ')?;
        let rank: usize = rank.parse().ok()?;
        if rank != seen {
            return None;
        }
        addresses[rank] = address.parse().ok()?;
        seen += 1;
    }
    (seen == world).then_some(addresses)
}

fn connect_leader(config: &TcpConfig, deadline: Instant) -> Result<TcpStream, TransportError> {
    let mut failures = 0u32;
    loop {
        let attempt = config
            .leader
            .to_string()
            .to_socket_addrs()
            .map_err(|e| format!("resolving: {e}"))
            .and_then(|mut addrs| {
                let left = deadline.saturating_duration_since(Instant::now());
                let mut last = "no address".to_owned();
                addrs
                    .find_map(|a| {
                        TcpStream::connect_timeout(
                            &a,
                            left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT),
                        )
                        .map_err(|e| last = format!("{a}: {e}"))
                        .ok()
                    })
                    .ok_or(last)
            });
        match attempt {
            Ok(stream) => return Ok(stream),
            Err(reason) => {
                failures = failures.saturating_add(1);
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(TransportError::LeaderUnreachable {
                        leader: config.leader.to_string(),
                        timeout: config.rendezvous_timeout,
                        reason,
                    });
                }
                std::thread::sleep(CONNECT_BACKOFF.delay(failures).min(left));
            }
        }
    }
}

fn worker_rendezvous(
    config: &TcpConfig,
    deadline: Instant,
    links: &mut [Option<Link>],
) -> Result<(), TransportError> {
    let (rank, world) = (config.rank, config.world);
    let (rz, timeout) = (Phase::Rendezvous, config.rendezvous_timeout);
    let stream = connect_leader(config, deadline)?;
    // Listen where the leader was reached from: the address the other ranks can reach
    // this one on, whatever other interfaces the host has.
    let local = stream
        .local_addr()
        .map_err(|e| TransportError::Local(format!("the leader connection's address: {e}")))?;
    let listener = TcpListener::bind((local.ip(), 0)).map_err(|e| {
        TransportError::Local(format!("listening for ranks on {}: {e}", local.ip()))
    })?;
    let port = listener
        .local_addr()
        .map_err(|e| TransportError::Local(format!("listener address: {e}")))?
        .port();
    let mut leader = Link::new(0, stream, config.step_timeout)?;
    leader.send(
        Wire::Hello,
        0,
        rz,
        timeout,
        &hello_payload(rank, world, port),
    )?;
    let table = leader.recv(Wire::Table, 0, rz, deadline, timeout, None)?;
    let addresses = parse_table(table, world).ok_or_else(|| TransportError::Protocol {
        rank: 0,
        phase: rz,
        detail: "sent an unreadable address table".to_owned(),
    })?;
    links[0] = Some(leader);
    // Lower workers are already listening (they said hello before the table existed).
    for peer in 1..rank {
        let stream = connect_peer(addresses[peer], peer, config, deadline)?;
        let mut link = Link::new(peer, stream, config.step_timeout)?;
        link.send(Wire::Hello, 0, rz, timeout, &hello_payload(rank, world, 0))?;
        links[peer] = Some(link);
    }
    let (mut ports, mut ips) = (vec![0u16; world], vec![None; world]);
    accept_ranks(
        &listener,
        config,
        rank + 1..world,
        deadline,
        links,
        &mut ports,
        &mut ips,
    )?;
    let leader = links[0]
        .as_mut()
        .ok_or_else(|| TransportError::Local("no leader link".to_owned()))?;
    leader.send(Wire::Ready, 0, rz, timeout, &[])?;
    leader.recv(Wire::Go, 0, rz, deadline, timeout, Some(0))?;
    Ok(())
}

fn connect_peer(
    address: SocketAddr,
    peer: usize,
    config: &TcpConfig,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    let mut failures = 0u32;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &address,
            left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT),
        ) {
            Ok(stream) => return Ok(stream),
            Err(e) if left.is_zero() => {
                return Err(io_error(
                    peer,
                    Phase::Rendezvous,
                    config.rendezvous_timeout,
                    &e,
                ));
            }
            Err(_) => {
                failures = failures.saturating_add(1);
                std::thread::sleep(CONNECT_BACKOFF.delay(failures).min(left));
            }
        }
    }
}
