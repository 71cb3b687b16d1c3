//! Where the engine finds the model, and what stages it there: read once from the
//! release's model URI, so a URI the operator cannot stage is an invalid spec before
//! any pod is rendered.

/// Where the model volume is mounted in the engine container.
pub(crate) const MODEL_DIR: &str = "/models";

/// Where the engine finds the model, and what stages it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelStaging {
    /// A path inside the image (or a volume the user mounts by other means).
    Path(String),
    /// `pvc://<claim>/<path>`: the claim is mounted read-only.
    Claim { claim: String, path: String },
    /// `https://…`: an init container fetches and verifies it into an emptyDir.
    Fetch {
        url: String,
        sha256: slipway_contract::Sha256Digest,
    },
}

impl ModelStaging {
    /// Reads a model URI.
    ///
    /// # Errors
    /// A sentence for the `Ready=False` condition when the URI has no usable form.
    pub fn parse(uri: &str, sha256: Option<&str>) -> Result<Self, String> {
        if let Some(rest) = uri.strip_prefix("pvc://") {
            return match rest.split_once('/') {
                Some((claim, path)) if !claim.is_empty() && !path.is_empty() => Ok(Self::Claim {
                    claim: claim.to_owned(),
                    path: path.to_owned(),
                }),
                _ => Err(format!("model uri {uri:?}: expected pvc://<claim>/<path>")),
            };
        }
        if uri.starts_with("https://") || uri.starts_with("http://") {
            let sha256 = sha256.ok_or_else(|| {
                format!("model uri {uri:?} is fetched over the network, so release.model.sha256 is required to verify it")
            })?;
            return Ok(Self::Fetch {
                url: uri.to_owned(),
                sha256: sha256
                    .parse()
                    .map_err(|e| format!("release.model.sha256: {e}"))?,
            });
        }
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        if path.starts_with('/') {
            Ok(Self::Path(path.to_owned()))
        } else {
            Err(format!(
                "model uri {uri:?}: expected an absolute path, file://, pvc:// or https://"
            ))
        }
    }

    /// The path the engine opens.
    pub fn engine_path(&self) -> String {
        match self {
            Self::Path(path) => path.clone(),
            Self::Claim { path, .. } => format!("{MODEL_DIR}/{path}"),
            Self::Fetch { .. } => format!("{MODEL_DIR}/model.gguf"),
        }
    }
}
