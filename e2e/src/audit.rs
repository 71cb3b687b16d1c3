//! Reading the API server's audit log (`--audit-log-path`, JSON lines), to see
//! which requests of an identity were denied: the evidence an RBAC test needs
//! ("the operator never got a 403") and the first thing to read when it did.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::wait;

/// One audit event, reduced to the fields the tests read.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    pub stage: String,
    pub verb: String,
    #[serde(rename = "requestURI")]
    pub request_uri: String,
    pub user: AuditUser,
    #[serde(default)]
    pub object_ref: Option<AuditObjectRef>,
    #[serde(default)]
    pub response_status: Option<AuditResponseStatus>,
}

/// Who made the request.
#[derive(Debug, Clone, Deserialize)]
pub struct AuditUser {
    #[serde(default)]
    pub username: String,
}

/// What the request was about.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditObjectRef {
    #[serde(default)]
    pub resource: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub api_group: Option<String>,
}

/// How the request ended.
#[derive(Debug, Clone, Deserialize)]
pub struct AuditResponseStatus {
    #[serde(default)]
    pub code: Option<u16>,
}

impl AuditEvent {
    /// The HTTP status the API server answered with, once the response is known.
    pub fn code(&self) -> Option<u16> {
        self.response_status.as_ref().and_then(|status| status.code)
    }
}

/// All events in the audit log. Lines that are not complete JSON (the API
/// server may be writing the last one right now) are skipped.
///
/// # Errors
/// When the log cannot be read.
pub fn read_events(audit_log: &Path) -> Result<Vec<AuditEvent>> {
    let text = std::fs::read_to_string(audit_log).map_err(|source| Error::Io {
        path: audit_log.to_owned(),
        source,
    })?;
    Ok(parse_events(&text))
}

fn parse_events(text: &str) -> Vec<AuditEvent> {
    text.lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// The requests of `username` that the API server answered with 403 Forbidden.
///
/// # Errors
/// When the log cannot be read.
pub fn forbidden_requests(audit_log: &Path, username: &str) -> Result<Vec<AuditEvent>> {
    Ok(read_events(audit_log)?
        .into_iter()
        .filter(|event| event.user.username == username && event.code() == Some(403))
        .collect())
}

/// Wait until the audit log shows at least one 403 for `username`.
///
/// # Errors
/// [`Error::Timeout`] when none appears within `timeout`.
pub async fn wait_for_forbidden(
    audit_log: &Path,
    username: &str,
    timeout: Duration,
) -> Result<Vec<AuditEvent>> {
    wait::poll(
        &format!("a 403 for {username} in {}", audit_log.display()),
        timeout,
        || async {
            let denied = forbidden_requests(audit_log, username)?;
            Ok((!denied.is_empty()).then_some(denied))
        },
        || "no such event".to_owned(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_forbidden_events_and_skips_partial_lines() {
        let log = concat!(
            r#"{"kind":"Event","stage":"ResponseComplete","verb":"list","requestURI":"/api/v1/secrets","user":{"username":"system:serviceaccount:ns:op"},"objectRef":{"resource":"secrets","apiVersion":"v1"},"responseStatus":{"metadata":{},"status":"Failure","reason":"Forbidden","code":403}}"#,
            "\n",
            r#"{"kind":"Event","stage":"ResponseComplete","verb":"get","requestURI":"/api","user":{"username":"admin"},"responseStatus":{"code":200}}"#,
            "\n",
            r#"{"kind":"Event","stage":"Resp"#,
        );
        let events = parse_events(log);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].code(), Some(403));
        assert_eq!(
            events[0]
                .object_ref
                .as_ref()
                .and_then(|o| o.resource.as_deref()),
            Some("secrets")
        );
        assert_eq!(events[1].user.username, "admin");
    }
}
