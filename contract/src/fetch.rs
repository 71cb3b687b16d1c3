//! `slipway-engine fetch`: the init container that stages a network model.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::Args;

use crate::backoff::Backoff;
use crate::telemetry::LogArgs;
use crate::units::{format_millis, parse_millis};

/// A sha256 digest, written as 64 hex digits (either case) on the command line and
/// printed in lowercase.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sha256Digest(pub [u8; 32]);

/// A sha256 that is not 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidSha256(pub String);

impl fmt::Display for InvalidSha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a sha256 is 64 hex digits, got {:?}", self.0)
    }
}

impl std::error::Error for InvalidSha256 {}

impl FromStr for Sha256Digest {
    type Err = InvalidSha256;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s.trim(), &mut out).map_err(|_| InvalidSha256(s.to_owned()))?;
        Ok(Self(out))
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256Digest({self})")
    }
}

/// The `fetch` subcommand's flags.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct FetchArgs {
    /// The http:// or https:// URL of the file.
    pub url: String,
    /// The sha256 of the whole file (64 hex digits); checked before anything appears at
    /// --dest.
    #[arg(long, value_name = "HEX")]
    pub sha256: Sha256Digest,
    /// Where the verified file goes. Bytes are staged in PATH.partial next to it, which
    /// a rerun resumes from.
    #[arg(long, value_name = "PATH")]
    pub dest: PathBuf,
    /// Overall limit for the whole fetch in ms, retries and backoff included.
    #[arg(long = "timeout-ms", value_name = "MS", default_value = "3600000", value_parser = parse_millis)]
    pub timeout: Duration,
    /// Ms without a byte from the server before an attempt is given up and retried.
    #[arg(long = "stall-timeout-ms", value_name = "MS", default_value = "60000", value_parser = parse_millis)]
    pub stall_timeout: Duration,
    /// Retries after the first attempt; each resumes where the last one stopped.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub retries: u32,
    /// First backoff delay in ms; it doubles per consecutive failure, up to 30 s
    /// ([`FETCH_BACKOFF_MAX`]).
    #[arg(long = "backoff-ms", value_name = "MS", default_value = "1000", value_parser = parse_millis)]
    pub backoff: Duration,
    /// Log line format.
    #[command(flatten)]
    pub logs: LogArgs,
}

/// The longest wait between two attempts of a fetch.
pub const FETCH_BACKOFF_MAX: Duration = Duration::from_secs(30);

impl FetchArgs {
    /// The retry policy of these flags: `--backoff-ms` doubling per failure in a row,
    /// capped at [`FETCH_BACKOFF_MAX`].
    #[must_use]
    pub fn backoff_policy(&self) -> Backoff {
        Backoff::new(self.backoff, FETCH_BACKOFF_MAX)
    }

    /// The defaults for everything but what to fetch and where.
    #[must_use]
    pub fn new(url: impl Into<String>, sha256: Sha256Digest, dest: impl Into<PathBuf>) -> Self {
        Self {
            url: url.into(),
            sha256,
            dest: dest.into(),
            timeout: Duration::from_secs(3600),
            stall_timeout: Duration::from_secs(60),
            retries: 5,
            backoff: Duration::from_secs(1),
            logs: LogArgs::default(),
        }
    }

    /// The flags that reproduce `self` when parsed (without the subcommand name).
    #[must_use]
    pub fn to_args(&self) -> Vec<String> {
        // Destructured without `..`: a new field that is not written here fails to
        // compile, so no flag can be forgotten.
        let Self {
            url,
            sha256,
            dest,
            timeout,
            stall_timeout,
            retries,
            backoff,
            logs,
        } = self;
        // `--flag=value`, as `serve`'s: a value starting with '-' is never a flag.
        let mut out = vec![
            url.clone(),
            format!("--sha256={sha256}"),
            format!("--dest={}", dest.display()),
            format!("--timeout-ms={}", format_millis(*timeout)),
            format!("--stall-timeout-ms={}", format_millis(*stall_timeout)),
            format!("--retries={retries}"),
            format!("--backoff-ms={}", format_millis(*backoff)),
        ];
        out.extend(logs.to_args());
        out
    }
}
