//! The LoRA adapters of `serve --lora NAME=PATH` and `--lora-sha256 NAME=HEX`.
//!
//! An adapter's name is the OpenAI `model` a request names to use it, so it follows
//! the InferenceService's adapter name rule (the operator renders it verbatim).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::fetch::Sha256Digest;

/// One `--lora NAME=PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The model name requests use to select the adapter.
    pub name: String,
    /// The adapter GGUF.
    pub path: PathBuf,
}

/// One `--lora-sha256 NAME=HEX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedSha256 {
    /// The adapter the digest is for.
    pub name: String,
    /// Its file's SHA-256.
    pub sha256: Sha256Digest,
}

/// An adapter to load: its module and, when given, the digest to verify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraAdapter {
    /// The model name requests use to select the adapter.
    pub name: String,
    /// The adapter GGUF.
    pub path: PathBuf,
    /// The file's SHA-256, verified before loading when set.
    pub sha256: Option<Sha256Digest>,
}

/// Why `--lora`/`--lora-sha256` do not describe a set of adapters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraArgsError {
    /// `NAME=PATH` or `NAME=HEX` without the `=`, or with an empty side.
    #[error("{flag} expects NAME=VALUE, got {value:?}")]
    Syntax { flag: &'static str, value: String },
    /// A name outside lowercase letters, digits, '-' and '.'.
    #[error(
        "adapter name {0:?} must be lowercase letters, digits, '-' or '.', starting and ending with a letter or digit"
    )]
    Name(String),
    /// The digest part is not 64 hex digits.
    #[error("--lora-sha256 for {name:?}: a sha256 is 64 hex digits, got {value:?}")]
    Digest { name: String, value: String },
    /// The same adapter name twice.
    #[error("--lora names {0:?} twice")]
    DuplicateName(String),
    /// Two digests for one adapter.
    #[error("--lora-sha256 names {0:?} twice")]
    DuplicateDigest(String),
    /// A digest for a name no `--lora` gives.
    #[error("--lora-sha256 names {0:?}, which no --lora NAME=PATH gives")]
    UnknownDigest(String),
}

/// Whether `name` is a valid adapter name (the CRD's rule: a DNS-label-like word that
/// may contain dots).
#[must_use]
pub fn is_adapter_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let edge = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !bytes.is_empty()
        && edge(bytes[0])
        && edge(bytes[bytes.len() - 1])
        && bytes.iter().all(|&b| edge(b) || b == b'-' || b == b'.')
}

fn split_named<'a>(flag: &'static str, s: &'a str) -> Result<(&'a str, &'a str), LoraArgsError> {
    match s.split_once('=') {
        Some((name, value)) if !name.is_empty() && !value.is_empty() => {
            if is_adapter_name(name) {
                Ok((name, value))
            } else {
                Err(LoraArgsError::Name(name.to_owned()))
            }
        }
        _ => Err(LoraArgsError::Syntax {
            flag,
            value: s.to_owned(),
        }),
    }
}

impl FromStr for LoraModule {
    type Err = LoraArgsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, path) = split_named("--lora", s)?;
        Ok(Self {
            name: name.to_owned(),
            path: PathBuf::from(path),
        })
    }
}

impl fmt::Display for LoraModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.path.display())
    }
}

impl FromStr for NamedSha256 {
    type Err = LoraArgsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, hex) = split_named("--lora-sha256", s)?;
        let sha256 = hex.parse().map_err(|_| LoraArgsError::Digest {
            name: name.to_owned(),
            value: hex.to_owned(),
        })?;
        Ok(Self {
            name: name.to_owned(),
            sha256,
        })
    }
}

impl fmt::Display for NamedSha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.sha256)
    }
}

/// The adapters `--lora` and `--lora-sha256` describe, in the order given.
///
/// # Errors
/// A name given twice, or a digest for no adapter or twice for one.
pub fn lora_adapters(
    modules: &[LoraModule],
    digests: &[NamedSha256],
) -> Result<Vec<LoraAdapter>, LoraArgsError> {
    let mut adapters: Vec<LoraAdapter> = Vec::with_capacity(modules.len());
    for module in modules {
        if adapters.iter().any(|a| a.name == module.name) {
            return Err(LoraArgsError::DuplicateName(module.name.clone()));
        }
        adapters.push(LoraAdapter {
            name: module.name.clone(),
            path: module.path.clone(),
            sha256: None,
        });
    }
    for digest in digests {
        let adapter = adapters
            .iter_mut()
            .find(|a| a.name == digest.name)
            .ok_or_else(|| LoraArgsError::UnknownDigest(digest.name.clone()))?;
        if adapter.sha256.is_some() {
            return Err(LoraArgsError::DuplicateDigest(digest.name.clone()));
        }
        adapter.sha256 = Some(digest.sha256);
    }
    Ok(adapters)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(s: &str) -> LoraModule {
        s.parse().unwrap()
    }

    #[test]
    fn names_follow_the_crd_rule() {
        for ok in ["a", "sql-v2", "x.1", "0"] {
            assert!(is_adapter_name(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a/b", ".a"] {
            assert!(!is_adapter_name(bad), "{bad}");
        }
    }

    #[test]
    fn module_parses_and_prints_back() {
        let m = module("sql=/models/adapters/sql.gguf");
        assert_eq!(m.name, "sql");
        assert_eq!(m.path, PathBuf::from("/models/adapters/sql.gguf"));
        assert_eq!(m.to_string(), "sql=/models/adapters/sql.gguf");
        // A path may contain '='; only the first one splits.
        assert_eq!(module("a=/x=y").path, PathBuf::from("/x=y"));
        assert!(matches!(
            "sql".parse::<LoraModule>(),
            Err(LoraArgsError::Syntax { .. })
        ));
        assert!(matches!(
            "Sql=/a".parse::<LoraModule>(),
            Err(LoraArgsError::Name(_))
        ));
    }

    #[test]
    fn digests_join_their_adapters() {
        let hex = "ab".repeat(32);
        let digest: NamedSha256 = format!("sql={hex}").parse().unwrap();
        let adapters = lora_adapters(
            &[module("sql=/a"), module("chat=/b")],
            std::slice::from_ref(&digest),
        )
        .unwrap();
        assert_eq!(adapters[0].sha256.map(|d| d.to_string()), Some(hex.clone()));
        assert_eq!(adapters[1].sha256, None);
        assert_eq!(
            lora_adapters(&[module("chat=/b")], std::slice::from_ref(&digest)),
            Err(LoraArgsError::UnknownDigest("sql".into()))
        );
        assert_eq!(
            lora_adapters(&[module("sql=/a")], &[digest.clone(), digest]),
            Err(LoraArgsError::DuplicateDigest("sql".into()))
        );
        assert_eq!(
            lora_adapters(&[module("sql=/a"), module("sql=/b")], &[]),
            Err(LoraArgsError::DuplicateName("sql".into()))
        );
        assert!(matches!(
            "sql=abc".parse::<NamedSha256>(),
            Err(LoraArgsError::Digest { .. })
        ));
    }
}
