//! [`ApiError`]: every failure of the API as one status and an OpenAI-style body
//! (`{"error": {"message", "type", "param", "code"}}`), with `Retry-After` on 429
//! and 503. Malformed JSON and oversized bodies map here too, never to axum's
//! default plain-text rejections.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::MAX_BODY_BYTES;
use crate::serving::admission::{Rejection, retry_secs};

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
}

/// `Retry-After` while draining: this replica will not come back; another will.
pub const DRAIN_RETRY_AFTER_SECS: u64 = 5;

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
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
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
        let (kind, code, param) = match &self {
            Self::BadRequest { param, .. } => ("invalid_request_error", None, param.clone()),
            Self::TooLarge => ("invalid_request_error", Some("body_too_large"), None),
            Self::UnknownModel { .. } => ("invalid_request_error", Some("model_not_found"), None),
            Self::NoRoute(_) => ("invalid_request_error", Some("not_found"), None),
            Self::RateLimited { .. } => ("rate_limit_error", Some("rate_limit_exceeded"), None),
            Self::Unavailable { .. } => ("service_unavailable", Some("unavailable"), None),
            Self::Internal(_) => ("server_error", Some("internal_error"), None),
        };
        let body = json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}});
        let mut r = (self.status(), Json(body)).into_response();
        if let Self::RateLimited { retry_after, .. } | Self::Unavailable { retry_after, .. } = self
        {
            r.headers_mut()
                .insert("retry-after", HeaderValue::from(retry_after));
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
