//! The TCP transport against real peers: ranks as threads over loopback sockets, and
//! one rank as a separate OS process (this test binary re-executed as
//! [`child_rank`]). Failures are asserted by whom they blame, never by how long they
//! took; timeouts are only bounds that keep a broken build from hanging.

use std::io::BufRead as _;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use super::tcp::{TcpConfig, TcpTransport};
use super::transport::{FrameKind, Transport, TransportError};

/// Generous: only a hang would reach it.
const LONG: Duration = Duration::from_secs(60);

fn long(_rank: usize) -> (Duration, Duration) {
    (LONG, LONG)
}

fn config(
    rank: usize,
    world: usize,
    leader: &str,
    rendezvous: Duration,
    step: Duration,
) -> TcpConfig {
    TcpConfig {
        rank,
        world,
        leader: leader.parse().unwrap_or_else(|e| panic!("{leader}: {e}")),
        rendezvous_timeout: rendezvous,
        step_timeout: step,
    }
}

fn loopback_listener() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let address = listener.local_addr().expect("its address").to_string();
    (listener, address)
}

/// Runs `body` on each rank `0..world` of a fresh loopback group, each in its own
/// thread, and returns their results in rank order. `present` ranks start; the
/// others never do. `timeouts(rank)` is that rank's (rendezvous, step) timeouts.
fn run_group<T: Send + 'static>(
    world: usize,
    present: &[usize],
    timeouts: impl Fn(usize) -> (Duration, Duration),
    body: impl Fn(Result<TcpTransport, TransportError>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let (listener, leader) = loopback_listener();
    let mut handles = Vec::new();
    for &rank in present {
        let (rendezvous, step) = timeouts(rank);
        let config = config(rank, world, &leader, rendezvous, step);
        let body = body.clone();
        let listener = (rank == 0).then(|| listener.try_clone().expect("listener clone"));
        handles.push(thread::spawn(move || {
            let joined = match listener {
                Some(listener) => TcpTransport::lead(&listener, &config),
                None => TcpTransport::join(&config),
            };
            body(joined)
        }));
    }
    handles
        .into_iter()
        .map(|h| h.join().expect("a rank's thread panicked"))
        .collect()
}

fn joined(t: Result<TcpTransport, TransportError>) -> TcpTransport {
    t.unwrap_or_else(|e| panic!("rendezvous failed: {e}"))
}

/// Values that differ per rank and span magnitudes, so the order of a sum shows in
/// its bits.
fn values(rank: usize, len: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (rank as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..len)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * 10f32.powi((i % 9) as i32 - 4)
        })
        .collect()
}

/// A rank's exact partial sums: its values in fixed point, with every 97th near
/// the ends of i64 so some sums wrap.
fn partials(rank: usize, len: usize) -> Vec<i64> {
    values(rank, len)
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let fixed = (f64::from(v) * 2f64.powi(32)) as i64;
            if i % 97 == 0 {
                i64::MAX - fixed.abs()
            } else {
                fixed
            }
        })
        .collect()
}

/// The sum every rank must get: the partials' wrapping sum (any order).
fn serial_sum(ranks: &[usize], len: usize) -> Vec<i64> {
    let mut sum = vec![0i64; len];
    for &r in ranks.iter().rev() {
        for (s, v) in sum.iter_mut().zip(partials(r, len)) {
            *s = s.wrapping_add(v);
        }
    }
    sum
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn three_ranks_form_a_group_and_frames_round_trip_bit_exactly() {
    // Odd values included: a NaN with payload, -0, a subnormal, infinities.
    let special = [
        f32::from_bits(0x7fc0_1234),
        -0.0,
        1e-45,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    // Large enough to be split across many reads and writes.
    let big: Vec<f32> = values(7, 1 << 20);
    let results = run_group(3, &[0, 1, 2], long, move |t| {
        let mut t = joined(t);
        let me = t.rank();
        assert_eq!(t.world_size(), 3);
        // Every ordered pair, in one schedule all ranks follow, so each send meets
        // its receive and no two big writes wait on each other.
        let mut received = Vec::new();
        for (step, (from, to)) in [(0, 1), (1, 2), (2, 0), (0, 2), (2, 1), (1, 0)]
            .into_iter()
            .enumerate()
        {
            let step = step as u64 + 1;
            let batch = format!("batch {step} from {from}");
            if me == from {
                t.send_bytes(to, step, FrameKind::Batch, batch.as_bytes())
                    .expect("send batch");
                t.send_tensor(to, step, FrameKind::Hidden, &special)
                    .expect("send special");
                t.send_tensor(to, step, FrameKind::Logits, &big)
                    .expect("send big");
            } else if me == to {
                let got = t
                    .recv_bytes(from, step, FrameKind::Batch)
                    .expect("recv batch");
                assert_eq!(got, batch.as_bytes());
                let mut small = [0f32; 5];
                t.recv_tensor(from, step, FrameKind::Hidden, &mut small)
                    .expect("recv special");
                let mut large = vec![0f32; big.len()];
                t.recv_tensor(from, step, FrameKind::Logits, &mut large)
                    .expect("recv big");
                received.push((bits(&small), bits(&large)));
            }
        }
        received
    });
    for (rank, received) in results.iter().enumerate() {
        assert_eq!(received.len(), 2, "rank {rank} received from both peers");
        for (small, large) in received {
            assert_eq!(small, &bits(&special));
            assert!(
                large == &bits(&values(7, 1 << 20)),
                "rank {rank}: big frame differs"
            );
        }
    }
}

#[test]
fn all_reduce_of_three_ranks_equals_the_serial_sum_on_every_rank() {
    let results = run_group(3, &[0, 1, 2], long, |t| {
        let mut t = joined(t);
        let me = t.rank();
        let mut sums = Vec::new();
        // Several steps and sizes over the same links, then a subset without rank 0.
        for (step, len) in [(1u64, 576usize), (2, 1), (3, 100_003)] {
            let mut buf = partials(me, len);
            t.all_reduce_sum(&[0, 1, 2], step, &mut buf)
                .expect("all-reduce");
            sums.push(buf);
        }
        if me != 0 {
            let mut buf = partials(me, 64);
            t.all_reduce_sum(&[1, 2], 4, &mut buf)
                .expect("subset all-reduce");
            sums.push(buf);
        }
        sums
    });
    for (rank, sums) in results.iter().enumerate() {
        assert_eq!(sums[0], serial_sum(&[0, 1, 2], 576), "rank {rank}");
        assert_eq!(sums[1], serial_sum(&[0, 1, 2], 1), "rank {rank}");
        assert_eq!(sums[2], serial_sum(&[0, 1, 2], 100_003), "rank {rank}");
        if rank != 0 {
            assert_eq!(sums[3], serial_sum(&[1, 2], 64), "rank {rank}");
        }
    }
}

#[test]
fn misuse_fails_the_transport_for_good() {
    let results = run_group(2, &[0, 1], long, |t| {
        let mut t = joined(t);
        let me = t.rank();
        let mut buf = [1i64];
        let unordered = t.all_reduce_sum(&[1, 0], 1, &mut buf).err();
        let to_self = t.send_bytes(me, 1, FrameKind::Batch, b"x").err();
        (unordered, to_self)
    });
    for (unordered, to_self) in results {
        assert!(
            matches!(unordered, Some(TransportError::Usage(_))),
            "{unordered:?}"
        );
        // The transport failed on the first misuse and keeps that error.
        assert_eq!(to_self, unordered);
    }
}

#[test]
fn a_rank_that_never_starts_fails_rendezvous_naming_it() {
    // Rank 2 never starts. The leader's wait is short to keep the test quick; rank 1
    // connects at once (the listener exists before any rank starts) and waits longer
    // than the leader, so it hears why the group failed.
    let timeouts = |rank| match rank {
        0 => (Duration::from_secs(3), LONG),
        _ => (LONG, LONG),
    };
    let results = run_group(3, &[0, 1], timeouts, |t| t.err());
    let leader = results[0].as_ref().expect("the leader fails");
    assert!(
        matches!(leader, TransportError::RanksMissing { missing, .. } if missing == &[2]),
        "{leader}"
    );
    assert!(
        leader.to_string().contains("rank(s) 2 did not join"),
        "{leader}"
    );
    // Rank 1 joined, then learnt from the leader which rank was missing.
    let worker = results[1].as_ref().expect("rank 1 fails too");
    assert_eq!(worker.blamed(), [2], "{worker}");
    assert!(
        worker.to_string().contains("rank(s) 2 did not join"),
        "{worker}"
    );
}

#[test]
fn a_worker_without_a_leader_fails_naming_the_leader() {
    // A port that was free a moment ago: nothing listens there.
    let (listener, address) = loopback_listener();
    drop(listener);
    let error = TcpTransport::join(&config(1, 2, &address, Duration::from_millis(300), LONG))
        .expect_err("no leader");
    assert!(
        matches!(error, TransportError::LeaderUnreachable { .. }),
        "{error}"
    );
    assert_eq!(error.blamed(), [0]);
}

#[test]
fn a_peer_that_closes_mid_step_fails_the_others_naming_it() {
    let results = run_group(3, &[0, 1, 2], long, |t| {
        let mut t = joined(t);
        let mut buf = partials(t.rank(), 32);
        t.all_reduce_sum(&[0, 1, 2], 1, &mut buf).expect("step 1");
        if t.rank() == 2 {
            // Rank 2 dies between steps: its sockets close.
            drop(t);
            return None;
        }
        let error = t
            .all_reduce_sum(&[0, 1, 2], 2, &mut buf)
            .expect_err("step 2");
        // Every later call reports the same failure.
        let peer = 1 - t.rank();
        let again = t.send_bytes(peer, 3, FrameKind::Batch, b"x").err();
        assert_eq!(again.as_ref(), Some(&error));
        Some(error)
    });
    let root = results[0].as_ref().expect("rank 0's error");
    assert!(
        matches!(root, TransportError::PeerClosed { rank: 2, .. }),
        "rank 0: {root}"
    );
    let other = results[1].as_ref().expect("rank 1's error");
    assert_eq!(other.blamed(), [2], "rank 1: {other}");
}

#[test]
fn a_silent_peer_fails_the_others_within_the_step_timeout_naming_it() {
    // Rank 0 waits at most a second on its peers; rank 1 far longer, so it hears rank
    // 0's abort rather than timing out itself.
    let timeouts = |rank| match rank {
        0 => (LONG, Duration::from_secs(1)),
        _ => (LONG, LONG),
    };
    // Rank 2 keeps its sockets open until the others have their errors.
    let all_done = std::sync::Arc::new(std::sync::Barrier::new(3));
    let results = run_group(3, &[0, 1, 2], timeouts, move |t| {
        let mut t = joined(t);
        let error = match t.rank() {
            // Rank 2 is alive but never takes part: a stuck process.
            0 => Some(
                t.all_reduce_sum(&[0, 2], 1, &mut [1i64; 8])
                    .expect_err("rank 2 is silent"),
            ),
            // Waits for the leader's step, which never comes: the leader's abort says why.
            1 => Some(
                t.recv_bytes(0, 1, FrameKind::Batch)
                    .map(|_| ())
                    .expect_err("aborted"),
            ),
            _ => None,
        };
        all_done.wait();
        error
    });
    let root = results[0].as_ref().expect("rank 0's error");
    assert!(
        matches!(root, TransportError::PeerSilent { rank: 2, .. }),
        "rank 0: {root}"
    );
    let other = results[1].as_ref().expect("rank 1's error");
    assert!(
        matches!(
            other,
            TransportError::PeerAborted {
                rank: 0,
                culprit: Some(2),
                ..
            }
        ),
        "rank 1: {other}"
    );
}

#[test]
fn a_frame_other_than_expected_is_a_protocol_error_naming_the_sender() {
    // The sender keeps its connections open until the receiver has judged the frame:
    // closing a socket with unread data resets it, and the receiver would then see a
    // reset instead of the frame (this failed once under load).
    let judged = Arc::new(Barrier::new(2));
    let results = run_group(2, &[0, 1], long, move |t| {
        let mut t = joined(t);
        if t.rank() == 0 {
            t.send_bytes(1, 7, FrameKind::Batch, b"step 7")
                .expect("send");
            t.send_tensor(1, 8, FrameKind::Hidden, &[1.0, 2.0])
                .expect("send");
            judged.wait();
            return None;
        }
        let wrong_step = t.recv_bytes(0, 6, FrameKind::Batch).map(|_| ()).err();
        judged.wait();
        Some(wrong_step)
    });
    let error = results[1].clone().flatten().expect("rank 1 refused step 7");
    assert!(
        matches!(&error, TransportError::Protocol { rank: 0, detail, .. }
            if detail.contains("batch of step 7 where batch of step 6")),
        "{error}"
    );

    let judged = Arc::new(Barrier::new(2));
    let results = run_group(2, &[0, 1], long, move |t| {
        let mut t = joined(t);
        if t.rank() == 0 {
            t.send_tensor(1, 1, FrameKind::Hidden, &[1.0, 2.0])
                .expect("send");
            judged.wait();
            return None;
        }
        let mut three = [0f32; 3];
        let wrong_size = t.recv_tensor(0, 1, FrameKind::Hidden, &mut three).err();
        judged.wait();
        wrong_size
    });
    let error = results[1].clone().expect("rank 1 refused the size");
    assert!(
        matches!(&error, TransportError::Protocol { rank: 0, detail, .. }
            if detail.contains("8 bytes of hidden states where 12")),
        "{error}"
    );
}

#[test]
fn a_stray_connection_does_not_stop_the_group_forming() {
    let (listener, leader) = loopback_listener();
    // A port scanner, a probe, and something speaking another protocol, all before
    // any rank.
    let silent_then_closed = std::net::TcpStream::connect(&leader).expect("connect");
    let mut http = std::net::TcpStream::connect(&leader).expect("connect");
    std::io::Write::write_all(&mut http, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
    drop(http);
    drop(silent_then_closed);
    let worker = {
        let config = config(1, 2, &leader, LONG, LONG);
        thread::spawn(move || TcpTransport::join(&config).map(|t| t.rank()))
    };
    let t = joined(TcpTransport::lead(
        &listener,
        &config(0, 2, &leader, LONG, LONG),
    ));
    assert_eq!(t.world_size(), 2);
    assert_eq!(worker.join().expect("rank 1's thread"), Ok(1));
}

#[test]
fn join_listens_on_the_leader_address_port() {
    // A port free a moment ago: the leader binds it itself, on every address.
    let (probe, leader) = loopback_listener();
    drop(probe);
    let worker = {
        let config = config(1, 2, &leader, LONG, LONG);
        thread::spawn(move || {
            let mut t = joined(TcpTransport::join(&config));
            let mut buf = [2i64];
            t.all_reduce_sum(&[0, 1], 1, &mut buf).map(|()| buf[0])
        })
    };
    let mut t = joined(TcpTransport::join(&config(0, 2, &leader, LONG, LONG)));
    let mut buf = [1i64];
    t.all_reduce_sum(&[0, 1], 1, &mut buf).expect("all-reduce");
    assert_eq!(buf[0], 3);
    assert_eq!(worker.join().expect("rank 1's thread"), Ok(3));
}

#[test]
fn the_serve_flags_configure_the_transport() {
    use slipway_contract::GroupArgs;
    assert_eq!(TcpConfig::from_args(&GroupArgs::default()), Ok(None));
    let args = GroupArgs {
        tensor_parallel: 3,
        pipeline_parallel: 2,
        rank: 4,
        leader_address: "leader.g0.ns.svc:29500".parse().ok(),
        rendezvous_timeout: Duration::from_secs(9),
        step_timeout: Duration::from_secs(2),
    };
    assert_eq!(
        TcpConfig::from_args(&args),
        Ok(Some(config(
            4,
            6,
            "leader.g0.ns.svc:29500",
            Duration::from_secs(9),
            Duration::from_secs(2)
        )))
    );
    let missing_leader = GroupArgs {
        leader_address: None,
        ..args
    };
    assert!(matches!(
        TcpConfig::from_args(&missing_leader),
        Err(TransportError::Local(message)) if message.contains("--leader-address")
    ));
}

/// Environment variable that makes [`child_rank`] act: `LEADER WORLD RANK`.
const CHILD_ENV: &str = "SLIPWAY_TEST_PARALLEL_CHILD";

/// This test binary, re-executed to run only [`child_rank`] as rank `rank`.
fn spawn_child_rank(leader: &str, world: usize, rank: usize) -> Child {
    let module = module_path!()
        .split_once("::")
        .map_or(module_path!(), |(_, path)| path);
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--ignored",
            "--exact",
            &format!("{module}::child_rank"),
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{leader} {world} {rank}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("re-executing the test binary")
}

/// Kills the child on drop, so a failing assertion leaves no process behind.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[ignore = "a rank in a child process: run by a_rank_in_another_process_..., not on its own"]
fn child_rank() {
    let spec = std::env::var(CHILD_ENV).expect("run only by the parent test, which sets it");
    let mut words = spec.split(' ');
    let mut next = || words.next().expect("LEADER WORLD RANK");
    let (leader, world, rank) = (
        next().to_owned(),
        next().parse().expect("world"),
        next().parse().expect("rank"),
    );
    let mut t = joined(TcpTransport::join(&config(
        rank, world, &leader, LONG, LONG,
    )));
    let mut buf = partials(rank, 4096);
    t.all_reduce_sum(&(0..world).collect::<Vec<_>>(), 1, &mut buf)
        .expect("step 1");
    // Park until killed (or the parent goes away and stdin closes).
    let _ = std::io::stdin().lock().read_line(&mut String::new());
}

#[test]
fn a_rank_in_another_process_joins_reduces_and_its_death_fails_the_group() {
    let (listener, leader) = loopback_listener();
    let mut child = Killed(spawn_child_rank(&leader, 3, 2));
    let worker = {
        let config = config(1, 3, &leader, LONG, LONG);
        thread::spawn(move || {
            let mut t = joined(TcpTransport::join(&config));
            let mut buf = partials(1, 4096);
            t.all_reduce_sum(&[0, 1, 2], 1, &mut buf).expect("step 1");
            let step1 = buf.clone();
            let error = t
                .all_reduce_sum(&[0, 1, 2], 2, &mut buf)
                .expect_err("step 2");
            (step1, error)
        })
    };
    let mut t = joined(TcpTransport::lead(
        &listener,
        &config(0, 3, &leader, LONG, LONG),
    ));
    let mut buf = partials(0, 4096);
    t.all_reduce_sum(&[0, 1, 2], 1, &mut buf)
        .expect("step 1 with the child");
    assert_eq!(buf, serial_sum(&[0, 1, 2], 4096));
    // Step 2 starts; rank 2's process is killed while the others wait on it.
    let step2 = thread::spawn(move || {
        let mut buf = partials(0, 4096);
        t.all_reduce_sum(&[0, 1, 2], 2, &mut buf)
            .expect_err("rank 2 is dead")
    });
    child.0.kill().expect("killing rank 2");
    let root = step2.join().expect("rank 0's thread");
    assert!(
        matches!(root, TransportError::PeerClosed { rank: 2, .. }),
        "rank 0: {root}"
    );
    let (worker_step1, worker) = worker.join().expect("rank 1's thread");
    assert_eq!(worker_step1, serial_sum(&[0, 1, 2], 4096));
    assert_eq!(worker.blamed(), [2], "rank 1: {worker}");
}
