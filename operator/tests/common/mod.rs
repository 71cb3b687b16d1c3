//! Helpers shared by the operator's fixture-table tests (`mod common;` in each).

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The repository root (fixtures name samples by their path from it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// JSON merge patch (RFC 7386): objects merge by key, `null` removes, anything else
/// replaces. Fixtures describe an object as a sample plus such a patch.
pub fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(target), Value::Object(patch)) => {
            for (key, value) in patch {
                if value.is_null() {
                    target.remove(key);
                } else {
                    merge(target.entry(key.clone()).or_insert(Value::Null), value);
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}
