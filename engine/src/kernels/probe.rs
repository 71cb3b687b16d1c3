//! Which of the engine's x86 instruction sets run here. One rule for every dispatch
//! ([`super::Isa::detect`], [`super::Isa::all_available`], the kernels' own checks and
//! [`super::peak::MacInstruction::runs`]): a set is used only when cpuid reports every
//! feature its code is compiled with *and* a probe of the instructions that code uses
//! ran, in a child process, and gave the expected answer.
//!
//! Why not cpuid alone: it says what the CPU has, not what runs in this VM. Hypervisors
//! advertise instructions that then fault with SIGILL (llama.cpp died at AMX's
//! `tilezero` on the Xeon VMs we build it on; `engine/scripts/probe-cpu-isa` applies
//! this same rule to that build). A probe that faulted in the engine's own process would
//! kill it, so each runs in a forked child and only a child that exits 0 counts.
//!
//! Invariants:
//! - A set is never usable without its cpuid bits, so the `#[target_feature]` code it
//!   gates is sound whatever a probe says.
//! - Each set is probed once per process, on the first question; every later answer
//!   is the same.
//! - The child runs only the probe body (registers and stack), `prctl` and `_exit`:
//!   nothing that allocates or locks. The engine is multi-threaded when this runs, and
//!   a forked child has only the forking thread, perhaps with a lock (the allocator's)
//!   that another thread held at the fork.
//! - Where a child cannot be forked (or off Unix), cpuid alone decides, with a warning:
//!   a failed fork says nothing about the instructions.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    _CMP_EQ_OQ, _mm_set1_epi16, _mm256_abs_epi8, _mm256_add_epi32, _mm256_and_si256, _mm256_cmp_ps,
    _mm256_cmpeq_epi32, _mm256_cvtepi32_ps, _mm256_cvtph_ps, _mm256_dpbusd_avx_epi32,
    _mm256_fmadd_ps, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_movemask_epi8,
    _mm256_movemask_ps, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setzero_si256, _mm256_sign_epi8, _mm256_srli_epi16, _mm256_xor_si256, _mm512_and_si512,
    _mm512_cmpeq_epi64_mask, _mm512_cvtepi32_ps, _mm512_cvtph_ps, _mm512_cvtps_epi64,
    _mm512_dpbusd_epi32, _mm512_extractf32x8_ps, _mm512_fmadd_ps, _mm512_set1_epi8,
    _mm512_set1_epi64, _mm512_set1_ps, _mm512_setzero_si512, _mm512_srli_epi16,
};
use std::hint::black_box;
use std::io;
use std::sync::OnceLock;

/// An x86 instruction set the engine has code for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Extension {
    /// AVX2 with FMA and F16C: [`super::Isa::Avx2`] and the AVX2 ceilings.
    Avx2,
    /// AVX-512 F, BW and DQ with VNNI, F16C and FMA: [`super::Isa::Avx512Vnni`] and
    /// the AVX-512 ceilings.
    Avx512Vnni,
    /// AVX-VNNI (`vpdpbusd ymm`): the multiply-add ceiling only.
    AvxVnni,
}

impl Extension {
    const ALL: [Self; 3] = [Self::Avx2, Self::Avx512Vnni, Self::AvxVnni];

    /// Whether cpuid (with the OS's register state, which `is_x86_feature_detected!`
    /// also checks) reports every feature the code for this set is compiled with.
    pub(crate) fn in_cpuid(self) -> bool {
        use std::arch::is_x86_feature_detected as has;
        match self {
            Self::Avx2 => has!("avx2") && has!("fma") && has!("f16c"),
            Self::Avx512Vnni => {
                has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512dq")
                    && has!("avx512vnni")
                    && has!("f16c")
                    && has!("fma")
            }
            Self::AvxVnni => has!("avx2") && has!("avxvnni"),
        }
    }

    /// Whether the engine may use this set here: cpuid reports it and its probe ran
    /// (see the module). Probes every set on the first call of the process.
    pub(crate) fn runs(self) -> bool {
        static RUNS: OnceLock<[bool; 3]> = OnceLock::new();
        RUNS.get_or_init(|| Self::ALL.map(Self::check))[self as usize]
    }

    /// The probe body: computes with the set's instructions, true on the right answer.
    /// Call it only where [`Self::in_cpuid`] holds.
    fn probe(self) -> fn() -> bool {
        match self {
            // SAFETY: the caller checked `in_cpuid`: avx2, fma and f16c.
            Self::Avx2 => || unsafe { avx2_answers() },
            // SAFETY: the caller checked `in_cpuid`: avx512f/bw/dq/vnni, f16c and fma.
            Self::Avx512Vnni => || unsafe { avx512_vnni_answers() },
            // SAFETY: the caller checked `in_cpuid`: avx2 and avxvnni.
            Self::AvxVnni => || unsafe { avx_vnni_answers() },
        }
    }

    /// cpuid, then the probe in a child; logs what it found.
    fn check(self) -> bool {
        if !self.in_cpuid() {
            tracing::debug!(isa = ?self, "not in cpuid");
            return false;
        }
        match run_in_child(self.probe()) {
            Outcome::Expected => {
                tracing::info!(isa = ?self, "in cpuid, and its probe ran");
                true
            }
            Outcome::Wrong => {
                tracing::warn!(isa = ?self, "in cpuid, but its probe gave a wrong answer; not used");
                false
            }
            Outcome::Killed(signal) => {
                tracing::warn!(
                    isa = ?self,
                    signal,
                    "in cpuid, but its probe was killed by a signal (SIGILL is 4); not used"
                );
                false
            }
            Outcome::NotProbed(error) => {
                tracing::warn!(isa = ?self, %error, "could not probe; trusting cpuid");
                true
            }
        }
    }
}

/// How a probe run in a child process ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// It returned true.
    Expected,
    /// It returned false.
    Wrong,
    /// This signal ended it (SIGILL for an instruction that does not run).
    Killed(i32),
    /// No child ran it (the fork or the wait failed): nothing is known.
    NotProbed(io::Error),
}

/// Runs `body` in a forked child process and reports how the child ended.
///
/// `body` runs in the child of a possibly multi-threaded process: it must not
/// allocate, take locks or panic (a panic is caught, but its message allocates).
#[cfg(unix)]
pub(crate) fn run_in_child(body: fn() -> bool) -> Outcome {
    // SAFETY: fork itself has no preconditions; in a multi-threaded process the child
    // may only do async-signal-safe work, and it does (below and the contract above).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Outcome::NotProbed(io::Error::last_os_error());
    }
    if pid == 0 {
        // A probe that faults is an expected outcome, not a crash: no core file.
        // SAFETY: PR_SET_DUMPABLE takes one integer argument; a plain system call.
        #[cfg(target_os = "linux")]
        unsafe {
            libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong);
        }
        // Never unwind out of here: the child would go on running the parent's code.
        let ok = std::panic::catch_unwind(body).unwrap_or(false);
        // SAFETY: _exit ends the child at once, running no atexit handlers and flushing
        // no stdio buffers copied from the parent (which would print them twice).
        unsafe { libc::_exit(if ok { 0 } else { 1 }) }
    }
    let mut status = 0;
    loop {
        // SAFETY: `pid` is this call's child, not yet waited for; `status` is a valid
        // place for the result.
        if unsafe { libc::waitpid(pid, &raw mut status, 0) } == pid {
            break;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Outcome::NotProbed(error);
        }
    }
    if libc::WIFSIGNALED(status) {
        Outcome::Killed(libc::WTERMSIG(status))
    } else if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Outcome::Expected
    } else {
        Outcome::Wrong
    }
}

/// Off Unix there is no fork: nothing is probed.
#[cfg(not(unix))]
pub(crate) fn run_in_child(_body: fn() -> bool) -> Outcome {
    Outcome::NotProbed(io::Error::new(
        io::ErrorKind::Unsupported,
        "no fork on this platform",
    ))
}

// The probes compute a block term the way the kernels do: weights unpacked from
// nibbles (0x35 >> 4 & 0x0f = 3), dot products with activations of -2 (4 × 3 × -2 =
// -24 per 32-bit lane), times an f16 scale of 1.5 (0x3e00) plus 0.5 by FMA. The inputs
// pass through `black_box`, so nothing is computed at compile time.

/// AVX2 kernel: `vpsrlw`/`vpand` nibble unpacking, the byte kernel's re-centring
/// (`vpxor`) and `vpabsb`/`vpsignb`, `vpmaddubsw` + `vpmaddwd`, `vcvtph2ps`, `vfmadd`.
/// The two dot products add up to -48 a lane, the term to -71.5.
#[target_feature(enable = "avx2,fma,f16c")]
fn avx2_answers() -> bool {
    let packed = _mm256_set1_epi8(black_box(0x35));
    let nibbles = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), _mm256_set1_epi8(0x0f));
    // 0x83 re-centred (xor 0x80) is 3, as a byte weight of 131 is.
    let bytes = _mm256_xor_si256(
        _mm256_set1_epi8(black_box(0x83_u8.cast_signed())),
        _mm256_set1_epi8(i8::MIN),
    );
    let x = _mm256_set1_epi8(black_box(-2));
    let ones = _mm256_set1_epi16(1);
    let from_nibbles = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, x), ones);
    let from_bytes = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(bytes), _mm256_sign_epi8(x, bytes)),
        ones,
    );
    let dot = _mm256_add_epi32(from_nibbles, from_bytes);
    let scale = _mm256_cvtph_ps(_mm_set1_epi16(black_box(0x3e00)));
    let term = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, _mm256_set1_ps(0.5));
    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(term, _mm256_set1_ps(-71.5))) == 0xff
}

/// AVX-512 VNNI kernel: BW unpacking, `vpdpbusd zmm`, `vcvtph2ps zmm`, `vfmadd` (to
/// -35.5), and the exact sums' DQ `vcvtps2qq` (-35.5 rounds to even: -36).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,f16c,fma")]
fn avx512_vnni_answers() -> bool {
    let packed = _mm512_set1_epi8(black_box(0x35));
    let w = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), _mm512_set1_epi8(0x0f));
    let x = _mm512_set1_epi8(black_box(-2));
    let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
    let scale = _mm512_cvtph_ps(_mm256_set1_epi16(black_box(0x3e00)));
    let term = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, _mm512_set1_ps(0.5));
    let fixed = _mm512_cvtps_epi64(_mm512_extractf32x8_ps::<1>(term));
    _mm512_cmpeq_epi64_mask(fixed, _mm512_set1_epi64(-36)) == 0xff
}

/// AVX-VNNI ceiling: `vpdpbusd ymm` (VEX).
#[target_feature(enable = "avx2,avxvnni")]
fn avx_vnni_answers() -> bool {
    let w = _mm256_set1_epi8(black_box(3));
    let x = _mm256_set1_epi8(black_box(-2));
    let dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
    _mm256_movemask_epi8(_mm256_cmpeq_epi32(dot, _mm256_set1_epi32(-24))) == -1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Isa;
    use crate::kernels::peak::MacInstruction;

    #[test]
    fn a_body_with_the_expected_answer_counts() {
        assert!(matches!(run_in_child(|| true), Outcome::Expected));
    }

    #[test]
    fn a_body_with_a_wrong_answer_does_not() {
        assert!(matches!(run_in_child(|| false), Outcome::Wrong));
    }

    #[test]
    fn a_faulting_instruction_kills_the_child_not_the_process() {
        fn faults() -> bool {
            // SAFETY: `ud2` touches no memory or stack; it raises SIGILL, by design.
            unsafe { std::arch::asm!("ud2", options(nomem, nostack, noreturn)) }
        }
        let outcome = run_in_child(faults);
        assert!(
            matches!(outcome, Outcome::Killed(libc::SIGILL)),
            "{outcome:?}"
        );
    }

    /// On a CPU that has a set, its probe runs or faults: a wrong answer would mean the
    /// probe's expected answer is wrong, and the set off everywhere.
    #[test]
    fn every_probe_in_cpuid_answers_right_or_faults() {
        for ext in Extension::ALL.into_iter().filter(|e| e.in_cpuid()) {
            let outcome = run_in_child(ext.probe());
            assert!(
                matches!(outcome, Outcome::Expected | Outcome::Killed(libc::SIGILL)),
                "{ext:?}: {outcome:?}"
            );
            assert_eq!(ext.runs(), matches!(outcome, Outcome::Expected), "{ext:?}");
        }
    }

    #[test]
    fn the_dispatch_uses_only_sets_in_cpuid() {
        let all = Isa::all_available();
        assert!(all.contains(&Isa::detect()));
        for isa in all {
            let in_cpuid = match isa {
                Isa::Scalar => true,
                Isa::Avx2 => Extension::Avx2.in_cpuid(),
                Isa::Avx512Vnni => Extension::Avx512Vnni.in_cpuid(),
            };
            assert!(in_cpuid, "{isa:?}");
        }
        for mac in MacInstruction::all_available() {
            let in_cpuid = match mac {
                MacInstruction::Scalar => true,
                MacInstruction::Avx2 => Extension::Avx2.in_cpuid(),
                MacInstruction::Vnni512 => Extension::Avx512Vnni.in_cpuid(),
                MacInstruction::AvxVnni => Extension::AvxVnni.in_cpuid(),
            };
            assert!(in_cpuid, "{mac:?}");
        }
    }
}
