//! `slipway-engine fetch`: stage a model file from an `http(s)://` URL, verified by
//! its sha256, before the engine may start.
//!
//! The operator runs this as the init container of every engine pod whose model is an
//! `https://` source (see `operator/src/pod.rs`); the engine container starts only
//! after it exits 0, so a model that cannot be staged keeps the pod not-ready, never
//! serving.
//!
//! Invariants:
//! - A file appears at DEST only complete and verified: bytes are written to
//!   `DEST.partial`, the sha256 of everything written is checked, and only then is the
//!   partial renamed over DEST (atomic within one filesystem; the partial sits next to
//!   DEST for that reason).
//! - A checksum mismatch removes the partial and leaves no file at DEST.
//! - Every other failure (overall timeout, retries exhausted, an HTTP status that
//!   retrying cannot change) keeps the partial, so a rerun (the kubelet restarting the
//!   init container over the same `emptyDir`) resumes with an HTTP `Range` request
//!   instead of starting over.
//! - DEST already present with the right hash: success without touching the network.
//!
//! Timing: one overall deadline bounds the whole fetch, backoff sleeps included. A
//! stall timeout bounds every wait on the server (the response head, each body
//! chunk), so a server that stops sending fails the attempt, which is then retried
//! from the last byte written. Retries back off exponentially ([`Backoff`]: doubling
//! from `--backoff-ms` up to 30 s); an attempt that moved bytes resets the
//! delay, since the link evidently works, but still uses up one retry, so a server
//! that always cuts the connection cannot keep the fetch going forever.
//!
//! A resume sends `If-Range` with the strong `ETag` (or `Last-Modified`) of the first
//! response, so a file that changed on the server between attempts comes back whole
//! (200) instead of being spliced onto stale bytes.
//!
//! URLs are logged and reported without their query string: model URLs are often
//! pre-signed, and the signature is a credential.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt as _;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, ETAG, HeaderValue, IF_RANGE, LAST_MODIFIED, RANGE};
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _, AsyncWriteExt as _, BufWriter};
use tokio::time::Instant;
use tracing::{debug, info, warn};

/// Buffer for reading staged files back through the hasher and for writing chunks.
const IO_BUFFER: usize = 1 << 20;

pub use slipway_contract::Backoff;
pub use slipway_contract::fetch::{FetchArgs, InvalidSha256, Sha256Digest};

fn digest_of(hasher: &Sha256) -> Sha256Digest {
    Sha256Digest(hasher.clone().finalize().into())
}

/// Everything one fetch needs; [`FetchConfig::new`] fills in the defaults.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    pub url: String,
    pub sha256: Sha256Digest,
    pub dest: PathBuf,
    /// Bounds the whole fetch, backoff sleeps included.
    pub timeout: Duration,
    /// Bounds each wait on the server: the response head and every body chunk.
    pub stall_timeout: Duration,
    /// Attempts after the first.
    pub retries: u32,
    /// The wait before a retry, by failures in a row.
    pub backoff: Backoff,
    /// How often a progress line is logged while bytes flow.
    pub progress_interval: Duration,
}

impl FetchConfig {
    /// A config with the CLI's defaults (1 h overall, 60 s stall, 5 retries from 1 s).
    pub fn new(url: impl Into<String>, sha256: Sha256Digest, dest: impl Into<PathBuf>) -> Self {
        Self::from(&FetchArgs::new(url, sha256, dest))
    }

    /// # Errors
    /// [`FetchError::Config`] for a URL that is not http(s), a DEST without a file
    /// name, or a zero timeout.
    pub fn validate(&self) -> Result<(), FetchError> {
        let bad = |why: String| Err(FetchError::Config(why));
        match reqwest::Url::parse(&self.url) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => {}
            Ok(url) => {
                return bad(format!(
                    "URL scheme {:?}: only http and https",
                    url.scheme()
                ));
            }
            Err(e) => return bad(format!("URL {:?}: {e}", redact(&self.url))),
        }
        if self.dest.file_name().is_none() {
            return bad(format!("--dest {}: not a file path", self.dest.display()));
        }
        if self.timeout.is_zero() || self.stall_timeout.is_zero() {
            return bad("--timeout-ms and --stall-timeout-ms must be positive".to_owned());
        }
        Ok(())
    }
}

impl From<&FetchArgs> for FetchConfig {
    fn from(args: &FetchArgs) -> Self {
        Self {
            url: args.url.clone(),
            sha256: args.sha256,
            dest: args.dest.clone(),
            timeout: args.timeout,
            stall_timeout: args.stall_timeout,
            retries: args.retries,
            backoff: args.backoff_policy(),
            progress_interval: Duration::from_secs(5),
        }
    }
}

/// What a successful fetch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FetchOutcome {
    /// DEST already held a file with the expected sha256; nothing was downloaded.
    AlreadyPresent,
    /// The file was downloaded (and verified, and renamed to DEST).
    Downloaded {
        /// Size of the file.
        bytes: u64,
        /// Requests made, the successful one included.
        attempts: u32,
        /// Bytes found in DEST.partial from an earlier run and kept.
        resumed_from_earlier_run: u64,
    },
}

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("invalid fetch arguments: {0}")]
    Config(String),
    #[error(
        "sha256 mismatch for {url}: expected {expected}, the {bytes} bytes downloaded hash to {actual}; \
         the download was removed and nothing was written to {}", dest.display()
    )]
    ChecksumMismatch {
        url: String,
        expected: Sha256Digest,
        actual: Sha256Digest,
        bytes: u64,
        dest: PathBuf,
    },
    #[error("{url}: the server answered HTTP {status}, which retrying cannot change")]
    Rejected { url: String, status: StatusCode },
    #[error(
        "{url}: gave up after {attempts} attempts ({}); last failure: {last}",
        kept(*staged, partial)
    )]
    RetriesExhausted {
        url: String,
        attempts: u32,
        staged: u64,
        partial: PathBuf,
        last: AttemptError,
    },
    #[error(
        "{url}: not finished within the overall timeout of {timeout:?} ({}){}",
        kept(*staged, partial), last.as_ref().map(|e| format!("; last failure: {e}")).unwrap_or_default()
    )]
    Timeout {
        url: String,
        timeout: Duration,
        staged: u64,
        partial: PathBuf,
        last: Option<AttemptError>,
    },
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("building the HTTP client: {}", chain(.0))]
    Client(reqwest::Error),
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// Why one attempt failed in a way worth retrying.
#[derive(Debug, thiserror::Error)]
pub enum AttemptError {
    #[error("{}", chain(.0))]
    Transport(reqwest::Error),
    #[error("no bytes from the server for {0:?}")]
    Stalled(Duration),
    #[error("HTTP {0}")]
    Status(StatusCode),
    #[error("the body ended after byte {got} of {expected}")]
    Truncated { got: u64, expected: u64 },
    #[error("asked for bytes from {wanted}, the server answered with Content-Range {answer:?}")]
    BadRange { wanted: u64, answer: String },
}

/// What a failed fetch leaves behind, for its error message.
fn kept(staged: u64, partial: &Path) -> String {
    if staged == 0 {
        "nothing staged".to_owned()
    } else {
        format!(
            "{staged} bytes kept in {} for a later resume",
            partial.display()
        )
    }
}

/// A reqwest error with its causes ("error sending request: connection refused"),
/// which its own `Display` leaves out.
fn chain(error: &reqwest::Error) -> String {
    let mut out = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

/// The URL without query or fragment, for logs and errors.
pub fn redact(url: &str) -> String {
    url.split(['?', '#']).next().unwrap_or(url).to_owned()
}

/// A parsed `Content-Range` response header (RFC 9110 §14.4), bytes only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentRange {
    /// `bytes START-END/TOTAL` (TOTAL may be `*`: unknown).
    Bytes {
        start: u64,
        end: u64,
        total: Option<u64>,
    },
    /// `bytes */TOTAL`, sent with 416 Range Not Satisfiable.
    Unsatisfied { total: u64 },
}

/// Parses a `Content-Range` value; `None` for anything malformed or not in bytes.
pub fn parse_content_range(value: &str) -> Option<ContentRange> {
    let rest = value.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    if range == "*" {
        return Some(ContentRange::Unsatisfied {
            total: total.parse().ok()?,
        });
    }
    let (start, end) = range.split_once('-')?;
    let (start, end): (u64, u64) = (start.parse().ok()?, end.parse().ok()?);
    let total = match total {
        "*" => None,
        t => Some(t.parse().ok()?),
    };
    if end < start || total.is_some_and(|t| end >= t) {
        return None;
    }
    Some(ContentRange::Bytes { start, end, total })
}

/// Statuses worth another attempt: timeouts, throttling and server-side failures.
fn retryable(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

/// `DEST.partial`, in DEST's directory so the final rename stays on one filesystem.
pub fn partial_path(dest: &Path) -> PathBuf {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dest.with_file_name(name)
}

/// Runs the `fetch` subcommand to completion on its own runtime.
///
/// # Errors
/// See [`fetch`].
pub fn run(args: &FetchArgs) -> Result<FetchOutcome, FetchError> {
    let config = FetchConfig::from(args);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(FetchError::Runtime)?
        .block_on(fetch(&config))
}

/// A file of the release (the model, its tokenizer) that is not the one it names.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(
        "{what} {} failed verification: its sha256 is {actual} ({bytes} bytes), the release names {expected}",
        path.display()
    )]
    Mismatch {
        /// Which file of the release: "model", "tokenizer".
        what: &'static str,
        path: PathBuf,
        expected: Sha256Digest,
        actual: Sha256Digest,
        bytes: u64,
    },
    #[error("reading {} to verify its sha256: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Hashes the model file at `path` and compares it with `expected`, before anything
/// loads it: whatever staged it (the image, a volume, `fetch`), a file that is not
/// the release's model is never served. Returns its size.
///
/// # Errors
/// [`VerifyError::Mismatch`], or the I/O error reading it.
pub fn verify_file(path: &Path, expected: &Sha256Digest) -> Result<u64, VerifyError> {
    verify_release_file("model", path, expected)
}

/// [`verify_file`] for another file of the release, named `what` in the error
/// (e.g. "tokenizer").
///
/// # Errors
/// [`VerifyError::Mismatch`], or the I/O error reading it.
pub fn verify_release_file(
    what: &'static str,
    path: &Path,
    expected: &Sha256Digest,
) -> Result<u64, VerifyError> {
    let (actual, bytes) = file_sha256(path)?;
    if actual == *expected {
        Ok(bytes)
    } else {
        Err(VerifyError::Mismatch {
            what,
            path: path.to_owned(),
            expected: *expected,
            actual,
            bytes,
        })
    }
}

/// The sha256 of the file at `path` and its size: the one hashing loop behind
/// [`verify_file`] and the LoRA adapters' verification and cache identity.
///
/// # Errors
/// [`VerifyError::Io`] when the file cannot be read.
pub fn file_sha256(path: &Path) -> Result<(Sha256Digest, u64), VerifyError> {
    use std::io::Read as _;
    let io = |source| VerifyError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; IO_BUFFER];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok((digest_of(&hasher), bytes))
}

/// Downloads `config.url` to `config.dest`, verified by its sha256.
///
/// # Errors
/// [`FetchError::ChecksumMismatch`] (nothing left at DEST, partial removed);
/// [`FetchError::Rejected`] for an HTTP status that retrying cannot change;
/// [`FetchError::RetriesExhausted`] and [`FetchError::Timeout`] (partial kept for a
/// resume); [`FetchError::Io`] for local file failures; [`FetchError::Config`].
pub async fn fetch(config: &FetchConfig) -> Result<FetchOutcome, FetchError> {
    config.validate()?;
    let deadline = Instant::now() + config.timeout;
    let url = redact(&config.url);
    let dest = &config.dest;
    if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(io("creating", dir))?;
    }

    if tokio::fs::try_exists(dest)
        .await
        .map_err(io("checking", dest))?
    {
        let (hasher, bytes) = hash_file(dest).await?;
        let actual = digest_of(&hasher);
        if actual == config.sha256 {
            info!(dest = %dest.display(), bytes, sha256 = %actual, "already present and verified; nothing to fetch");
            return Ok(FetchOutcome::AlreadyPresent);
        }
        warn!(dest = %dest.display(), found = %actual, expected = %config.sha256, "the file at dest has another sha256; replacing it");
        tokio::fs::remove_file(dest)
            .await
            .map_err(io("removing", dest))?;
    }

    let client = reqwest::Client::builder()
        .connect_timeout(config.stall_timeout)
        .build()
        .map_err(FetchError::Client)?;
    let partial = partial_path(dest);
    let result = download(config, client, &url, deadline, &partial).await;
    if result.is_err()
        && tokio::fs::metadata(&partial)
            .await
            .is_ok_and(|m| m.len() == 0)
    {
        // Nothing worth resuming: leave no empty litter next to DEST.
        remove_if_present(&partial).await?;
    }
    result
}

/// The attempts loop of [`fetch`], from opening the partial to the rename.
async fn download(
    config: &FetchConfig,
    client: reqwest::Client,
    url: &str,
    deadline: Instant,
    partial: &Path,
) -> Result<FetchOutcome, FetchError> {
    let (url, dest) = (url.to_owned(), &config.dest);
    let mut staged = Staged::open(partial).await?;
    let mut from_earlier_run = staged.len;
    if from_earlier_run > 0 {
        info!(%url, bytes = from_earlier_run, partial = %partial.display(), "resuming from a partial download of an earlier run");
    }
    let mut transfer = Transfer {
        client,
        config,
        url: url.clone(),
        deadline,
        validator: None,
        progress: Progress::new(config.progress_interval, staged.len),
    };
    let (mut attempts, mut retries_used, mut consecutive) = (0u32, 0u32, 0u32);
    loop {
        attempts += 1;
        let before = staged.len;
        let failure = match transfer.attempt(&mut staged).await {
            Ok(()) => {
                staged.finish().await?;
                let actual = digest_of(&staged.hasher);
                if actual == config.sha256 {
                    let bytes = staged.len;
                    drop(staged);
                    tokio::fs::rename(partial, dest)
                        .await
                        .map_err(io("renaming the verified download to", dest))?;
                    sync_dir(dest).await;
                    info!(%url, dest = %dest.display(), bytes, attempts, sha256 = %actual, "fetched and verified");
                    return Ok(FetchOutcome::Downloaded {
                        bytes,
                        attempts,
                        resumed_from_earlier_run: from_earlier_run,
                    });
                }
                if from_earlier_run > 0 {
                    // The earlier run may have been fetching another file to the same
                    // DEST: its bytes are suspect, ours are not. Start over once.
                    warn!(%url, expected = %config.sha256, %actual, "sha256 mismatch after resuming an earlier run's partial; starting over from byte 0");
                    from_earlier_run = 0;
                    staged.truncate().await?;
                    continue;
                }
                let bytes = staged.len;
                drop(staged);
                remove_if_present(partial).await?;
                return Err(FetchError::ChecksumMismatch {
                    url,
                    expected: config.sha256,
                    actual,
                    bytes,
                    dest: dest.clone(),
                });
            }
            Err(failure) => failure,
        };
        staged.flush().await?;
        let last = match failure {
            Failure::Fatal(error) => return Err(error),
            Failure::Deadline(last) => return Err(timeout_error(config, &url, &staged, last)),
            Failure::Retry(last) => last,
        };
        consecutive = if staged.len > before {
            1
        } else {
            consecutive + 1
        };
        if retries_used >= config.retries {
            return Err(FetchError::RetriesExhausted {
                url,
                attempts,
                staged: staged.len,
                partial: partial.to_owned(),
                last,
            });
        }
        retries_used += 1;
        let delay = config.backoff.delay(consecutive);
        if Instant::now() + delay >= deadline {
            // The next attempt could not start before the deadline: say so now
            // rather than sleeping into it.
            return Err(timeout_error(config, &url, &staged, Some(last)));
        }
        warn!(%url, attempt = attempts, error = %last, staged = staged.len, retry_in = ?delay, "attempt failed; retrying");
        tokio::time::sleep(delay).await;
    }
}

fn timeout_error(
    config: &FetchConfig,
    url: &str,
    staged: &Staged,
    last: Option<AttemptError>,
) -> FetchError {
    FetchError::Timeout {
        url: url.to_owned(),
        timeout: config.timeout,
        staged: staged.len,
        partial: staged.path.clone(),
        last,
    }
}

/// How an attempt ended, when it did not end with the whole body written.
enum Failure {
    /// Worth another attempt (from the last byte written).
    Retry(AttemptError),
    /// The overall deadline passed (with what was going wrong, if anything).
    Deadline(Option<AttemptError>),
    /// Nothing another attempt could change.
    Fatal(FetchError),
}

impl From<FetchError> for Failure {
    fn from(error: FetchError) -> Self {
        Self::Fatal(error)
    }
}

/// State that lives across attempts of one fetch.
struct Transfer<'a> {
    client: reqwest::Client,
    config: &'a FetchConfig,
    /// Redacted.
    url: String,
    deadline: Instant,
    /// `If-Range` validator from the first response that had one.
    validator: Option<HeaderValue>,
    progress: Progress,
}

impl Transfer<'_> {
    /// One request: from byte `staged.len` to the end of the file.
    async fn attempt(&mut self, staged: &mut Staged) -> Result<(), Failure> {
        let mut request = self.client.get(&self.config.url);
        if staged.len > 0 {
            request = request.header(RANGE, format!("bytes={}-", staged.len));
            if let Some(validator) = &self.validator {
                request = request.header(IF_RANGE, validator.clone());
            }
        }
        info!(url = %self.url, from_byte = staged.len, "requesting");
        let response = self
            .bounded(request.send())
            .await?
            .map_err(|e| Failure::Retry(AttemptError::Transport(e.without_url())))?;
        let status = response.status();
        let content_range = response
            .headers()
            .get(CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let total = match status {
            StatusCode::PARTIAL_CONTENT => {
                match content_range.as_deref().and_then(parse_content_range) {
                    Some(ContentRange::Bytes { start, total, .. }) if start == staged.len => total,
                    _ => {
                        // Not the range we asked for: the staged bytes cannot be extended
                        // by this answer, so the next attempt starts clean.
                        let wanted = staged.len;
                        staged.truncate().await?;
                        return Err(Failure::Retry(AttemptError::BadRange {
                            wanted,
                            answer: content_range.unwrap_or_default(),
                        }));
                    }
                }
            }
            StatusCode::OK => {
                if staged.len > 0 {
                    info!(url = %self.url, staged = staged.len, "the server sent the whole file, not the range asked for (changed since, or no range support); starting over");
                    staged.truncate().await?;
                }
                response.content_length()
            }
            StatusCode::RANGE_NOT_SATISFIABLE => {
                // The staged bytes may already be the whole file: an earlier run
                // finished the transfer but not the rename.
                if let Some(ContentRange::Unsatisfied { total }) =
                    content_range.as_deref().and_then(parse_content_range)
                    && total == staged.len
                {
                    return Ok(());
                }
                staged.truncate().await?;
                return Err(Failure::Retry(AttemptError::Status(status)));
            }
            status if retryable(status) => {
                return Err(Failure::Retry(AttemptError::Status(status)));
            }
            status => {
                return Err(Failure::Fatal(FetchError::Rejected {
                    url: self.url.clone(),
                    status,
                }));
            }
        };
        if self.validator.is_none() {
            self.validator = validator(response.headers());
        }
        self.progress.total = total;
        let mut body = response.bytes_stream();
        while let Some(chunk) = self.bounded(body.next()).await? {
            let chunk =
                chunk.map_err(|e| Failure::Retry(AttemptError::Transport(e.without_url())))?;
            staged.write(&chunk).await?;
            self.progress.tick(&self.url, staged.len);
        }
        match total {
            Some(expected) if staged.len < expected => {
                Err(Failure::Retry(AttemptError::Truncated {
                    got: staged.len,
                    expected,
                }))
            }
            _ => Ok(()),
        }
    }

    /// Awaits `fut` within the stall timeout and the overall deadline.
    async fn bounded<F: Future>(&self, fut: F) -> Result<F::Output, Failure> {
        let stall_at = Instant::now() + self.config.stall_timeout;
        let until = stall_at.min(self.deadline);
        tokio::time::timeout_at(until, fut).await.map_err(|_| {
            if until == self.deadline {
                Failure::Deadline(None)
            } else {
                Failure::Retry(AttemptError::Stalled(self.config.stall_timeout))
            }
        })
    }
}

/// A validator usable in `If-Range`: a strong ETag, else `Last-Modified`
/// (weak ETags are not allowed there, RFC 9110 §13.1.5).
fn validator(headers: &reqwest::header::HeaderMap) -> Option<HeaderValue> {
    headers
        .get(ETAG)
        .filter(|v| !v.as_bytes().starts_with(b"W/"))
        .or_else(|| headers.get(LAST_MODIFIED))
        .cloned()
}

/// Progress lines: at most one per interval while bytes flow.
struct Progress {
    interval: Duration,
    started: Instant,
    last_line: Instant,
    start_bytes: u64,
    total: Option<u64>,
}

impl Progress {
    fn new(interval: Duration, start_bytes: u64) -> Self {
        let now = Instant::now();
        Self {
            interval,
            started: now,
            last_line: now,
            start_bytes,
            total: None,
        }
    }

    fn tick(&mut self, url: &str, bytes: u64) {
        let now = Instant::now();
        if now.duration_since(self.last_line) < self.interval {
            return;
        }
        self.last_line = now;
        let secs = now.duration_since(self.started).as_secs_f64();
        #[allow(clippy::cast_precision_loss)] // a rate for people to read
        let mib_per_s = bytes.saturating_sub(self.start_bytes) as f64 / secs / (1 << 20) as f64;
        #[allow(clippy::cast_precision_loss)]
        let percent = self.total.map(|t| 100.0 * bytes as f64 / t.max(1) as f64);
        info!(%url, bytes, total = ?self.total, percent = ?percent.map(|p| (p * 10.0).round() / 10.0), mib_per_s = (mib_per_s * 10.0).round() / 10.0, "downloading");
    }
}

/// `DEST.partial`, open for appending, with the sha256 state of what it holds.
struct Staged {
    path: PathBuf,
    file: BufWriter<tokio::fs::File>,
    len: u64,
    hasher: Sha256,
}

impl Staged {
    /// Opens (or creates) the partial and hashes what an earlier run left in it.
    async fn open(path: &Path) -> Result<Self, FetchError> {
        let mut file = tokio::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .await
            .map_err(io("opening", path))?;
        let (hasher, len) = hash_reader(&mut file, path).await?;
        // Reading left the cursor at the end, which is where writing resumes.
        Ok(Self {
            path: path.to_owned(),
            file: BufWriter::with_capacity(IO_BUFFER, file),
            len,
            hasher,
        })
    }

    async fn write(&mut self, chunk: &[u8]) -> Result<(), FetchError> {
        self.file
            .write_all(chunk)
            .await
            .map_err(io("writing", &self.path))?;
        self.hasher.update(chunk);
        self.len += chunk.len() as u64;
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), FetchError> {
        self.file.flush().await.map_err(io("writing", &self.path))
    }

    async fn truncate(&mut self) -> Result<(), FetchError> {
        self.flush().await?;
        let file = self.file.get_mut();
        file.set_len(0)
            .await
            .map_err(io("truncating", &self.path))?;
        file.rewind().await.map_err(io("truncating", &self.path))?;
        self.len = 0;
        self.hasher = Sha256::new();
        Ok(())
    }

    /// Flushes and syncs, so the bytes that were hashed are the bytes on disk
    /// before the rename publishes them.
    async fn finish(&mut self) -> Result<(), FetchError> {
        self.flush().await?;
        self.file
            .get_ref()
            .sync_all()
            .await
            .map_err(io("syncing", &self.path))
    }
}

async fn hash_file(path: &Path) -> Result<(Sha256, u64), FetchError> {
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(io("opening", path))?;
    hash_reader(&mut file, path).await
}

async fn hash_reader(file: &mut tokio::fs::File, path: &Path) -> Result<(Sha256, u64), FetchError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; IO_BUFFER];
    let mut len = 0u64;
    loop {
        let n = file.read(&mut buf).await.map_err(io("reading", path))?;
        if n == 0 {
            return Ok((hasher, len));
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
}

async fn remove_if_present(path: &Path) -> Result<(), FetchError> {
    match tokio::fs::remove_file(path).await {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io("removing", path)(e)),
        _ => Ok(()),
    }
}

/// Makes the rename durable. Best effort: some filesystems refuse to sync a
/// directory, and the file itself is already synced.
async fn sync_dir(dest: &Path) {
    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let result = match tokio::fs::File::open(dir).await {
        Ok(d) => d.sync_all().await,
        Err(e) => Err(e),
    };
    if let Err(error) = result {
        debug!(%error, dir = %dir.display(), "could not sync the directory after the rename");
    }
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> FetchError {
    let path = path.to_owned();
    move |source| FetchError::Io {
        action,
        path,
        source,
    }
}

#[cfg(test)]
#[path = "fetch_tests.rs"]
mod tests;
