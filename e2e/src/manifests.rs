//! Finding and reading the repository's manifests (CRDs, samples, RBAC).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

/// The repository root (this crate lives in `<root>/e2e`).
pub fn repo_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_owned()
}

/// `manifests/crds/`: the generated CustomResourceDefinitions, unless
/// `SLIPWAY_E2E_CRDS_DIR` names another directory (to try a candidate CRD on
/// the real API server before regenerating the checked-in one).
pub fn crds_dir() -> PathBuf {
    std::env::var_os("SLIPWAY_E2E_CRDS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("manifests").join("crds"))
}

/// `manifests/samples/`: example objects that must always be accepted.
pub fn samples_dir() -> PathBuf {
    repo_root().join("manifests").join("samples")
}

/// `manifests/rbac/`: the operator's ServiceAccount, roles and bindings.
pub fn rbac_dir() -> PathBuf {
    repo_root().join("manifests").join("rbac")
}

/// The `*.yaml` / `*.yml` files directly in `dir`, sorted by name.
///
/// # Errors
/// When `dir` cannot be listed.
pub fn yaml_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let io_error = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error)? {
        let path = entry.map_err(io_error)?.path();
        let is_yaml = path
            .extension()
            .is_some_and(|extension| extension == "yaml" || extension == "yml");
        if is_yaml && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Every non-empty YAML document of a (possibly multi-document) file, as JSON.
///
/// # Errors
/// When the file cannot be read or a document is not valid YAML.
pub fn load_documents(path: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_documents(&text).map_err(|reason| Error::Manifest {
        path: path.to_owned(),
        reason,
    })
}

fn parse_documents(text: &str) -> std::result::Result<Vec<serde_json::Value>, String> {
    let mut documents = Vec::new();
    for document in serde_yaml::Deserializer::from_str(text) {
        let value = serde_json::Value::deserialize(document).map_err(|error| error.to_string())?;
        // `---` at the end of a file, or between comments, yields a null document.
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

/// Every document of every YAML file in `dir`, with the file it came from.
///
/// # Errors
/// As [`yaml_files`] and [`load_documents`].
pub fn load_dir(dir: &Path) -> Result<Vec<(PathBuf, serde_json::Value)>> {
    let mut all = Vec::new();
    for file in yaml_files(dir)? {
        for document in load_documents(&file)? {
            all.push((file.clone(), document));
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_document_yaml_skips_empty_documents() {
        let documents = parse_documents("---\n# only a comment\n---\na: 1\n---\nb: [x]\n---\n")
            .expect("valid YAML parses");
        assert_eq!(
            documents,
            vec![serde_json::json!({"a": 1}), serde_json::json!({"b": ["x"]})]
        );
    }

    #[test]
    fn repo_root_holds_the_e2e_crate() {
        assert!(repo_root().join("e2e").join("Cargo.toml").is_file());
    }
}
