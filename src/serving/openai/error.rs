//! OpenAI's error shape, and the errors every endpoint answers alike.

use std::time::Duration;

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::serving::runtime::RuntimeError;

// === errors ===

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) kind: &'static str,
    pub(super) param: Option<String>,
    pub(super) code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    pub(super) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        // Both are retryable: a full queue drains, a replica that shuts down has others.
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

impl ApiError {
    pub(super) fn status(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: String,
    ) -> Self {
        ApiError {
            status,
            message,
            kind,
            param: None,
            code: Some(code),
        }
    }

    /// A runtime refusal; `param` names the request field a prompt error is about.
    pub(super) fn from_runtime(e: RuntimeError, param: &'static str) -> Self {
        match e {
            RuntimeError::PromptTooLong { .. }
            | RuntimeError::PromptOverCapacity { .. }
            | RuntimeError::EmptyPrompt => ApiError::bad(e.to_string(), Some(param)),
            RuntimeError::QueueFull { .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            RuntimeError::ShuttingDown => unavailable(e.to_string()),
            other => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: other.to_string(),
                kind: "server_error",
                param: None,
                code: None,
            },
        }
    }

    pub(super) fn model_not_found(asked: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }
}

/// The answer to a path no route serves (the fallback of the worker's router).
pub async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!(
            "Invalid URL ({method} {}): this server serves the OpenAI API (/v1/models, \
             /v1/completions, /v1/chat/completions), /health, /version, /metrics and /v1/capacity",
            uri.path()
        ),
    )
    .into_response()
}

/// The answer to a method a route does not take; its `Allow` header lists those it does.
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!(
            "{method} is not allowed on {}; the Allow header lists the methods it takes",
            uri.path()
        ),
    )
    .into_response()
}

pub(super) fn timed_out(timeout: Duration) -> ApiError {
    ApiError::status(
        StatusCode::GATEWAY_TIMEOUT,
        "timeout_error",
        "request_timeout",
        format!(
            "the request ran past the worker's request timeout of {} s and was stopped; ask for fewer tokens or raise --request-timeout-seconds",
            timeout.as_secs()
        ),
    )
}

/// OpenAI's usage object; `prompt_tokens_details.cached_tokens` are the prompt tokens whose KV
/// came from the prefix cache (as OpenAI and vLLM report them).
pub(super) fn unavailable(message: String) -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message,
        kind: "server_error",
        param: None,
        code: Some("shutting_down"),
    }
}

pub(super) fn server_error(message: String) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}
