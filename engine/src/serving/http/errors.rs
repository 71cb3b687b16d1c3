//! [`ApiError`]: every failure of the API as one status and an OpenAI-style body
//! (`{"error": {"message", "type", "param", "code"}}`), with `Retry-After` on 429
//! and 503. Malformed JSON and oversized bodies map here too, never to axum's
//! default plain-text rejections. A request that fails mid-stream sends the same
//! body as its last SSE event ([`ApiError::body`]).

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::MAX_BODY_BYTES;
use crate::serving::admission::{Rejection, retry_secs};
use crate::serving::engine::RequestError;

/// Every failure of the API, as a status and an OpenAI-style error body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something unsupported (400).
    #[error("{message}")]
    BadRequest {
        /// What is wrong, for a person.
        message: String,
        /// The offending field, if one.
        param: Option<String>,
    },
    /// The body is over [`MAX_BODY_BYTES`] (413).
    #[error("request body is larger than {MAX_BODY_BYTES} bytes")]
    TooLarge,
    /// No such route on this port (404).
    #[error("no such endpoint: {0}")]
    NoRoute(String),
    /// The model named is not served here (404); the names that are.
    #[error("model `{model}` does not exist; this server serves {}", served.join(", "))]
    UnknownModel {
        /// The name the request gave.
        model: String,
        /// The base model's and the LoRA adapters' names.
        served: Vec<String>,
    },
    /// The tenant is over its token rate (429, with Retry-After).
    #[error("{message}")]
    RateLimited {
        /// Why.
        message: String,
        /// Seconds until a retry can pass.
        retry_after: u64,
    },
    /// Overloaded, draining or shut down (503, with Retry-After).
    #[error("{message}")]
    Unavailable {
        /// Why.
        message: String,
        /// Seconds until a retry may pass.
        retry_after: u64,
    },
    /// The server failed the request (500).
    #[error("{0}")]
    Internal(String),
    /// The engine ended an accepted request: shut down or aborted (503, with
    /// Retry-After), or its forward step failed (500).
    #[error("{0}")]
    Failed(#[from] RequestError),
}

/// `Retry-After` while draining: this replica will not come back; another will.
pub const DRAIN_RETRY_AFTER_SECS: u64 = 5;

/// `Retry-After` of a request the engine ended by shutting down or aborting it.
pub const FAILED_RETRY_AFTER_SECS: u64 = 1;

impl ApiError {
    /// A 400 with an optional offending field.
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: param.map(Into::into),
        }
    }

    /// A 503 with `Retry-After`.
    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> Self {
        Self::Unavailable {
            message: message.into(),
            retry_after,
        }
    }

    /// The HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnknownModel { .. } | Self::NoRoute(_) => StatusCode::NOT_FOUND,
            Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) | Self::Failed(RequestError::Backend(_)) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::Failed(RequestError::Shutdown | RequestError::Aborted(_)) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// Seconds a client should wait before retrying, where a retry may pass.
    #[must_use]
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            Self::RateLimited { retry_after, .. } | Self::Unavailable { retry_after, .. } => {
                Some(*retry_after)
            }
            Self::Failed(RequestError::Shutdown | RequestError::Aborted(_)) => {
                Some(FAILED_RETRY_AFTER_SECS)
            }
            _ => None,
        }
    }

    /// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
    #[must_use]
    pub fn body(&self) -> Value {
        let (kind, code, param) = match self {
            Self::BadRequest { param, .. } => ("invalid_request_error", None, param.clone()),
            Self::TooLarge => ("invalid_request_error", Some("body_too_large"), None),
            Self::UnknownModel { .. } => ("invalid_request_error", Some("model_not_found"), None),
            Self::NoRoute(_) => ("invalid_request_error", Some("not_found"), None),
            Self::RateLimited { .. } => ("rate_limit_error", Some("rate_limit_exceeded"), None),
            Self::Unavailable { .. } => ("service_unavailable", Some("unavailable"), None),
            Self::Internal(_) => ("server_error", Some("internal_error"), None),
            Self::Failed(RequestError::Shutdown) => {
                ("service_unavailable", Some("engine_shutdown"), None)
            }
            Self::Failed(RequestError::Aborted(_)) => {
                ("service_unavailable", Some("request_aborted"), None)
            }
            Self::Failed(RequestError::Backend(_)) => ("server_error", Some("engine_error"), None),
        };
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}})
    }
}

impl From<Rejection> for ApiError {
    fn from(r: Rejection) -> Self {
        let message = r.to_string();
        match (&r, r.retry_after()) {
            (Rejection::TenantRate { .. }, Some(d)) => Self::RateLimited {
                message,
                retry_after: retry_secs(d),
            },
            (_, Some(d)) => Self::Unavailable {
                message,
                retry_after: retry_secs(d),
            },
            (_, None) => Self::bad(message, Some("max_tokens")),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), Json(self.body())).into_response();
        if let Some(secs) = self.retry_after() {
            r.headers_mut()
                .insert("retry-after", HeaderValue::from(secs));
        }
        r
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::BytesRejection(_) => Self::TooLarge,
            JsonRejection::MissingJsonContentType(_) => Self::bad(
                "expected a JSON body with `Content-Type: application/json`",
                None,
            ),
            other => Self::bad(format!("invalid JSON body: {}", other.body_text()), None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Status, `Retry-After` and the body's type and code of a failed request.
    fn mapped(e: RequestError) -> (StatusCode, Option<String>, Value) {
        let r = ApiError::from(e.clone()).into_response();
        let retry = r
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = ApiError::from(e).body();
        (r.status(), retry, body)
    }

    #[test]
    fn shutdown_and_abort_are_503s_with_retry_after_and_a_backend_failure_is_a_500() {
        let one = Some(FAILED_RETRY_AFTER_SECS.to_string());
        let (status, retry, body) = mapped(RequestError::Shutdown);
        assert_eq!(
            (status, retry),
            (StatusCode::SERVICE_UNAVAILABLE, one.clone())
        );
        assert_eq!(body["error"]["type"], "service_unavailable");
        assert_eq!(body["error"]["code"], "engine_shutdown");
        assert_eq!(body["error"]["message"], "the engine shut down");

        let (status, retry, body) = mapped(RequestError::Aborted("budget over".into()));
        assert_eq!((status, retry), (StatusCode::SERVICE_UNAVAILABLE, one));
        assert_eq!(body["error"]["type"], "service_unavailable");
        assert_eq!(body["error"]["code"], "request_aborted");
        assert_eq!(body["error"]["message"], "budget over");

        let (status, retry, body) = mapped(RequestError::Backend("kernel failed".into()));
        assert_eq!((status, retry), (StatusCode::INTERNAL_SERVER_ERROR, None));
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(body["error"]["code"], "engine_error");
        assert_eq!(body["error"]["message"], "engine error: kernel failed");
        assert!(body["error"]["param"].is_null());
    }

    #[test]
    fn only_429_and_503_carry_retry_after() {
        assert_eq!(ApiError::unavailable("x", 5).retry_after(), Some(5));
        let limited = ApiError::RateLimited {
            message: "x".into(),
            retry_after: 3,
        };
        assert_eq!(limited.retry_after(), Some(3));
        assert_eq!(ApiError::Internal("x".into()).retry_after(), None);
        assert_eq!(ApiError::bad("x", None).retry_after(), None);
    }
}
