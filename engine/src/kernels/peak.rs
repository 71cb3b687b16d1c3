//! This machine's own ceilings, which `make bench-model` measures before the model so
//! every throughput can also be read as a fraction of what the hardware does:
//!
//! - [`mac_rate`]: int8 multiply-adds per second with the best int8 dot-product
//!   instruction that runs here ([`MacInstruction::detect`], following the engine's
//!   own [`Isa::detect`]), accumulators in registers, no memory traffic;
//! - [`read_rate`]: streaming read bandwidth over a buffer much larger than the last
//!   level cache ([`read_buffer_words`]), summed with the widest loads that run here.
//!
//! Both run on 1..n threads at once and report the best of a few timed runs (a peak,
//! not a typical value). The checksums they return are what the loops computed, so the
//! work cannot be optimised away, and they are checked in the tests.

use std::hint::black_box;
use std::path::Path;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::Isa;
#[cfg(target_arch = "x86_64")]
use super::peak_x86;

/// The int8 multiply-add instruction the ceiling is measured with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MacInstruction {
    /// AVX-512 VNNI `vpdpbusd zmm`: 64 u8×i8 multiply-adds (the engine's
    /// [`Isa::Avx512Vnni`] kernel).
    Vnni512,
    /// AVX-VNNI `vpdpbusd ymm`: 32 multiply-adds.
    AvxVnni,
    /// AVX2 `vpmaddubsw` + `vpmaddwd` (+ `vpaddd`): 32 multiply-adds (the engine's
    /// [`Isa::Avx2`] kernel).
    Avx2,
    /// Portable 32-bit integer multiply-adds (the engine's [`Isa::Scalar`] kernel).
    Scalar,
}

impl MacInstruction {
    /// The best one this CPU runs: the engine's own dispatch ([`Isa::detect`]), with
    /// AVX-VNNI preferred over plain AVX2 where it runs.
    #[must_use]
    pub fn detect() -> Self {
        match Isa::detect() {
            Isa::Avx512Vnni => Self::Vnni512,
            Isa::Avx2 if Self::AvxVnni.runs() => Self::AvxVnni,
            Isa::Avx2 => Self::Avx2,
            Isa::Scalar => Self::Scalar,
        }
    }

    /// Every one this CPU runs (for tests).
    #[must_use]
    pub fn all_available() -> Vec<Self> {
        [Self::Vnni512, Self::AvxVnni, Self::Avx2, Self::Scalar]
            .into_iter()
            .filter(|i| i.runs())
            .collect()
    }

    /// Whether it runs here: by the rule of the engine's own dispatch (cpuid reports it
    /// and a probe of it ran in a child process, as [`Isa::detect`] says why).
    #[must_use]
    pub fn runs(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Self::Vnni512 => peak_x86::has_vnni512(),
                Self::AvxVnni => peak_x86::has_avx_vnni(),
                Self::Avx2 => peak_x86::has_avx2(),
                Self::Scalar => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Self::Scalar
        }
    }

    /// How it is named in reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Vnni512 => "vpdpbusd zmm (AVX-512 VNNI)",
            Self::AvxVnni => "vpdpbusd ymm (AVX-VNNI)",
            Self::Avx2 => "vpmaddubsw+vpmaddwd ymm (AVX2)",
            Self::Scalar => "scalar i32 multiply-add",
        }
    }

    /// Multiply-adds one iteration of [`Self::run`] does.
    #[must_use]
    pub fn macs_per_iter(self) -> u64 {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Vnni512 => peak_x86::VNNI512_MACS_PER_ITER,
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni => peak_x86::AVX_VNNI_MACS_PER_ITER,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => peak_x86::AVX2_MACS_PER_ITER,
            _ => SCALAR_CHAINS as u64,
        }
    }

    /// Runs `iters` iterations with operands derived from `seed`; returns the checksum
    /// of the accumulators, or `None` when this CPU does not run the instruction.
    #[must_use]
    pub fn run(self, iters: u64, seed: u8) -> Option<i64> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Vnni512 => peak_x86::vnni512(iters, seed),
            #[cfg(target_arch = "x86_64")]
            Self::AvxVnni => peak_x86::avx_vnni(iters, seed),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => peak_x86::avx2(iters, seed),
            Self::Scalar => Some(scalar_macs(iters, seed)),
            #[cfg(not(target_arch = "x86_64"))]
            _ => None,
        }
    }
}

/// Independent chains of the portable multiply-add loop.
const SCALAR_CHAINS: usize = 8;

/// `acc = acc * m + seed` on independent chains, with `m` (1) hidden from the compiler
/// so it cannot close the loop into a formula.
fn scalar_macs(iters: u64, seed: u8) -> i64 {
    let m = black_box(1i32);
    let a = i32::from(seed);
    let mut acc = [0i32; SCALAR_CHAINS];
    for _ in 0..iters {
        for c in &mut acc {
            *c = c.wrapping_mul(m).wrapping_add(a);
        }
    }
    acc.iter().map(|&c| i64::from(c)).sum()
}

/// A measured rate on some threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Threads that ran at once.
    pub threads: usize,
    /// Multiply-adds (or bytes) per second, all threads together.
    pub per_second: f64,
    /// Wrapping sum of the threads' checksums (consumed, so the work is kept).
    pub checksum: i64,
}

/// Runs `work(thread index)` on `threads` threads started together, `reps` times;
/// returns the shortest wall time and the checksums' wrapping sum of that run.
fn best_parallel_run(
    threads: usize,
    reps: usize,
    work: &(dyn Fn(usize) -> i64 + Sync),
) -> (Duration, i64) {
    let threads = threads.max(1);
    let mut best = (Duration::MAX, 0);
    for _ in 0..reps.max(1) {
        let start = Barrier::new(threads + 1);
        let (elapsed, checksum) = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|i| {
                    let start = &start;
                    s.spawn(move || {
                        start.wait();
                        work(i)
                    })
                })
                .collect();
            start.wait();
            let t = Instant::now();
            let sums: Vec<i64> = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect();
            (t.elapsed(), sums.into_iter().fold(0i64, i64::wrapping_add))
        });
        if elapsed < best.0 {
            best = (elapsed, checksum);
        }
    }
    best
}

/// Int8 multiply-adds per second of `instruction` on `threads` threads, each running
/// about `per_run` per timed run (best of `reps`); `None` when this CPU does not run
/// the instruction.
#[must_use]
pub fn mac_rate(
    instruction: MacInstruction,
    threads: usize,
    per_run: Duration,
    reps: usize,
) -> Option<Rate> {
    // Calibrate on one thread: double until a run takes an eighth of the target.
    let mut iters = 1024u64;
    let elapsed = loop {
        let t = Instant::now();
        black_box(instruction.run(iters, 1)?);
        let e = t.elapsed();
        if e >= per_run / 8 || iters >= 1 << 40 {
            break e;
        }
        iters *= 2;
    };
    let scale = per_run.as_secs_f64() / elapsed.as_secs_f64().max(1e-9);
    let iters = ((iters as f64 * scale) as u64).max(1);
    let threads = threads.max(1);
    let (wall, checksum) = best_parallel_run(threads, reps, &|i| {
        instruction.run(iters, (i % 7 + 1) as u8).unwrap_or(0)
    });
    let macs = (threads as u64 * iters * instruction.macs_per_iter()) as f64;
    Some(Rate {
        threads,
        per_second: macs / wall.as_secs_f64().max(1e-9),
        checksum,
    })
}

/// The smallest read buffer: 1 GiB.
const MIN_READ_BYTES: u64 = 1 << 30;
/// The largest (so a huge reported cache cannot exhaust memory): 4 GiB.
const MAX_READ_BYTES: u64 = 4 << 30;

/// Words (`u64`) of the bandwidth buffer: four times the largest CPU cache `sysfs`
/// reports (so at most a quarter of the reads can hit it), at least 1 GiB and at most
/// 4 GiB.
#[must_use]
pub fn read_buffer_words() -> usize {
    let cache = largest_cache_bytes(Path::new("/sys/devices/system/cpu/cpu0/cache")).unwrap_or(0);
    let bytes = cache
        .saturating_mul(4)
        .clamp(MIN_READ_BYTES, MAX_READ_BYTES);
    usize::try_from(bytes / 8).unwrap_or(usize::MAX)
}

/// The largest `index*/size` under a `sysfs` cache directory, in bytes.
fn largest_cache_bytes(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_cache_size(&s))
        .max()
}

/// A `sysfs` cache size (`48K`, `2048K`, `480M`, `1G` or plain bytes) in bytes.
fn parse_cache_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(scale)
}

/// The loads [`read_sum`] uses here.
#[must_use]
pub fn read_loads() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if peak_x86::has_vnni512() {
            return "512-bit (AVX-512)";
        }
        if peak_x86::has_avx2() {
            return "256-bit (AVX2)";
        }
    }
    "64-bit (portable)"
}

/// Wrapping sum of `words`, with the widest loads that run here.
#[must_use]
pub fn read_sum(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(s) = peak_x86::read_avx512(words) {
            return s;
        }
        if let Some(s) = peak_x86::read_avx2(words) {
            return s;
        }
    }
    words.iter().fold(0, |s, &w| s.wrapping_add(w))
}

/// A buffer of `words` words, every page written (so the reads hit memory, not the
/// shared zero page), holding `0, 1, 2, …`.
#[must_use]
pub fn read_buffer(words: usize) -> Vec<u64> {
    (0..words as u64).collect()
}

/// Bytes per second [`read_sum`] streams from `buffer` on `threads` threads, each
/// reading its own contiguous part (best of `reps` passes).
#[must_use]
pub fn read_rate(buffer: &[u64], threads: usize, reps: usize) -> Rate {
    let threads = threads.max(1);
    let part = buffer.len().div_ceil(threads).max(1);
    let (wall, checksum) = best_parallel_run(threads, reps, &|i| {
        let lo = (i * part).min(buffer.len());
        let hi = ((i + 1) * part).min(buffer.len());
        read_sum(&buffer[lo..hi]) as i64
    });
    Rate {
        threads,
        per_second: std::mem::size_of_val(buffer) as f64 / wall.as_secs_f64().max(1e-9),
        checksum,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `run(iters, seed)` must return: every multiply-add of every lane counted.
    fn expected_checksum(instruction: MacInstruction, iters: u64, seed: u8) -> i64 {
        let (iters, seed) = (iters as i64, i64::from(seed));
        match instruction {
            // Every 32-bit lane adds 4 products seed·1 per instruction.
            MacInstruction::Vnni512 | MacInstruction::AvxVnni => {
                instruction.macs_per_iter() as i64 * iters * seed
            }
            // Chain i multiplies bytes (seed+i)&15 by 3.
            MacInstruction::Avx2 => (0..4).map(|i| (seed + i) & 15).sum::<i64>() * 3 * 32 * iters,
            MacInstruction::Scalar => SCALAR_CHAINS as i64 * iters * seed,
        }
    }

    #[test]
    fn every_available_instruction_does_every_multiply_add() {
        let all = MacInstruction::all_available();
        assert!(all.contains(&MacInstruction::detect()));
        for instruction in all {
            for (iters, seed) in [(0, 3), (1, 1), (37, 5), (1000, 7)] {
                assert_eq!(
                    instruction.run(iters, seed),
                    Some(expected_checksum(instruction, iters, seed)),
                    "{instruction:?} {iters} {seed}"
                );
            }
        }
    }

    #[test]
    fn mac_rate_is_positive_and_finite_with_the_work_in_its_checksum() {
        for instruction in MacInstruction::all_available() {
            for threads in [1, 2] {
                let rate = mac_rate(instruction, threads, Duration::from_millis(5), 1)
                    .expect("available instruction");
                assert_eq!(rate.threads, threads);
                assert!(
                    rate.per_second.is_finite() && rate.per_second > 0.0,
                    "{rate:?}"
                );
                assert_ne!(rate.checksum, 0, "{instruction:?}");
            }
        }
    }

    #[test]
    fn read_sum_adds_every_word_with_any_tail() {
        for n in [0usize, 1, 7, 63, 64, 65, 1000, 4099] {
            let buf = read_buffer(n);
            let want = (0..n as u64).fold(0u64, u64::wrapping_add);
            assert_eq!(read_sum(&buf), want, "{n} words");
        }
    }

    #[test]
    fn read_rate_reads_every_part_once() {
        let buf = read_buffer(100_003);
        let want = (0..100_003u64).sum::<u64>() as i64;
        for threads in [1, 2, 3] {
            let rate = read_rate(&buf, threads, 2);
            assert_eq!(rate.checksum, want, "{threads} threads");
            assert!(rate.per_second.is_finite() && rate.per_second > 0.0);
        }
    }

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("48K\n"), Some(48 << 10));
        assert_eq!(parse_cache_size("491520K"), Some(491_520 << 10));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn read_buffer_is_at_least_four_caches_within_bounds() {
        let bytes = read_buffer_words() as u64 * 8;
        assert!((MIN_READ_BYTES..=MAX_READ_BYTES).contains(&bytes));
        if let Some(cache) = largest_cache_bytes(Path::new("/sys/devices/system/cpu/cpu0/cache")) {
            assert!(bytes >= (cache * 4).min(MAX_READ_BYTES));
        }
    }
}
