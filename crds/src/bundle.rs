//! The release-bundle hash: the identity of a release.
//!
//! The operator labels every object of a release with the short hash, starts a rollout
//! when it changes, and remembers rolled-back releases by it. So it must
//!
//! - change when anything that affects outputs or KV layout changes: everything in
//!   `spec.release` (model, tokenizer, adapters, chat template, KV namespace, engine);
//! - not change with how the spec was written: field order, omitted defaults vs. the
//!   same value written out, the order of adapters (a set, addressed by name);
//! - not change with anything outside the bundle (labels, rollout pauses, capacity).
//!
//! It is SHA-256 over a canonical JSON form of the defaulted bundle: objects with keys
//! sorted, adapters sorted by name.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::spec::ReleaseBundle;

/// Hex characters of the short hash used in labels and object names.
pub const SHORT_HASH_LEN: usize = 10;

/// The identity of a release bundle.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BundleHash(String);

impl BundleHash {
    /// The full SHA-256, 64 hex characters.
    pub fn full(&self) -> &str {
        &self.0
    }

    /// The first 10 hex characters: short enough for labels and names, long enough
    /// that two releases of one service do not collide in practice.
    pub fn short(&self) -> &str {
        &self.0[..SHORT_HASH_LEN]
    }

    /// The KV namespace a release uses when the spec leaves `kvNamespace` unset: one of
    /// its own, so no two releases ever share prefix-cache entries.
    pub fn derived_kv_namespace(&self) -> String {
        format!("release-{}", self.short())
    }
}

impl std::fmt::Display for BundleHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.short())
    }
}

/// Hashes a release bundle.
pub fn bundle_hash(release: &ReleaseBundle) -> BundleHash {
    let mut release = release.clone();
    release.adapters.sort_by(|a, b| a.name.cmp(&b.name));
    // Serializing a derived `Serialize` type into a `Value` cannot fail: every map key is
    // a string. Fall back to `Null` rather than panic; the hash would still be stable.
    let value = serde_json::to_value(&release).unwrap_or(Value::Null);
    let mut canonical = String::new();
    write_canonical(&value, &mut canonical);
    BundleHash(hex::encode(Sha256::digest(canonical.as_bytes())))
}

/// Writes JSON with object keys sorted, independent of serde_json's map ordering
/// feature (another crate in the build may turn on `preserve_order`).
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(value, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::InferenceServiceSpec;
    use proptest::prelude::*;

    const BASE: &str = r#"
release:
  model: {uri: /models/smollm2.gguf, sha256: b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}
  adapters:
    - {name: alpha, uri: /a/alpha.gguf}
    - {name: beta, uri: /a/beta.gguf}
  kvNamespace: smollm2-v1
  engine: {image: "slipway/engine:0.1.0", args: ["--max-num-seqs", "64"]}
capacity: {demand: {static: 10}, replicaGoodput: 2}
"#;

    fn spec(yaml: &str) -> InferenceServiceSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn hash(yaml: &str) -> BundleHash {
        bundle_hash(&spec(yaml).release)
    }

    #[test]
    fn short_hash_is_ten_hex_chars() {
        let h = hash(BASE);
        assert_eq!(h.short().len(), 10);
        assert!(h.full().starts_with(h.short()));
        assert!(h.short().chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(h.derived_kv_namespace(), format!("release-{}", h.short()));
    }

    #[test]
    fn stable_across_spelling() {
        let reordered = r#"
capacity: {replicaGoodput: 2, demand: {static: 10}}
release:
  engine: {args: ["--max-num-seqs", "64"], image: "slipway/engine:0.1.0", device: CUDA, maxOutputTokens: 1024}
  kvNamespace: smollm2-v1
  adapters:
    - {uri: /a/beta.gguf, name: beta}
    - {name: alpha, uri: /a/alpha.gguf}
  model: {sha256: b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53, uri: /models/smollm2.gguf}
"#;
        assert_eq!(hash(BASE), hash(reordered));
        // A JSON round trip (what the API server stores) changes nothing.
        let spec = spec(BASE);
        let json = serde_json::to_string(&spec).unwrap();
        let back: InferenceServiceSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(bundle_hash(&spec.release), bundle_hash(&back.release));
    }

    #[test]
    fn unchanged_by_fields_outside_the_bundle() {
        let mut other = spec(BASE);
        other.rollout.steps[0].pause = Some("1h".to_owned());
        other.capacity.demand.static_peak = Some(99.0);
        other.drain.pre_stop_delay_seconds = 30;
        // SLO thresholds, replicas (the capacity inputs) and pod overrides change how
        // many engines run and where, never what one answers.
        other.slo.ttft.threshold = "9s".to_owned();
        other.slo.tpot.threshold = "1s".to_owned();
        other.slo.availability = 0.5;
        other.capacity.replica_goodput = 0.25;
        other.pod_template = Some(serde_yaml::from_str("{nodeSelector: {pool: big}}").unwrap());
        assert_eq!(
            bundle_hash(&spec(BASE).release),
            bundle_hash(&other.release)
        );
    }

    #[test]
    fn changes_with_everything_inside_the_bundle() {
        let base = hash(BASE);
        let edits: [(&str, &str); 8] = [
            ("/models/smollm2.gguf", "/models/smollm2-v2.gguf"),
            ("b179c9523d0e", "0179c9523d0e"),
            ("name: beta", "name: gamma"),
            ("/a/alpha.gguf", "/a/alpha2.gguf"),
            ("smollm2-v1", "smollm2-v2"),
            ("0.1.0", "0.1.1"),
            ("\"64\"", "\"32\""),
            ("image:", "maxOutputTokens: 7, image:"),
        ];
        for (from, to) in edits {
            assert_ne!(
                base,
                hash(&BASE.replace(from, to)),
                "editing {from:?} → {to:?}"
            );
        }
        let mut with_template = spec(BASE);
        with_template.release.chat_template = Some("{{ messages }}".to_owned());
        assert_ne!(base, bundle_hash(&with_template.release));
        let mut with_tokenizer = spec(BASE);
        with_tokenizer.release.tokenizer = Some(crate::spec::ArtifactSource {
            uri: "/t.json".to_owned(),
            sha256: None,
        });
        assert_ne!(base, bundle_hash(&with_tokenizer.release));
        // The files' digests are part of their identity: the same path with other bytes
        // is another release.
        let mut other_tokenizer = with_tokenizer.clone();
        other_tokenizer.release.tokenizer.as_mut().unwrap().sha256 = Some("ab".repeat(32));
        assert_ne!(
            bundle_hash(&with_tokenizer.release),
            bundle_hash(&other_tokenizer.release)
        );
        let mut other_template = with_template.clone();
        other_template.release.chat_template = Some("{{ messages[0] }}".to_owned());
        assert_ne!(
            bundle_hash(&with_template.release),
            bundle_hash(&other_template.release)
        );
        let mut adapter_digest = spec(BASE);
        adapter_digest.release.adapters[0].sha256 = Some("cd".repeat(32));
        assert_ne!(base, bundle_hash(&adapter_digest.release));
    }

    proptest! {
        #[test]
        fn adapter_order_does_not_matter(names in proptest::collection::btree_set("[a-z]{1,8}", 1..6), seed in any::<u64>()) {
            let mut release = spec(BASE).release;
            release.adapters = names.iter().map(|n| crate::spec::Adapter {
                name: n.clone(), uri: format!("/a/{n}"), sha256: None,
            }).collect();
            let ordered = bundle_hash(&release);
            let len = release.adapters.len();
            release.adapters.rotate_left((seed as usize) % len);
            prop_assert_eq!(ordered, bundle_hash(&release));
        }

        #[test]
        fn distinct_models_hash_apart(a in "[a-z/]{1,40}", b in "[a-z/]{1,40}") {
            prop_assume!(a != b);
            let mut left = spec(BASE).release;
            let mut right = left.clone();
            left.model.uri = a;
            right.model.uri = b;
            prop_assert_ne!(bundle_hash(&left), bundle_hash(&right));
        }
    }
}
