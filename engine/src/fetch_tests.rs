//! Unit tests of `fetch`'s pure parts (parsing, the CLI's backoff, paths, config
//! checks) and of `verify_file`, which checks a staged model whatever its source.

use super::*;

#[test]
fn content_range_forms() {
    assert_eq!(
        parse_content_range("bytes 100-199/1000"),
        Some(ContentRange::Bytes {
            start: 100,
            end: 199,
            total: Some(1000)
        })
    );
    assert_eq!(
        parse_content_range("bytes 0-9/*"),
        Some(ContentRange::Bytes {
            start: 0,
            end: 9,
            total: None
        })
    );
    assert_eq!(
        parse_content_range("bytes */1000"),
        Some(ContentRange::Unsatisfied { total: 1000 })
    );
    for bad in [
        "items 0-1/2",
        "bytes 5-4/10",
        "bytes 0-10/10",
        "bytes x-1/2",
        "bytes 0-1",
        "",
    ] {
        assert_eq!(parse_content_range(bad), None, "{bad:?}");
    }
}

#[test]
fn the_cli_backoff_doubles_from_its_flag_up_to_30_s() {
    let config = FetchConfig {
        backoff: FetchArgs {
            backoff: Duration::from_secs(4),
            ..FetchArgs::new("http://h/m", Sha256Digest([0; 32]), "m.gguf")
        }
        .backoff_policy(),
        ..FetchConfig::new("http://h/m", Sha256Digest([0; 32]), "m.gguf")
    };
    let delays: Vec<_> = (1..=5).map(|n| config.backoff.delay(n).as_secs()).collect();
    assert_eq!(delays, [4, 8, 16, 30, 30]);
}

#[test]
fn partial_sits_next_to_dest() {
    assert_eq!(
        partial_path(Path::new("/models/model.gguf")),
        Path::new("/models/model.gguf.partial")
    );
    assert_eq!(
        partial_path(Path::new("m.gguf")),
        Path::new("m.gguf.partial")
    );
}

#[test]
fn sha256_parses_64_hex_digits_only() {
    let hex = "AB".repeat(32);
    let digest: Sha256Digest = hex.parse().expect("valid");
    assert_eq!(digest.to_string(), "ab".repeat(32));
    for bad in ["", "ab", &"zz".repeat(32), &"ab".repeat(33)] {
        assert!(bad.parse::<Sha256Digest>().is_err(), "{bad:?}");
    }
}

#[test]
fn redaction_drops_query_and_fragment() {
    assert_eq!(
        redact("https://h/m.gguf?X-Sig=secret#f"),
        "https://h/m.gguf"
    );
    assert_eq!(redact("https://h/m.gguf"), "https://h/m.gguf");
}

#[test]
fn retry_only_what_can_change() {
    for s in [408, 429, 500, 502, 503] {
        assert!(retryable(StatusCode::from_u16(s).expect("status")), "{s}");
    }
    for s in [400, 401, 403, 404, 410] {
        assert!(!retryable(StatusCode::from_u16(s).expect("status")), "{s}");
    }
}

#[test]
fn config_rejects_other_schemes_and_dirs() {
    let sha = Sha256Digest([0; 32]);
    assert!(
        FetchConfig::new("https://h/m", sha, "/m/x")
            .validate()
            .is_ok()
    );
    assert!(
        FetchConfig::new("ftp://h/m", sha, "/m/x")
            .validate()
            .is_err()
    );
    assert!(
        FetchConfig::new("not a url", sha, "/m/x")
            .validate()
            .is_err()
    );
    assert!(
        FetchConfig::new("https://h/m", sha, "/")
            .validate()
            .is_err()
    );
}

#[test]
fn verify_file_hashes_the_whole_file_and_names_a_mismatch() {
    let dir = tempfile::tempdir().expect("tempdir");
    // FIPS 180-2's "abc" vector: the hash the release would name.
    let abc = dir.path().join("abc");
    std::fs::write(&abc, b"abc").expect("write");
    let abc_sha: Sha256Digest = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        .parse()
        .expect("valid");
    assert_eq!(verify_file(&abc, &abc_sha).expect("matches"), 3);

    // Longer than one read buffer, so the hash spans several reads; the last byte
    // differs from the file the release names.
    let big = dir.path().join("big");
    let mut bytes = vec![7u8; IO_BUFFER + 5];
    std::fs::write(&big, &bytes).expect("write");
    let named = Sha256Digest(Sha256::digest(&bytes).into());
    assert_eq!(
        verify_file(&big, &named).expect("matches"),
        bytes.len() as u64
    );
    *bytes.last_mut().expect("not empty") = 8;
    std::fs::write(&big, &bytes).expect("write");
    match verify_file(&big, &named) {
        Err(VerifyError::Mismatch {
            expected,
            actual,
            bytes: hashed,
            ..
        }) => {
            assert_eq!(expected, named);
            assert_eq!(actual, Sha256Digest(Sha256::digest(&bytes).into()));
            assert_eq!(hashed, bytes.len() as u64);
        }
        other => panic!("a changed byte must fail verification: {other:?}"),
    }
    assert!(matches!(
        verify_file(&dir.path().join("absent"), &named),
        Err(VerifyError::Io { .. })
    ));
}
