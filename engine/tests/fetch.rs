//! `slipway-engine fetch` against a local HTTP/1.1 server started by each test on
//! 127.0.0.1.
//!
//! The server is a few lines over a raw `TcpListener` rather than a framework, so a
//! test decides byte by byte what each request gets: the whole file (honouring
//! `Range`), a connection closed after N bytes, a body that stops after N bytes and
//! never continues, or a bare status. Every request's `Range`/`If-Range` is recorded,
//! so resumption is checked from what actually went over the wire.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest as _, Sha256};
use slipway_engine::fetch::{
    AttemptError, Backoff, FetchConfig, FetchError, FetchOutcome, Sha256Digest, fetch, partial_path,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// What the server does with one request.
#[derive(Debug, Clone, Copy)]
enum Reply {
    /// The file from the requested offset: 200, or 206 for a `Range` request.
    Full,
    /// Headers announcing the full length, then only `n` bytes, then close.
    CutAfter(usize),
    /// Headers announcing the full length, then `n` bytes, then silence, connection open.
    StallAfter(usize),
    /// Only this status, empty body.
    Status(u16),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    range: Option<String>,
    if_range: Option<String>,
}

struct Server {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

const ETAG: &str = "\"model-v1\"";

impl Server {
    /// Serves `body` at `/model.gguf`; `script(i)` decides the reply to request `i`.
    async fn start(body: Vec<u8>, script: impl Fn(usize) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (body, script, log) = (Arc::new(body), Arc::new(script), Arc::clone(&seen));
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (body, script, log) =
                    (Arc::clone(&body), Arc::clone(&script), Arc::clone(&log));
                tokio::spawn(async move {
                    let Some(request) = read_head(socket).await else {
                        return;
                    };
                    let (socket, seen) = request;
                    let index = {
                        let mut log = log.lock().expect("log lock");
                        log.push(seen.clone());
                        log.len() - 1
                    };
                    respond(socket, &body, &seen, script(index)).await;
                });
            }
        });
        Self {
            url: format!("http://{addr}/model.gguf"),
            seen,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("log lock").clone()
    }
}

async fn read_head(mut socket: TcpStream) -> Option<(TcpStream, Seen)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    let seen = Seen {
        range: header("range"),
        if_range: header("if-range"),
    };
    Some((socket, seen))
}

async fn respond(mut socket: TcpStream, body: &[u8], seen: &Seen, reply: Reply) {
    if let Reply::Status(code) = reply {
        let head =
            format!("HTTP/1.1 {code} Scripted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let _ = socket.write_all(head.as_bytes()).await;
        return;
    }
    let start = seen.range.as_deref().and_then(|r| {
        r.strip_prefix("bytes=")?
            .strip_suffix('-')?
            .parse::<usize>()
            .ok()
    });
    let len = body.len();
    let head = match start {
        Some(s) if s >= len => {
            let head = format!(
                "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let _ = socket.write_all(head.as_bytes()).await;
            return;
        }
        Some(s) => format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {s}-{}/{len}\r\nContent-Length: {}\r\n",
            len - 1,
            len - s
        ),
        None => format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n"),
    };
    let head = format!("{head}ETag: {ETAG}\r\nAccept-Ranges: bytes\r\nConnection: close\r\n\r\n");
    let rest = &body[start.unwrap_or(0)..];
    if socket.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    match reply {
        Reply::Full => {
            let _ = socket.write_all(rest).await;
            let _ = socket.shutdown().await;
        }
        Reply::CutAfter(n) => {
            let _ = socket.write_all(&rest[..n.min(rest.len())]).await;
            let _ = socket.flush().await;
            // Dropping the socket closes the connection mid-body.
        }
        Reply::StallAfter(n) => {
            let _ = socket.write_all(&rest[..n.min(rest.len())]).await;
            let _ = socket.flush().await;
            std::future::pending::<()>().await;
        }
        Reply::Status(_) => unreachable!("handled above"),
    }
}

/// Deterministic bytes that do not repeat with a short period.
fn model_bytes(len: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[0]
        })
        .collect()
}

fn digest_of(bytes: &[u8]) -> Sha256Digest {
    Sha256Digest(Sha256::digest(bytes).into())
}

fn config(url: &str, sha256: Sha256Digest, dest: &Path) -> FetchConfig {
    FetchConfig {
        timeout: Duration::from_secs(20),
        stall_timeout: Duration::from_secs(5),
        retries: 3,
        backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
        ..FetchConfig::new(url, sha256, dest)
    }
}

/// Runs a fetch with a guard, so a bug that hangs fails the test instead of the suite.
async fn run(config: &FetchConfig) -> Result<FetchOutcome, FetchError> {
    tokio::time::timeout(Duration::from_secs(60), fetch(config))
        .await
        .expect("fetch did not return within 60 s although every bound it was given is shorter")
}

fn dest_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("models").join("model.gguf")
}

const SIZE: usize = 3 << 20;

#[tokio::test]
async fn good_file_lands_verified_and_a_second_run_does_not_download() {
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::Full).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    let cfg = config(&server.url, digest_of(&body), &dest);

    let outcome = run(&cfg).await.expect("fetch");
    assert_eq!(
        outcome,
        FetchOutcome::Downloaded {
            bytes: SIZE as u64,
            attempts: 1,
            resumed_from_earlier_run: 0
        }
    );
    assert!(
        std::fs::read(&dest).expect("dest") == body,
        "dest differs from the served file"
    );
    assert!(
        !partial_path(&dest).exists(),
        "the partial must be gone after the rename"
    );
    assert_eq!(
        server.seen(),
        [Seen {
            range: None,
            if_range: None
        }]
    );

    assert_eq!(
        run(&cfg).await.expect("second fetch"),
        FetchOutcome::AlreadyPresent
    );
    assert_eq!(
        server.seen().len(),
        1,
        "an already verified file must not be downloaded again"
    );
}

#[tokio::test]
async fn wrong_sha256_fails_clearly_and_leaves_no_file() {
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::Full).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    let wrong = digest_of(b"another model");

    let error = run(&config(&server.url, wrong, &dest))
        .await
        .expect_err("must fail");
    let FetchError::ChecksumMismatch {
        expected,
        actual,
        bytes,
        ..
    } = &error
    else {
        panic!("expected a checksum mismatch, got {error}");
    };
    assert_eq!(
        (*expected, *actual, *bytes),
        (wrong, digest_of(&body), SIZE as u64)
    );
    let message = error.to_string();
    assert!(
        message.contains("sha256 mismatch")
            && message.contains(&wrong.to_string())
            && message.contains(&actual.to_string()),
        "{message}"
    );
    assert!(!dest.exists(), "nothing may be left at dest");
    assert!(
        !partial_path(&dest).exists(),
        "the unverified download must be removed"
    );
}

#[tokio::test]
async fn a_file_at_dest_with_another_hash_is_replaced() {
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::Full).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
    std::fs::write(&dest, b"stale model").expect("write stale");

    let outcome = run(&config(&server.url, digest_of(&body), &dest))
        .await
        .expect("fetch");
    assert!(
        matches!(outcome, FetchOutcome::Downloaded { .. }),
        "{outcome:?}"
    );
    assert!(std::fs::read(&dest).expect("dest") == body);
}

#[tokio::test]
async fn a_connection_cut_mid_transfer_resumes_with_range() {
    const CUT: usize = 1 << 20;
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |i| {
        if i == 0 {
            Reply::CutAfter(CUT)
        } else {
            Reply::Full
        }
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);

    let outcome = run(&config(&server.url, digest_of(&body), &dest))
        .await
        .expect("fetch");
    assert_eq!(
        outcome,
        FetchOutcome::Downloaded {
            bytes: SIZE as u64,
            attempts: 2,
            resumed_from_earlier_run: 0
        }
    );
    assert_eq!(
        server.seen(),
        [
            Seen {
                range: None,
                if_range: None
            },
            Seen {
                range: Some(format!("bytes={CUT}-")),
                if_range: Some(ETAG.to_owned())
            },
        ],
        "the second request must ask for exactly the missing bytes, guarded by the first response's ETag"
    );
    assert!(
        std::fs::read(&dest).expect("dest") == body,
        "the resumed file differs"
    );
}

#[tokio::test]
async fn a_partial_left_by_an_earlier_run_is_resumed() {
    const LEFT: usize = 700_000;
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::Full).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
    std::fs::write(partial_path(&dest), &body[..LEFT]).expect("write partial");

    let outcome = run(&config(&server.url, digest_of(&body), &dest))
        .await
        .expect("fetch");
    assert_eq!(
        outcome,
        FetchOutcome::Downloaded {
            bytes: SIZE as u64,
            attempts: 1,
            resumed_from_earlier_run: LEFT as u64
        }
    );
    assert_eq!(
        server.seen()[0].range.as_deref(),
        Some(format!("bytes={LEFT}-").as_str())
    );
    assert!(std::fs::read(&dest).expect("dest") == body);
}

#[tokio::test]
async fn a_complete_partial_from_an_earlier_run_is_verified_and_renamed() {
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::Full).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
    std::fs::write(partial_path(&dest), &body).expect("write partial");

    run(&config(&server.url, digest_of(&body), &dest))
        .await
        .expect("fetch");
    // The server answered 416 with the total, which matched what was staged.
    assert_eq!(server.seen().len(), 1);
    assert!(std::fs::read(&dest).expect("dest") == body);
}

#[tokio::test]
async fn a_stale_partial_from_an_earlier_run_is_discarded_once_on_mismatch() {
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::Full).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
    std::fs::write(partial_path(&dest), vec![0u8; 1000]).expect("write partial");

    run(&config(&server.url, digest_of(&body), &dest))
        .await
        .expect("fetch");
    let ranges: Vec<_> = server.seen().into_iter().map(|s| s.range).collect();
    assert_eq!(ranges, [Some("bytes=1000-".to_owned()), None]);
    assert!(std::fs::read(&dest).expect("dest") == body);
}

#[tokio::test]
async fn a_stalled_server_hits_the_stall_timeout_resumes_and_then_gives_up() {
    const SENT: usize = 64 << 10;
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |i| {
        Reply::StallAfter(if i == 0 { SENT } else { 0 })
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    let cfg = FetchConfig {
        stall_timeout: Duration::from_millis(300),
        retries: 2,
        ..config(&server.url, digest_of(&body), &dest)
    };

    let error = run(&cfg).await.expect_err("must fail");
    let FetchError::RetriesExhausted {
        attempts,
        staged,
        last,
        ..
    } = &error
    else {
        panic!("expected retries exhausted, got {error}");
    };
    assert!(matches!(last, AttemptError::Stalled(_)), "{error}");
    assert_eq!((*attempts, *staged), (3, SENT as u64));
    let ranges: Vec<_> = server.seen().into_iter().map(|s| s.range).collect();
    let resume = Some(format!("bytes={SENT}-"));
    assert_eq!(ranges, [None, resume.clone(), resume]);
    assert!(!dest.exists(), "nothing may be left at dest");
    assert_eq!(
        std::fs::metadata(partial_path(&dest))
            .expect("the partial is kept for a resume")
            .len(),
        SENT as u64
    );
    assert!(
        error.to_string().contains("no bytes from the server"),
        "{error}"
    );
}

#[tokio::test]
async fn a_stalled_server_hits_the_overall_timeout() {
    let body = model_bytes(SIZE);
    let server = Server::start(body.clone(), |_| Reply::StallAfter(1000)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    let cfg = FetchConfig {
        timeout: Duration::from_millis(500),
        stall_timeout: Duration::from_secs(30),
        ..config(&server.url, digest_of(&body), &dest)
    };

    let error = run(&cfg).await.expect_err("must fail");
    assert!(
        matches!(error, FetchError::Timeout { staged: 1000, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("overall timeout"), "{error}");
    assert_eq!(server.seen().len(), 1);
    assert!(!dest.exists());
}

#[tokio::test]
async fn a_server_error_is_retried_and_a_404_is_not() {
    let body = model_bytes(SIZE);
    let flaky = Server::start(body.clone(), |i| {
        if i == 0 {
            Reply::Status(503)
        } else {
            Reply::Full
        }
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    let outcome = run(&config(&flaky.url, digest_of(&body), &dest))
        .await
        .expect("fetch");
    assert!(
        matches!(outcome, FetchOutcome::Downloaded { attempts: 2, .. }),
        "{outcome:?}"
    );

    let missing = Server::start(body.clone(), |_| Reply::Status(404)).await;
    let dest = dir.path().join("other.gguf");
    let error = run(&config(&missing.url, digest_of(&body), &dest))
        .await
        .expect_err("must fail");
    assert!(
        matches!(&error, FetchError::Rejected { status, .. } if status.as_u16() == 404),
        "{error}"
    );
    assert_eq!(missing.seen().len(), 1, "a 404 must not be retried");
    assert!(!dest.exists());
    assert!(
        !partial_path(&dest).exists(),
        "an empty partial is not worth keeping"
    );
}

/// The binary, as the operator's init container runs it.
async fn cli(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_slipway-engine"))
            .arg("fetch")
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .expect("run slipway-engine")
    })
    .await
    .expect("join")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_fetches_logs_and_fails_clearly_on_a_wrong_sha256() {
    let body = model_bytes(SIZE);
    // Every run's first request is cut, so each run has to resume.
    let server = Server::start(body.clone(), |i| {
        if i % 2 == 0 {
            Reply::CutAfter(4096)
        } else {
            Reply::Full
        }
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let dest = dest_in(&dir);
    let args = |sha: Sha256Digest| {
        vec![
            server.url.clone(),
            "--sha256".to_owned(),
            sha.to_string(),
            "--dest".to_owned(),
            dest.display().to_string(),
            "--retries".to_owned(),
            "2".to_owned(),
            "--backoff-ms".to_owned(),
            "10".to_owned(),
        ]
    };

    let bad = cli(args(digest_of(b"not it"))).await;
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success(),
        "a wrong sha256 must fail the init container"
    );
    assert!(stderr.contains("sha256 mismatch"), "{stderr}");
    assert!(!dest.exists() && !partial_path(&dest).exists());

    let good = cli(args(digest_of(&body))).await;
    let stderr = String::from_utf8_lossy(&good.stderr);
    assert!(good.status.success(), "{stderr}");
    // Its log, at the default filter: the retry after the cut and the verified result.
    assert!(
        stderr.contains("attempt failed; retrying") && stderr.contains("fetched and verified"),
        "{stderr}"
    );
    assert!(std::fs::read(&dest).expect("dest") == body);

    let bad_hex = cli(vec![
        server.url.clone(),
        "--sha256".into(),
        "xyz".into(),
        "--dest".into(),
        "d".into(),
    ])
    .await;
    assert!(!bad_hex.status.success());
    assert!(String::from_utf8_lossy(&bad_hex.stderr).contains("64 hex digits"));
}
