//! AdmissionReview in, AdmissionReview out: the whole admission decision as a plain
//! function of the request body and the cluster facts (no I/O, no clock, no globals).
//!
//! The HTTP handler only measures and serialises; everything a test wants to check about
//! an answer is decided here.
//!
//! A review is read straight into the few typed fields the decision needs, never into a
//! `serde_json::Value` or a `DynamicObject` of the whole body: the envelope and the request
//! keep `object` and `oldObject` as borrowed slices of the body (no copy), and an object
//! that is ours is read into its spec through [`crate::api::bounded`], which stops every
//! list and map at the CRD schema's bound as it reads (the rest is skipped, counted, and
//! named in the denial). What a review costs in memory is thus the body plus a spec within
//! the schema's bounds, whatever the body claims (docs/webhook.md).

use std::panic::{catch_unwind, AssertUnwindSafe};

use kube::core::admission::{AdmissionResponse, AdmissionReview, Operation};
use kube::core::response::{StatusCause, StatusDetails};
use kube::core::{DynamicObject, Status};
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::api::bounded::{self, Excess, Shape};
use crate::api::{InferenceDeploymentSpec, GROUP, KIND};
use crate::validate::{self, bounds, ClusterFacts, Verdict};

/// `admission.k8s.io/v1`, the only AdmissionReview version we register for.
pub const REVIEW_API_VERSION: &str = "admission.k8s.io/v1";

/// How a request was answered; the `result` label of the request counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted (possibly with warnings).
    Allowed,
    /// Denied by the compatibility rules.
    Denied,
    /// The body or the object in it could not be read.
    Invalid,
    /// The node cache has not synced yet.
    NotReady,
    /// Not ours to judge (other kinds, DELETE, subresources, unchanged specs).
    Skipped,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::Invalid => "invalid",
            Outcome::NotReady => "not_ready",
            Outcome::Skipped => "skipped",
        }
    }
}

/// A response plus what the metrics need to know about it.
#[derive(Clone, Debug)]
pub struct Reviewed {
    pub review: AdmissionReview<DynamicObject>,
    /// `CREATE`, `UPDATE`, `DELETE`, `CONNECT` or `unknown` when the body did not parse.
    pub operation: &'static str,
    pub outcome: Outcome,
}

/// Answers one AdmissionReview body. Never panics: a body that cannot be read is denied
/// with the parse error, echoing the request uid when one can be found.
pub fn review(body: &[u8], facts: &ClusterFacts) -> AdmissionReview<DynamicObject> {
    review_detailed(body, facts).review
}

/// [`review`], also telling the operation and outcome.
pub fn review_detailed(body: &[u8], facts: &ClusterFacts) -> Reviewed {
    review_with(body, facts, validate::validate)
}

/// [`review_detailed`] with another decision function in place of
/// [`validate::validate`] (tests drive every kind of verdict through it).
pub fn review_with<V>(body: &[u8], facts: &ClusterFacts, validator: V) -> Reviewed
where
    V: Fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict,
{
    let request = match parse_request(body) {
        Ok(request) => request,
        Err((uid, message)) => return invalid(uid, &message),
    };
    let operation = operation_label(&request.operation);
    let (response, outcome) = decide(&request, facts, &validator);
    Reviewed {
        review: finish(response),
        operation,
        outcome,
    }
}

/// The answer while the node cache is still syncing: denied with a clear reason (the
/// readiness probe is false meanwhile, so this only happens right after start).
pub fn not_ready(body: &[u8]) -> Reviewed {
    let (uid, operation) = match parse_request(body) {
        Ok(request) => (request.uid.clone(), operation_label(&request.operation)),
        Err((uid, _)) => (uid, "unknown"),
    };
    let mut response = AdmissionResponse::invalid("");
    response.uid = uid;
    response.result = Status::failure(
        "kvfleet webhook is not ready: the GPU node cache has not synced with the API server yet; \
         retry in a few seconds (kubectl -n <namespace> logs deploy/kvfleet-webhook shows why)",
        "ServiceUnavailable",
    )
    .with_code(503);
    Reviewed {
        review: finish(response),
        operation,
        outcome: Outcome::NotReady,
    }
}

// === parsing ===

type ParseError = (String, String);

/// The review around the request.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope<'a> {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default, borrow)]
    request: Option<&'a RawValue>,
}

/// What the decision needs of an AdmissionRequest; the object and the old object stay
/// unread until the kind says they are ours.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request<'a> {
    uid: String,
    kind: RequestKind,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: String,
    operation: Operation,
    #[serde(default, borrow)]
    object: Option<&'a RawValue>,
    #[serde(default, borrow)]
    old_object: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RequestKind {
    #[serde(default)]
    group: String,
    kind: String,
}

/// An InferenceDeployment as the decision reads it.
#[derive(Deserialize)]
struct Object {
    #[serde(default)]
    metadata: Metadata,
    #[serde(default)]
    spec: Option<InferenceDeploymentSpec>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Metadata {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    generate_name: Option<String>,
    #[serde(default)]
    deletion_timestamp: Option<IgnoredAny>,
}

/// Just the uid, to echo it when the rest of a request cannot be read.
#[derive(Deserialize)]
struct UidOnly {
    #[serde(default)]
    uid: Option<String>,
}

#[derive(Deserialize)]
struct RequestUidOnly {
    #[serde(default)]
    request: Option<UidOnly>,
}

fn parse_request(body: &[u8]) -> Result<Request<'_>, ParseError> {
    let envelope: Envelope = serde_json::from_slice(body).map_err(|error| {
        let uid = serde_json::from_slice::<RequestUidOnly>(body)
            .ok()
            .and_then(|r| r.request?.uid)
            .unwrap_or_else(|| scan_uid(body));
        let message = if error.is_data() {
            format!("malformed AdmissionReview: {error}")
        } else {
            format!("the request body is not JSON ({error}); expected an admission.k8s.io/v1 AdmissionReview")
        };
        (uid, message)
    })?;
    let uid_of = |raw: Option<&RawValue>| {
        raw.and_then(|r| serde_json::from_str::<UidOnly>(r.get()).ok())
            .and_then(|r| r.uid)
            .unwrap_or_default()
    };
    let types = (envelope.api_version.as_deref(), envelope.kind.as_deref());
    if types != (Some(REVIEW_API_VERSION), Some("AdmissionReview")) {
        return Err((
            uid_of(envelope.request),
            format!(
                "expected apiVersion {REVIEW_API_VERSION} and kind AdmissionReview, got {} {}; \
                 register the webhook with admissionReviewVersions: [v1]",
                types.0.unwrap_or("(none)"),
                types.1.unwrap_or("(none)")
            ),
        ));
    }
    let Some(raw) = envelope.request else {
        return Err((String::new(), "the AdmissionReview has no request".to_string()));
    };
    let request: Request = serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(
        raw.get(),
    ))
    .map_err(|error| {
        (
            uid_of(Some(raw)),
            format!(
                "malformed AdmissionReview at request.{}: {}",
                error.path(),
                error.inner()
            ),
        )
    })?;
    if request.uid.is_empty() {
        return Err((
            String::new(),
            "the AdmissionReview request has no uid".to_string(),
        ));
    }
    Ok(request)
}

/// Reads an object within the schema's bounds: the object, and every bound it broke.
fn read_object(raw: &RawValue) -> Result<(Object, Vec<Excess>), String> {
    let mut json = serde_json::Deserializer::from_str(raw.get());
    let mut track = serde_path_to_error::Track::new();
    let tracked = serde_path_to_error::Deserializer::new(&mut json, &mut track);
    bounded::read::<Object, _>(tracked, Shape::object(), "").map_err(|error| {
        let path = track.path().to_string();
        if path.is_empty() || path == "." {
            format!("the object cannot be read: {error}")
        } else {
            format!("{path}: {error}")
        }
    })
}

/// Finds `"uid":"..."` in a body that is not valid JSON (truncated, say), so that the
/// denial still correlates with the request. Only UID-shaped values are taken.
fn scan_uid(body: &[u8]) -> String {
    const KEY: &[u8] = b"\"uid\"";
    let Some(start) = body.windows(KEY.len()).position(|w| w == KEY) else {
        return String::new();
    };
    let rest = &body[start + KEY.len()..];
    let rest = trim_start(rest);
    let Some(rest) = rest.strip_prefix(b":") else {
        return String::new();
    };
    let Some(rest) = trim_start(rest).strip_prefix(b"\"") else {
        return String::new();
    };
    let Some(end) = rest.iter().position(|&b| b == b'"') else {
        return String::new();
    };
    let uid = &rest[..end];
    if !uid.is_empty() && uid.len() <= 128 && uid.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'-') {
        String::from_utf8_lossy(uid).into_owned()
    } else {
        String::new()
    }
}

fn trim_start(bytes: &[u8]) -> &[u8] {
    let skip = bytes.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &bytes[skip..]
}

fn operation_label(operation: &Operation) -> &'static str {
    match operation {
        Operation::Create => "CREATE",
        Operation::Update => "UPDATE",
        Operation::Delete => "DELETE",
        Operation::Connect => "CONNECT",
    }
}

// === deciding ===

fn decide<V>(request: &Request, facts: &ClusterFacts, validator: &V) -> (AdmissionResponse, Outcome)
where
    V: Fn(&InferenceDeploymentSpec, &ClusterFacts) -> Verdict,
{
    let mut allow = AdmissionResponse::invalid("");
    allow.uid = request.uid.clone();
    allow.allowed = true;
    allow.result = Status::default();
    let ours = request.kind.group == GROUP && request.kind.kind == KIND;
    // Subresources (status, scale) carry no spec change we judge; DELETE and CONNECT
    // must never be blocked by compatibility (a deployment must always be removable).
    if !ours
        || request.sub_resource.is_some()
        || !matches!(request.operation, Operation::Create | Operation::Update)
    {
        return (allow, Outcome::Skipped);
    }
    let Some(raw) = request.object else {
        return deny_invalid(allow, "the request has no object to validate");
    };
    let (object, excess) = match read_object(raw) {
        Ok(read) => read,
        Err(message) => return deny_invalid(allow, &message),
    };
    let name = object_name(request, &object);
    if !excess.is_empty() {
        // Lists over their bound were cut while reading: the spec read is not the one sent,
        // so only its bounds are judged, every one of them.
        let verdict = Verdict {
            denials: out_of_bounds(object.spec.as_ref(), &excess),
            ..Verdict::default()
        };
        return answer(allow, &verdict, &name);
    }
    let Some(spec) = object.spec else {
        return deny_invalid(allow, "the InferenceDeployment has no spec");
    };
    if request.operation == Operation::Update {
        // A deployment being deleted, or an update that leaves the spec as it was
        // (finalizers, labels, annotations), is always admitted: otherwise a change in
        // the cluster could make a deployment impossible to finalize.
        if object.metadata.deletion_timestamp.is_some() {
            return (allow, Outcome::Skipped);
        }
        if let Some(Ok((old, old_excess))) = request.old_object.map(read_object) {
            if old_excess.is_empty() && old.spec.as_ref() == Some(&spec) {
                return (allow, Outcome::Skipped);
            }
        }
    }
    let verdict = match catch_unwind(AssertUnwindSafe(|| validator(&spec, facts))) {
        Ok(verdict) => verdict,
        Err(_) => {
            let mut response = allow.deny("");
            response.result = Status::failure(
                "kvfleet could not validate this object (internal error in the compatibility rules); \
                 this is a bug: please report it with the object",
                "InternalError",
            )
            .with_code(500);
            return (response, Outcome::Invalid);
        }
    };
    answer(allow, &verdict, &name)
}

/// The denials of an object read over its bounds: what the reader cut, then what the
/// bounds of the spec as read (lists at their bound) still find.
fn out_of_bounds(spec: Option<&InferenceDeploymentSpec>, excess: &[Excess]) -> Vec<validate::Denial> {
    let mut denials: Vec<validate::Denial> = excess.iter().map(bounds::excess_denial).collect();
    if let Some(spec) = spec {
        for d in bounds::check(spec) {
            if !denials.iter().any(|e| e.field == d.field) {
                denials.push(d);
            }
        }
    }
    denials
}

/// The name kubectl prints in "The InferenceDeployment \"NAME\" is invalid": the request's
/// (set on UPDATE and on a CREATE that names the object), else the object's, else its
/// `generateName` prefix (the API server names such objects only after admission).
fn object_name(request: &Request, object: &Object) -> String {
    [
        Some(request.name.as_str()),
        object.metadata.name.as_deref(),
        object.metadata.generate_name.as_deref(),
    ]
    .into_iter()
    .flatten()
    .find(|n| !n.is_empty())
    .unwrap_or_default()
    .to_string()
}

fn deny_invalid(allow: AdmissionResponse, message: &str) -> (AdmissionResponse, Outcome) {
    let mut response = allow.deny("");
    response.result = Status::failure(message, "BadRequest").with_code(400);
    (response, Outcome::Invalid)
}

/// Turns a verdict into a response: every denial in `status.message` (one line, the way
/// kubectl prints it after "denied the request: ") and in `status.details.causes`.
fn answer(allow: AdmissionResponse, verdict: &Verdict, name: &str) -> (AdmissionResponse, Outcome) {
    let warnings = (!verdict.warnings.is_empty()).then(|| verdict.warnings.clone());
    if verdict.allowed() {
        let mut response = allow;
        response.warnings = warnings;
        return (response, Outcome::Allowed);
    }
    let mut response = allow.deny("");
    response.warnings = warnings;
    response.result = Status::failure(&denial_message(verdict), "Invalid")
        .with_code(422)
        .with_details(StatusDetails {
            name: name.to_string(),
            uid: String::new(),
            retry_after_seconds: 0,
            group: GROUP.to_string(),
            kind: KIND.to_string(),
            causes: verdict
                .denials
                .iter()
                .map(|d| StatusCause {
                    reason: d.reason.clone(),
                    message: d.message.clone(),
                    field: d.field.clone(),
                })
                .collect(),
        });
    (response, Outcome::Denied)
}

/// `field: message` for one denial; `N problems: (1) field: message (2) ...` for several.
pub fn denial_message(verdict: &Verdict) -> String {
    match verdict.denials.as_slice() {
        [] => String::new(),
        [one] => format!("{}: {}", one.field, one.message),
        many => {
            let mut out = format!("{} problems:", many.len());
            for (i, d) in many.iter().enumerate() {
                out.push_str(&format!(" ({}) {}: {}", i + 1, d.field, d.message));
            }
            out
        }
    }
}

fn invalid(uid: String, message: &str) -> Reviewed {
    let mut response = AdmissionResponse::invalid("");
    response.uid = uid;
    response.result = Status::failure(message, "BadRequest").with_code(400);
    Reviewed {
        review: finish(response),
        operation: "unknown",
        outcome: Outcome::Invalid,
    }
}

/// Wraps a response in a v1 AdmissionReview (the API server rejects any other version).
fn finish(mut response: AdmissionResponse) -> AdmissionReview<DynamicObject> {
    response.types.api_version = REVIEW_API_VERSION.to_string();
    response.types.kind = "AdmissionReview".to_string();
    response.into_review()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_is_found_in_a_truncated_body() {
        let body = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid" : "705ab4f5-6393-11e8-b7cc-42010a800002","kind":{"gr"#;
        assert_eq!(scan_uid(body), "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(scan_uid(br#"{"uid":"<script>"}"#), "");
        assert_eq!(scan_uid(br#"{"uid":"abc"#), "");
        assert_eq!(scan_uid(b""), "");
    }

    #[test]
    fn several_denials_are_numbered_on_one_line() {
        let verdict = Verdict {
            denials: vec![
                validate::Denial {
                    field: "spec.engine.kvCacheDtype".into(),
                    reason: "UnsupportedKvDtype".into(),
                    message: "use fp8".into(),
                },
                validate::Denial {
                    field: "spec.engine.tensorParallelSize".into(),
                    reason: "TooManyGpus".into(),
                    message: "use 2".into(),
                },
            ],
            ..Verdict::default()
        };
        assert_eq!(
            denial_message(&verdict),
            "2 problems: (1) spec.engine.kvCacheDtype: use fp8 (2) spec.engine.tensorParallelSize: use 2"
        );
    }

    use serde_json::Value;

    fn nvfp4_create() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/admission/create-nvfp4-vllm.json"
        );
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn denied_name(body: &Value) -> String {
        let facts = validate::synthetic_cluster(&["NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"]).unwrap();
        let review = review(&serde_json::to_vec(body).unwrap(), &facts);
        let response = review.response.expect("response");
        assert!(!response.allowed);
        let details = response.result.details.expect("details");
        assert_eq!(details.kind, KIND);
        assert_eq!(details.causes[0].field, "spec.engine.kvCacheDtype");
        details.name
    }

    /// kubectl prints `The InferenceDeployment "NAME" is invalid: ...` from the details.
    #[test]
    fn a_denial_names_the_object_from_the_request_the_object_or_its_generate_name() {
        let mut body = nvfp4_create();
        assert_eq!(denied_name(&body), "llama-nvfp4");
        // A CREATE the request does not name: the object's own name.
        body["request"]["name"] = Value::String(String::new());
        assert_eq!(denied_name(&body), "llama-nvfp4");
        // generateName: the API server names the object after admission.
        let meta = body["request"]["object"]["metadata"].as_object_mut().unwrap();
        meta.remove("name");
        meta.insert("generateName".into(), Value::String("llama-".into()));
        assert_eq!(denied_name(&body), "llama-");
    }

    #[test]
    fn a_review_of_another_version_is_refused_with_the_fix() {
        let body =
            br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"u1"}}"#;
        let reviewed = review_detailed(body, &ClusterFacts::default());
        let response = reviewed.review.response.expect("response");
        assert_eq!(response.uid, "u1");
        assert!(!response.allowed);
        assert!(response.result.message.contains("admissionReviewVersions: [v1]"));
        assert_eq!(reviewed.outcome, Outcome::Invalid);
    }
}
