//! Where the engine finds the release bundle's files (model, tokenizer, adapters), and
//! what stages each there: read once from the release's URIs, so a URI the operator
//! cannot stage is an invalid spec before any pod is rendered.

use slipway_api::spec::ReleaseBundle;
use slipway_contract::Sha256Digest;

use crate::spec_error::SpecError;

/// Where the model volume is mounted in the engine container.
pub(crate) const MODEL_DIR: &str = "/models";
/// Where the other bundle files' volumes are mounted, one directory each.
const BUNDLE_DIR: &str = "/bundle";

/// How one file reaches the engine container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A path inside the image (or a volume the user mounts by other means).
    Path(String),
    /// `pvc://<claim>/<path>`: the claim is mounted read-only.
    Claim { claim: String, path: String },
    /// `https://…`: an init container fetches and verifies it into an emptyDir.
    Fetch { url: String, sha256: Sha256Digest },
}

impl Source {
    /// Reads the URI of the field `field` (for the error message).
    ///
    /// # Errors
    /// [`SpecError`] naming the field when the URI has no usable form, or a fetched
    /// file has no valid sha256.
    pub fn parse(field: &str, uri: &str, sha256: Option<&str>) -> Result<Self, SpecError> {
        let bad_uri = |expected| SpecError::ArtifactUri {
            field: field.to_owned(),
            uri: uri.to_owned(),
            expected,
        };
        if let Some(rest) = uri.strip_prefix("pvc://") {
            return match rest.split_once('/') {
                Some((claim, path)) if !claim.is_empty() && !path.is_empty() => Ok(Self::Claim {
                    claim: claim.to_owned(),
                    path: path.to_owned(),
                }),
                _ => Err(bad_uri("pvc://<claim>/<path>")),
            };
        }
        if uri.starts_with("https://") || uri.starts_with("http://") {
            let sha256 = sha256.ok_or_else(|| SpecError::ArtifactSha256Missing {
                field: field.to_owned(),
                uri: uri.to_owned(),
            })?;
            return Ok(Self::Fetch {
                url: uri.to_owned(),
                sha256: sha256
                    .parse()
                    .map_err(|error| SpecError::ArtifactSha256Invalid {
                        field: field.to_owned(),
                        error,
                    })?,
            });
        }
        let path = uri.strip_prefix("file://").unwrap_or(uri);
        if path.starts_with('/') {
            Ok(Self::Path(path.to_owned()))
        } else {
            Err(bad_uri("an absolute path, file://, pvc:// or https://"))
        }
    }
}

/// One file of the bundle: its source and, when it needs one, the pod volume that
/// holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub source: Source,
    /// The volume's name (a DNS label, unique in the pod); unused for `Path`.
    pub volume: String,
    /// Where the volume is mounted in the engine container.
    pub dir: String,
    /// The file name a fetch writes in `dir`.
    pub fetched_file: &'static str,
}

impl Artifact {
    /// The path the engine opens.
    pub fn engine_path(&self) -> String {
        match &self.source {
            Source::Path(path) => path.clone(),
            Source::Claim { path, .. } => format!("{}/{path}", self.dir),
            Source::Fetch { .. } => format!("{}/{}", self.dir, self.fetched_file),
        }
    }
}

/// Every file of a release bundle the engine opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BundleStaging {
    pub model: Artifact,
    pub tokenizer: Option<Artifact>,
    /// `(adapter name, file)`, in the spec's order.
    pub adapters: Vec<(String, Artifact)>,
}

impl BundleStaging {
    /// Reads the release's URIs.
    ///
    /// # Errors
    /// [`SpecError`] naming the first unusable URI.
    pub fn parse(release: &ReleaseBundle) -> Result<Self, SpecError> {
        let model = Artifact {
            source: Source::parse(
                "release.model",
                &release.model.uri,
                release.model.sha256.as_deref(),
            )?,
            volume: "model".to_owned(),
            dir: MODEL_DIR.to_owned(),
            fetched_file: "model.gguf",
        };
        let tokenizer = release
            .tokenizer
            .as_ref()
            .map(|t| {
                Ok::<_, SpecError>(Artifact {
                    source: Source::parse("release.tokenizer", &t.uri, t.sha256.as_deref())?,
                    volume: "tokenizer".to_owned(),
                    dir: format!("{BUNDLE_DIR}/tokenizer"),
                    fetched_file: "tokenizer.json",
                })
            })
            .transpose()?;
        let adapters = release
            .adapters
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let field = format!("release.adapters[{i}]");
                Ok((
                    a.name.clone(),
                    Artifact {
                        source: Source::parse(&field, &a.uri, a.sha256.as_deref())?,
                        // Adapter names may hold dots, which volume names may not.
                        volume: format!("adapter-{i}"),
                        dir: format!("{BUNDLE_DIR}/adapters/{}", a.name),
                        fetched_file: "adapter.gguf",
                    },
                ))
            })
            .collect::<Result<_, SpecError>>()?;
        Ok(Self {
            model,
            tokenizer,
            adapters,
        })
    }

    /// Every artifact with the name of what it is (`model`, `tokenizer`,
    /// `adapter-<i>`), model first.
    pub fn artifacts(&self) -> impl Iterator<Item = &Artifact> {
        std::iter::once(&self.model)
            .chain(&self.tokenizer)
            .chain(self.adapters.iter().map(|(_, a)| a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn release(extra: &str) -> ReleaseBundle {
        serde_yaml::from_str(&format!(
            "model: {{uri: /models/m.gguf}}\nengine: {{image: e:1}}\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn each_artifact_gets_its_own_volume_and_path() {
        let hex = "ab".repeat(32);
        let staging = BundleStaging::parse(&release(&format!(
            "tokenizer: {{uri: 'https://h/t.json', sha256: {hex}}}\nadapters:\n- {{name: sql.v2, uri: 'pvc://loras/sql/a.gguf'}}\n- {{name: chat, uri: /opt/chat.gguf}}\n"
        )))
        .unwrap();
        assert_eq!(staging.model.engine_path(), "/models/m.gguf");
        let tokenizer = staging.tokenizer.as_ref().unwrap();
        assert_eq!(tokenizer.engine_path(), "/bundle/tokenizer/tokenizer.json");
        let (name, sql) = &staging.adapters[0];
        assert_eq!(name, "sql.v2");
        assert_eq!(sql.volume, "adapter-0");
        assert_eq!(sql.engine_path(), "/bundle/adapters/sql.v2/sql/a.gguf");
        assert_eq!(staging.adapters[1].1.engine_path(), "/opt/chat.gguf");
        let volumes: Vec<_> = staging.artifacts().map(|a| a.volume.as_str()).collect();
        assert_eq!(volumes, ["model", "tokenizer", "adapter-0", "adapter-1"]);
    }

    #[test]
    fn a_fetched_artifact_needs_its_digest_and_names_its_field() {
        let err = BundleStaging::parse(&release(
            "adapters:\n- {name: a, uri: /a.gguf}\n- {name: b, uri: 'https://h/b.gguf'}\n",
        ))
        .unwrap_err();
        assert_eq!(err.reason(), "ArtifactSha256Missing");
        assert!(
            err.to_string()
                .contains("release.adapters[1].sha256 is required"),
            "{err}"
        );
        let err = BundleStaging::parse(&release("tokenizer: {uri: relative.json}\n")).unwrap_err();
        assert_eq!(err.reason(), "ArtifactUriInvalid");
        assert!(
            err.to_string().starts_with("release.tokenizer.uri"),
            "{err}"
        );
        let err = BundleStaging::parse(&release(
            "tokenizer: {uri: 'https://h/t.json', sha256: abc}\n",
        ))
        .unwrap_err();
        assert_eq!(err.reason(), "ArtifactSha256Invalid");
        assert!(
            err.to_string().starts_with("release.tokenizer.sha256: "),
            "{err}"
        );
    }
}
