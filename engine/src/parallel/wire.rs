//! Frames on a TCP link between two ranks, and the link that reads and writes them.
//!
//! A frame is a 24-byte header and a payload:
//!
//! | bytes  | field                                            |
//! |--------|--------------------------------------------------|
//! | 0..4   | magic `SLPW`                                     |
//! | 4      | version (1)                                      |
//! | 5      | kind ([`Wire`])                                  |
//! | 6..8   | zero                                             |
//! | 8..16  | step id, u64 little-endian                       |
//! | 16..24 | payload length in bytes, u64 little-endian       |
//!
//! Tensors travel as raw little-endian f32, the all-reduce's exact sums as raw
//! little-endian i64. A link owns one buffer per direction,
//! grown to the largest frame seen and reused, so a step allocates nothing: a send
//! encodes header and payload into the send buffer and writes it with one call (one
//! segment train with `TCP_NODELAY`); a receive reads the payload into the receive
//! buffer, from which the caller decodes.
//!
//! Every read has a deadline and every write the step timeout, so a dead or silent
//! peer is an error naming it, never a hang.

use std::io::{self, Read as _, Write as _};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::transport::{FrameKind, Phase, TransportError};

/// The first bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SLPW";
/// The frame format's version; a peer with another one is refused at its first frame.
pub const VERSION: u8 = 1;
/// Bytes of a header.
pub const HEADER_LEN: usize = 24;
/// The largest payload accepted, so a corrupt length cannot make a rank allocate
/// without bound (a 16k-token prefill chunk of an 8k-wide model is 512 MiB).
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// A frame's kind on the wire: the caller's [`FrameKind`]s and the transport's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Frame(FrameKind),
    /// All-reduce traffic: a partial sum to the set's root, the total back.
    Reduce,
    /// Rendezvous: a rank saying who it is (rank, world size, listening port).
    Hello,
    /// Rendezvous: the leader's table of every rank's listening address.
    Table,
    /// Rendezvous: a worker connected to all its peers.
    Ready,
    /// Rendezvous: the leader saw every rank ready; the group is formed.
    Go,
    /// A rank failing the group: the rank it blames (or none) and why.
    Abort,
}

impl Wire {
    fn to_u8(self) -> u8 {
        match self {
            Self::Frame(FrameKind::Batch) => 1,
            Self::Frame(FrameKind::Hidden) => 2,
            Self::Frame(FrameKind::Logits) => 3,
            Self::Frame(FrameKind::Sampled) => 4,
            Self::Reduce => 16,
            Self::Hello => 32,
            Self::Table => 33,
            Self::Ready => 34,
            Self::Go => 35,
            Self::Abort => 63,
        }
    }

    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Frame(FrameKind::Batch),
            2 => Self::Frame(FrameKind::Hidden),
            3 => Self::Frame(FrameKind::Logits),
            4 => Self::Frame(FrameKind::Sampled),
            16 => Self::Reduce,
            32 => Self::Hello,
            33 => Self::Table,
            34 => Self::Ready,
            35 => Self::Go,
            63 => Self::Abort,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Frame(kind) => kind.fmt(f),
            Self::Reduce => f.write_str("all-reduce"),
            Self::Hello => f.write_str("hello"),
            Self::Table => f.write_str("address table"),
            Self::Ready => f.write_str("ready"),
            Self::Go => f.write_str("go"),
            Self::Abort => f.write_str("abort"),
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Wire,
    pub step: u64,
    pub len: u64,
}

/// Writes a header for `kind`, `step` and a payload of `len` bytes.
pub fn encode_header(kind: Wire, step: u64, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind.to_u8();
    h[8..16].copy_from_slice(&step.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h
}

/// Reads a header.
///
/// # Errors
/// A description of what is wrong with it: magic, version, kind or length.
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<Header, String> {
    if h[0..4] != MAGIC {
        return Err(format!(
            "bad magic {:02x?} (not a Slipway rank, or a stream out of sync)",
            &h[0..4]
        ));
    }
    if h[4] != VERSION {
        return Err(format!(
            "frame version {} (this rank speaks {VERSION})",
            h[4]
        ));
    }
    let kind = Wire::from_u8(h[5]).ok_or_else(|| format!("unknown frame kind {}", h[5]))?;
    let word = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let (step, len) = (word(8), word(16));
    if len > MAX_PAYLOAD {
        return Err(format!("a {len}-byte {kind} frame (at most {MAX_PAYLOAD})"));
    }
    Ok(Header { kind, step, len })
}

/// Appends `data` to `out` as little-endian f32.
pub fn put_f32(out: &mut Vec<u8>, data: &[f32]) {
    let start = out.len();
    out.resize(start + std::mem::size_of_val(data), 0);
    let (chunks, _) = out[start..].as_chunks_mut::<4>();
    for (chunk, x) in chunks.iter_mut().zip(data) {
        *chunk = x.to_le_bytes();
    }
}

/// Overwrites `out` with the little-endian f32 in `bytes` (of the same size).
pub fn get_f32(bytes: &[u8], out: &mut [f32]) {
    let (chunks, _) = bytes.as_chunks::<4>();
    for (x, chunk) in out.iter_mut().zip(chunks) {
        *x = f32::from_le_bytes(*chunk);
    }
}

/// Appends `data` to `out` as little-endian i64.
pub fn put_i64(out: &mut Vec<u8>, data: &[i64]) {
    let start = out.len();
    out.resize(start + std::mem::size_of_val(data), 0);
    let (chunks, _) = out[start..].as_chunks_mut::<8>();
    for (chunk, x) in chunks.iter_mut().zip(data) {
        *chunk = x.to_le_bytes();
    }
}

/// Overwrites `out` with the little-endian i64 in `bytes` (of the same size).
pub fn get_i64(bytes: &[u8], out: &mut [i64]) {
    let (chunks, _) = bytes.as_chunks::<8>();
    for (x, chunk) in out.iter_mut().zip(chunks) {
        *x = i64::from_le_bytes(*chunk);
    }
}

/// Adds the little-endian i64 in `bytes` (of the same size) to `out`, wrapping: a
/// peer's bytes cannot make this rank panic, and wrapping sums stay associative.
pub fn add_i64(bytes: &[u8], out: &mut [i64]) {
    let (chunks, _) = bytes.as_chunks::<8>();
    for (x, chunk) in out.iter_mut().zip(chunks) {
        *x = x.wrapping_add(i64::from_le_bytes(*chunk));
    }
}

/// A connection to one peer rank, with one reusable buffer per direction.
#[derive(Debug)]
pub struct Link {
    peer: usize,
    stream: TcpStream,
    tx: Vec<u8>,
    rx: Vec<u8>,
    /// Bytes of the last frame's payload at the start of `rx`.
    rx_len: usize,
}

impl Link {
    /// Wraps a connected stream to `peer`: blocking, `TCP_NODELAY`, writes bounded by
    /// `write_timeout`.
    ///
    /// # Errors
    /// [`TransportError::PeerIo`] when the socket refuses the options.
    pub fn new(
        peer: usize,
        stream: TcpStream,
        write_timeout: Duration,
    ) -> Result<Self, TransportError> {
        let setup = |e: io::Error| TransportError::PeerIo {
            rank: peer,
            phase: Phase::Rendezvous,
            reason: format!("setting up the socket: {e}"),
        };
        // An accepted socket may inherit the listener's non-blocking mode on some
        // platforms; reads and writes here rely on blocking with timeouts.
        stream.set_nonblocking(false).map_err(setup)?;
        stream.set_nodelay(true).map_err(setup)?;
        stream
            .set_write_timeout(Some(write_timeout))
            .map_err(setup)?;
        Ok(Self {
            peer,
            stream,
            tx: Vec::new(),
            rx: Vec::new(),
            rx_len: 0,
        })
    }

    /// The same link, to `peer` (once a hello said who is on the other end).
    pub fn with_peer(self, peer: usize) -> Self {
        Self { peer, ..self }
    }

    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// The payload of the last frame received.
    pub fn payload(&self) -> &[u8] {
        &self.rx[..self.rx_len]
    }

    /// Sends one frame whose payload `fill` appends to the send buffer.
    ///
    /// # Errors
    /// [`TransportError`] naming the peer when the write fails or times out.
    pub fn send_with(
        &mut self,
        kind: Wire,
        step: u64,
        phase: Phase,
        timeout: Duration,
        fill: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), TransportError> {
        self.tx.clear();
        self.tx.extend_from_slice(&[0u8; HEADER_LEN]);
        fill(&mut self.tx);
        let len = (self.tx.len() - HEADER_LEN) as u64;
        if len > MAX_PAYLOAD {
            return Err(TransportError::Usage(format!(
                "a {len}-byte {kind} frame to rank {} (at most {MAX_PAYLOAD})",
                self.peer
            )));
        }
        self.tx[..HEADER_LEN].copy_from_slice(&encode_header(kind, step, len));
        self.stream
            .write_all(&self.tx)
            .map_err(|e| io_error(self.peer, phase, timeout, &e))
    }

    /// Sends `payload` as one frame.
    ///
    /// # Errors
    /// As [`Link::send_with`].
    pub fn send(
        &mut self,
        kind: Wire,
        step: u64,
        phase: Phase,
        timeout: Duration,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        self.send_with(kind, step, phase, timeout, |tx| {
            tx.extend_from_slice(payload);
        })
    }

    /// Reads the next frame by `deadline`, which must be `kind` in `step` with a
    /// payload of `expected_len` bytes when given; the payload lands in the receive
    /// buffer. The header is checked before the payload is read, so a wrong frame
    /// costs no allocation. An abort frame is returned as
    /// [`TransportError::PeerAborted`].
    ///
    /// # Errors
    /// [`TransportError`] naming the peer: closed, silent until the deadline, a bad
    /// header, another frame than expected, or an abort.
    pub fn recv(
        &mut self,
        kind: Wire,
        step: u64,
        phase: Phase,
        deadline: Instant,
        timeout: Duration,
        expected_len: Option<usize>,
    ) -> Result<&[u8], TransportError> {
        let (peer, io) = (self.peer, |e: io::Error| {
            io_error(self.peer, phase, timeout, &e)
        });
        let protocol = |detail: String| TransportError::Protocol {
            rank: peer,
            phase,
            detail,
        };
        let mut h = [0u8; HEADER_LEN];
        read_by(&mut self.stream, &mut h, deadline).map_err(io)?;
        let header = decode_header(&h).map_err(protocol)?;
        // Bounded by MAX_PAYLOAD, so it fits.
        let len = usize::try_from(header.len).unwrap_or(usize::MAX);
        let abort = header.kind == Wire::Abort;
        if !abort && (header.kind != kind || header.step != step) {
            return Err(protocol(format!(
                "sent {} of step {} where {kind} of step {step} was expected",
                header.kind, header.step
            )));
        }
        if let Some(expected) = expected_len
            && !abort
            && expected != len
        {
            return Err(protocol(format!(
                "sent {len} bytes of {kind} where {expected} were expected"
            )));
        }
        if self.rx.len() < len {
            self.rx.resize(len, 0);
        }
        read_by(&mut self.stream, &mut self.rx[..len], deadline).map_err(io)?;
        self.rx_len = len;
        if abort {
            let (culprit, reason) = decode_abort(self.payload());
            return Err(TransportError::PeerAborted {
                rank: peer,
                culprit,
                reason,
            });
        }
        Ok(self.payload())
    }

    /// Best effort, never blocking: tells the peer this rank is failing the group.
    pub fn send_abort(&mut self, culprit: Option<usize>, reason: &str) {
        let mut frame = Vec::with_capacity(HEADER_LEN + 8 + reason.len());
        let culprit = culprit.map_or(u64::MAX, |r| r as u64);
        let payload_len = 8 + reason.len() as u64;
        frame.extend_from_slice(&encode_header(Wire::Abort, 0, payload_len));
        frame.extend_from_slice(&culprit.to_le_bytes());
        frame.extend_from_slice(reason.as_bytes());
        // Non-blocking: a peer that stopped reading must not delay the failure. A
        // partial write reads as a closed connection on the other side, which still
        // fails it.
        if self.stream.set_nonblocking(true).is_ok() {
            let _ignored = self.stream.write(&frame);
        }
    }
}

/// Splits an abort payload: the blamed rank (`u64::MAX`: none) and the reason.
fn decode_abort(payload: &[u8]) -> (Option<usize>, String) {
    let Some((culprit, reason)) = payload.split_first_chunk::<8>() else {
        return (None, "an abort without a reason".to_owned());
    };
    let culprit = u64::from_le_bytes(*culprit);
    let culprit = (culprit != u64::MAX).then(|| usize::try_from(culprit).unwrap_or(usize::MAX));
    (culprit, String::from_utf8_lossy(reason).into_owned())
}

/// Fills `buf` from `stream` by `deadline`, however the peer splits its writes.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        // Re-armed per read so the whole frame, not each read, is bounded.
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The error of an I/O failure on the link to `rank`.
pub fn io_error(rank: usize, phase: Phase, timeout: Duration, e: &io::Error) -> TransportError {
    use io::ErrorKind::*;
    match e.kind() {
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => {
            TransportError::PeerClosed { rank, phase }
        }
        WouldBlock | TimedOut => TransportError::PeerSilent {
            rank,
            phase,
            timeout,
        },
        _ => TransportError::PeerIo {
            rank,
            phase,
            reason: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_say_why() {
        for kind in [
            Wire::Frame(FrameKind::Batch),
            Wire::Frame(FrameKind::Hidden),
            Wire::Frame(FrameKind::Logits),
            Wire::Frame(FrameKind::Sampled),
            Wire::Reduce,
            Wire::Hello,
            Wire::Table,
            Wire::Ready,
            Wire::Go,
            Wire::Abort,
        ] {
            let h = encode_header(kind, u64::MAX - 3, 4096);
            assert_eq!(
                decode_header(&h),
                Ok(Header {
                    kind,
                    step: u64::MAX - 3,
                    len: 4096
                })
            );
        }
        let good = encode_header(Wire::Reduce, 7, 8);
        let mut bad = good;
        bad[0] = b'X';
        assert!(decode_header(&bad).is_err_and(|e| e.contains("magic")));
        let mut bad = good;
        bad[4] = 2;
        assert!(decode_header(&bad).is_err_and(|e| e.contains("version 2")));
        let mut bad = good;
        bad[5] = 200;
        assert!(decode_header(&bad).is_err_and(|e| e.contains("kind 200")));
        let huge = encode_header(Wire::Reduce, 7, MAX_PAYLOAD + 1);
        assert!(decode_header(&huge).is_err());
    }

    #[test]
    fn f32_payloads_are_little_endian_and_exact() {
        let data = [
            1.5f32,
            -0.0,
            f32::MIN_POSITIVE,
            f32::NAN,
            f32::INFINITY,
            3e-40,
        ];
        let mut bytes = vec![9u8];
        put_f32(&mut bytes, &data);
        assert_eq!(bytes.len(), 1 + 4 * data.len());
        assert_eq!(bytes[1..5], 1.5f32.to_le_bytes());
        let mut back = [0f32; 6];
        get_f32(&bytes[1..], &mut back);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&data));
    }

    #[test]
    fn i64_payloads_are_little_endian_and_add_wrapping() {
        let data = [1i64, -2, i64::MAX, i64::MIN];
        let mut bytes = vec![9u8];
        put_i64(&mut bytes, &data);
        assert_eq!(bytes.len(), 1 + 8 * data.len());
        assert_eq!(bytes[9..17], (-2i64).to_le_bytes());
        let mut back = [0i64; 4];
        get_i64(&bytes[1..], &mut back);
        assert_eq!(back, data);
        let mut sum = [10i64, 10, 1, -1];
        add_i64(&bytes[1..], &mut sum);
        assert_eq!(sum, [11, 8, i64::MIN, i64::MAX]);
    }

    #[test]
    fn abort_payloads_carry_the_blamed_rank() {
        let mut payload = 5u64.to_le_bytes().to_vec();
        payload.extend_from_slice(b"rank 5 closed");
        assert_eq!(
            decode_abort(&payload),
            (Some(5), "rank 5 closed".to_owned())
        );
        assert_eq!(decode_abort(&u64::MAX.to_le_bytes()), (None, String::new()));
        assert_eq!(decode_abort(b"x").0, None);
    }
}
