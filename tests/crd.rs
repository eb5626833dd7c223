//! The generated CRD: drift against `crds/`, the schema's important parts, and every
//! example in `deploy/examples/` validated the way the API server would (structural
//! schema with unknown-field rejection, then the CEL rules).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

const CRD_FILE: &str = "crds/inferencedeployments.kvfleet.io.yaml";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn crd() -> Value {
    let yaml = kvfleet::cli::crd::render().expect("render CRD");
    serde_yaml::from_str(&yaml).expect("CRD is YAML")
}

fn schema() -> Value {
    crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

fn spec_schema() -> Value {
    schema()["properties"]["spec"].clone()
}

#[test]
fn committed_crd_is_byte_identical_to_generated() {
    let generated = kvfleet::cli::crd::render().unwrap();
    let committed = std::fs::read_to_string(repo(CRD_FILE)).unwrap();
    assert!(
        generated == committed,
        "{CRD_FILE} is stale: run `make crds` (cargo run -- crd > {CRD_FILE}) and commit it"
    );
}

#[test]
fn names_scope_and_short_name_are_pinned() {
    let crd = crd();
    assert_eq!(crd["metadata"]["name"], "inferencedeployments.kvfleet.io");
    assert_eq!(crd["spec"]["group"], "kvfleet.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["kind"], "InferenceDeployment");
    assert_eq!(crd["spec"]["names"]["shortNames"], json!(["infdep"]));
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    assert_eq!(v["served"], true);
    assert_eq!(v["storage"], true);
}

#[test]
fn status_and_scale_subresources_drive_kubectl_scale_and_hpa() {
    let sub = &crd()["spec"]["versions"][0]["subresources"];
    assert_eq!(sub["status"], json!({}));
    assert_eq!(sub["scale"]["specReplicasPath"], ".spec.replicas");
    assert_eq!(sub["scale"]["statusReplicasPath"], ".status.replicas");
    assert_eq!(sub["scale"]["labelSelectorPath"], ".status.selector");
    let status = &schema()["properties"]["status"]["properties"];
    for field in [
        "observedGeneration",
        "conditions",
        "resolved",
        "capacity",
        "replicas",
        "readyReplicas",
        "selector",
    ] {
        assert!(status.get(field).is_some(), "status.{field} missing");
    }
    assert_eq!(status["conditions"]["x-kubernetes-list-type"], "map");
}

#[test]
fn printer_columns_show_ready_replicas_dtype_capacity_age() {
    let cols = crd()["spec"]["versions"][0]["additionalPrinterColumns"].clone();
    let names: Vec<&str> = cols
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["Ready", "Replicas", "KV dtype", "Capacity", "Age"]);
    let path =
        |n: &str| cols.as_array().unwrap().iter().find(|c| c["name"] == n).unwrap()["jsonPath"].clone();
    assert_eq!(path("KV dtype"), ".status.resolved.kvCacheDtype");
    assert_eq!(path("Capacity"), ".status.capacity.tokensPerReplica");
}

#[test]
fn enums_and_ranges_are_in_the_schema() {
    let engine = &spec_schema()["properties"]["engine"]["properties"];
    assert_eq!(
        engine["kvCacheDtype"]["enum"],
        json!(["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"])
    );
    assert_eq!(engine["runtime"]["enum"], json!(["kvfleet", "vllm"]));
    let backends = engine["attentionBackend"]["enum"].as_array().unwrap();
    for b in ["auto", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "KVFLEET_CUDA"] {
        assert!(backends.contains(&json!(b)), "{b} missing");
    }
    assert_eq!(engine["blockSize"]["enum"], json!([1, 8, 16, 32, 64, 128]));
    assert_eq!(engine["gpuMemoryUtilization"]["minimum"], json!(0.0));
    assert_eq!(engine["gpuMemoryUtilization"]["exclusiveMinimum"], json!(true));
    assert_eq!(engine["gpuMemoryUtilization"]["maximum"], json!(1.0));
    assert_eq!(engine["maxModelLen"]["minimum"], json!(1.0));
    assert_eq!(engine["tensorParallelSize"]["minimum"], json!(1.0));
    assert_eq!(engine["tensorParallelSize"]["maximum"], json!(64.0));
    assert_eq!(engine["maxModelLen"]["maximum"], json!(33_554_432.0));
    let geometry = &spec_schema()["properties"]["model"]["properties"]["geometry"]["properties"];
    assert_eq!(geometry["draftLayers"]["maximum"], json!(1024.0));
    assert_eq!(geometry["layerTypes"]["maxItems"], json!(1024));
    assert_eq!(spec_schema()["properties"]["replicas"]["minimum"], json!(0.0));
}

#[test]
fn every_field_has_a_description() {
    fn walk(path: &str, s: &Value, missing: &mut Vec<String>) {
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                let p = format!("{path}.{k}");
                if v.get("description").is_none() {
                    missing.push(p.clone());
                }
                walk(&p, v, missing);
            }
        }
        if let Some(items) = s.get("items") {
            walk(&format!("{path}[]"), items, missing);
        }
    }
    let mut missing = Vec::new();
    walk("spec", &spec_schema(), &mut missing);
    // Kubernetes' own types (resources, tolerations, env) carry upstream descriptions.
    assert!(missing.is_empty(), "fields without a description: {missing:?}");
}

#[test]
fn spec_schema_is_structural_without_preserve_unknown_fields() {
    let text = serde_json::to_string(&spec_schema()).unwrap();
    assert!(!text.contains("x-kubernetes-preserve-unknown-fields"));
    assert!(!text.contains("additionalProperties\":false"));
}

// === a small apiserver-style validator ===

/// Validates `v` against an OpenAPI v3 structural schema: types, enums, bounds, required
/// and unknown fields (pruned-and-rejected, as kubectl's strict field validation reports).
fn structural_errors(path: &str, schema: &Value, v: &Value, errs: &mut Vec<String>) {
    if v.is_null() {
        if schema.get("nullable") != Some(&json!(true)) {
            errs.push(format!("{path}: null not allowed"));
        }
        return;
    }
    if schema.get("x-kubernetes-int-or-string") == Some(&json!(true)) {
        if !(v.is_i64() || v.is_u64() || v.is_string()) {
            errs.push(format!("{path}: must be an integer or a string"));
        }
        return;
    }
    let ty = schema.get("type").and_then(Value::as_str);
    let ok = match ty {
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        _ => true,
    };
    if !ok {
        errs.push(format!("{path}: expected {}", ty.unwrap_or("?")));
        return;
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
        let hit = allowed
            .iter()
            .any(|a| a == v || (a.as_f64().is_some() && a.as_f64() == v.as_f64()));
        if !hit {
            errs.push(format!("{path}: {v} not in {allowed:?}"));
        }
    }
    if let Some(x) = v.as_f64() {
        let excl = schema.get("exclusiveMinimum") == Some(&json!(true));
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64) {
            if x < min || (excl && x == min) {
                errs.push(format!("{path}: {x} below minimum {min}"));
            }
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64) {
            if x > max {
                errs.push(format!("{path}: {x} above maximum {max}"));
            }
        }
    }
    let too_many = |key: &str, n: usize| {
        schema
            .get(key)
            .and_then(Value::as_u64)
            .filter(|max| n as u64 > *max)
            .map(|max| format!("{path}: {n} is more than {key} {max}"))
    };
    errs.extend(v.as_str().and_then(|s| too_many("maxLength", s.chars().count())));
    errs.extend(v.as_array().and_then(|a| too_many("maxItems", a.len())));
    errs.extend(v.as_object().and_then(|o| too_many("maxProperties", o.len())));
    if let Some(obj) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for req in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let req = req.as_str().unwrap();
            if !obj.contains_key(req) {
                errs.push(format!("{path}.{req}: Required value"));
            }
        }
        for (k, child) in obj {
            let p = format!("{path}.{k}");
            match (props.and_then(|p| p.get(k)), schema.get("additionalProperties")) {
                (Some(s), _) => structural_errors(&p, s, child, errs),
                (None, Some(s)) if s.is_object() => structural_errors(&p, s, child, errs),
                _ if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&json!(true)) => {}
                _ => errs.push(format!("{p}: unknown field \"{k}\"")),
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), v.as_array()) {
        for (i, child) in arr.iter().enumerate() {
            structural_errors(&format!("{path}[{i}]"), items, child, errs);
        }
    }
}

/// Everything the API server would say about `object` (structural errors, then CEL).
fn apiserver_errors(object: &Value) -> Vec<String> {
    let schema = schema();
    let mut errs = Vec::new();
    let spec = object.get("spec").cloned().unwrap_or(Value::Null);
    structural_errors("spec", &schema["properties"]["spec"], &spec, &mut errs);
    if errs.is_empty() {
        if let Err(cel) = kube_cel::validate(&schema, object, None) {
            errs.extend(cel.as_slice().iter().map(|e| e.to_string()));
        }
    }
    errs
}

fn example_documents() -> Vec<(PathBuf, Value)> {
    let mut docs = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(repo("deploy/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).unwrap();
            if v.get("kind") == Some(&json!("InferenceDeployment")) {
                docs.push((f.clone(), v));
            }
        }
    }
    docs
}

#[test]
fn every_example_validates_against_the_crd() {
    let docs = example_documents();
    assert!(!docs.is_empty(), "deploy/examples holds no InferenceDeployment");
    for (file, doc) in docs {
        assert_eq!(doc["apiVersion"], "kvfleet.io/v1alpha1", "{}", file.display());
        let errs = apiserver_errors(&doc);
        assert!(errs.is_empty(), "{}: {errs:#?}", file.display());
        // Our own parser agrees with the schema.
        let parsed: Result<kvfleet::api::InferenceDeployment, _> = serde_json::from_value(doc);
        assert!(parsed.is_ok(), "{}: {:?}", file.display(), parsed.err());
    }
}

fn base() -> Value {
    json!({
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {
            "model": {"name": "m", "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}},
            "engine": {"kvCacheDtype": "fp8", "maxModelLen": 8192}
        }
    })
}

fn errors_after(edit: impl FnOnce(&mut Value)) -> Vec<String> {
    let mut v = base();
    edit(&mut v);
    apiserver_errors(&v)
}

#[test]
fn base_object_is_valid() {
    assert_eq!(apiserver_errors(&base()), Vec::<String>::new());
}

#[test]
fn unknown_spec_fields_are_rejected() {
    let errs = errors_after(|v| v["spec"]["engine"]["kvCacheDtyp"] = json!("fp8"));
    assert!(
        errs.iter().any(|e| e.contains("unknown field \"kvCacheDtyp\"")),
        "{errs:?}"
    );
    // Our parser rejects it too, so `kvfleet check` and the webhook never drop it silently.
    let mut v = base();
    v["spec"]["model"]["weigthBytes"] = json!("1Gi");
    assert!(serde_json::from_value::<kvfleet::api::InferenceDeployment>(v).is_err());
}

#[test]
fn bounds_and_enums_are_enforced() {
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "gpuMemoryUtilization",
            Box::new(|v| v["spec"]["engine"]["gpuMemoryUtilization"] = json!(0.0)),
        ),
        (
            "gpuMemoryUtilization",
            Box::new(|v| v["spec"]["engine"]["gpuMemoryUtilization"] = json!(1.2)),
        ),
        ("replicas", Box::new(|v| v["spec"]["replicas"] = json!(-1))),
        (
            "maxModelLen",
            Box::new(|v| v["spec"]["engine"]["maxModelLen"] = json!(0)),
        ),
        (
            "blockSize",
            Box::new(|v| v["spec"]["engine"]["blockSize"] = json!(24)),
        ),
        (
            "tensorParallelSize",
            Box::new(|v| v["spec"]["engine"]["tensorParallelSize"] = json!(0)),
        ),
        (
            "kvCacheDtype",
            Box::new(|v| v["spec"]["engine"]["kvCacheDtype"] = json!("int4")),
        ),
        (
            "runtime",
            Box::new(|v| v["spec"]["engine"]["runtime"] = json!("tgi")),
        ),
        // Upper bounds (issue 22): what used to abort or stall the webhook.
        (
            "draftLayers",
            Box::new(|v| v["spec"]["model"]["geometry"]["draftLayers"] = json!(2_147_483_647)),
        ),
        (
            "tensorParallelSize",
            Box::new(|v| v["spec"]["engine"]["tensorParallelSize"] = json!(2_147_483_647)),
        ),
        (
            "layers",
            Box::new(|v| v["spec"]["model"]["geometry"]["layers"] = json!(1025)),
        ),
        (
            "maxModelLen",
            Box::new(|v| v["spec"]["engine"]["maxModelLen"] = json!(33_554_433i64)),
        ),
        (
            "maxNumSeqs",
            Box::new(|v| v["spec"]["engine"]["maxNumSeqs"] = json!(65_537)),
        ),
        (
            "extraArgs",
            Box::new(|v| v["spec"]["engine"]["extraArgs"] = json!(vec!["--x"; 257])),
        ),
        (
            "image",
            Box::new(|v| v["spec"]["engine"]["image"] = json!("i".repeat(1025))),
        ),
        (
            "nodeSelector",
            Box::new(|v| {
                let labels: serde_json::Map<String, Value> =
                    (0..65).map(|i| (format!("k{i}"), json!("v"))).collect();
                v["spec"]["pod"] = json!({"nodeSelector": labels});
            }),
        ),
    ];
    for (field, edit) in cases {
        let errs = errors_after(edit);
        assert!(errs.iter().any(|e| e.contains(field)), "{field}: {errs:?}");
    }
}

#[test]
fn cel_rules_catch_relations_between_fields() {
    let errs = errors_after(|v| {
        v["spec"]["model"]["config"] = json!({"configMapRef": {"name": "cfg"}});
    });
    assert!(
        errs.iter()
            .any(|e| e.contains("exactly one of model.geometry and model.config")),
        "{errs:?}"
    );

    let errs = errors_after(|v| v["spec"]["engine"]["attentionBackend"] = json!("FLASHINFER"));
    assert!(
        errs.iter()
            .any(|e| e.contains("kvfleet runtime runs its own kernels")),
        "{errs:?}"
    );

    let errs = errors_after(|v| {
        v["spec"]["engine"]["runtime"] = json!("vllm");
        v["spec"]["engine"]["attentionBackend"] = json!("KVFLEET_CUDA");
    });
    assert!(
        errs.iter()
            .any(|e| e.contains("KVFLEET_* backends need runtime kvfleet")),
        "{errs:?}"
    );

    let errs = errors_after(|v| v["spec"]["model"]["geometry"]["kvHeads"] = json!(6));
    assert!(errs.iter().any(|e| e.contains("multiple of kvHeads")), "{errs:?}");

    let errs = errors_after(|v| {
        v["spec"]["engine"]["tensorParallelSize"] = json!(4);
        v["spec"]["gpu"] = json!({"count": 2});
    });
    assert!(
        errs.iter().any(|e| e.contains("gpu.count must be at least")),
        "{errs:?}"
    );

    let errs = errors_after(|v| v["spec"]["model"]["geometry"]["layerTypes"] = json!(["full_attention"]));
    assert!(errs.iter().any(|e| e.contains("one entry per layer")), "{errs:?}");
}

#[test]
fn speculative_cel_rules_tie_the_drafter_and_the_lookup_to_the_method() {
    let with = |speculative: Value| errors_after(move |v| v["spec"]["engine"]["speculative"] = speculative);
    let ok = [
        json!({"method": "ngram", "numSpeculativeTokens": 4}),
        json!({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3, "promptLookupMin": 3, "disableByBatchSize": 16}),
        json!({"method": "eagle3", "numSpeculativeTokens": 3, "draftModel": {"pvcName": "d", "path": "e3/"}}),
        json!({"method": "dflash", "numSpeculativeTokens": 15, "draftModel": {"huggingFace": {"repo": "z-lab/x", "revision": "v1"}}}),
    ];
    for s in ok {
        let errs = with(s.clone());
        assert!(errs.is_empty(), "{s}: {errs:#?}");
    }
    let denied = [
        (
            json!({"method": "ngram", "numSpeculativeTokens": 4, "draftModel": {"pvcName": "d"}}),
            "not allowed with method ngram",
        ),
        (
            json!({"method": "eagle3", "numSpeculativeTokens": 4}),
            "draftModel is required with method eagle3 or dflash",
        ),
        (
            json!({"method": "dflash", "numSpeculativeTokens": 4, "promptLookupMax": 2, "draftModel": {"pvcName": "d"}}),
            "apply to method ngram only",
        ),
        (
            json!({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 5}),
            "promptLookupMin must not exceed promptLookupMax",
        ),
        (
            json!({"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 2, "promptLookupMin": 3}),
            "promptLookupMin must not exceed promptLookupMax",
        ),
        (
            json!({"method": "eagle3", "numSpeculativeTokens": 4, "draftModel": {"path": "x"}}),
            "exactly one of draftModel.pvcName",
        ),
        (
            json!({"method": "eagle3", "numSpeculativeTokens": 4, "draftModel": {"pvcName": "d", "image": "r/d:1"}}),
            "exactly one of draftModel.pvcName",
        ),
        (
            json!({"method": "eagle3", "numSpeculativeTokens": 4, "draftModel": {"huggingFace": {}}}),
            "draftModel.huggingFace needs repo",
        ),
        (
            json!({"method": "ngram", "numSpeculativeTokens": 17}),
            "numSpeculativeTokens",
        ),
        (
            json!({"method": "ngram", "numSpeculativeTokens": 4, "disableByBatchSize": 1}),
            "disableByBatchSize",
        ),
        (json!({"method": "medusa", "numSpeculativeTokens": 4}), "method"),
    ];
    for (s, text) in denied {
        let errs = with(s.clone());
        assert!(
            errs.iter().any(|e| e.contains(text)),
            "{s}: {text:?} not in {errs:#?}"
        );
    }
}

#[test]
fn weights_name_at_most_one_source() {
    let errs = errors_after(|v| {
        v["spec"]["model"]["weights"] =
            json!({"format": "safetensors", "pvcName": "w", "huggingFace": {"cachePvcName": "c"}});
    });
    assert!(
        errs.iter().any(|e| e.contains("at most one of weights.pvcName")),
        "{errs:#?}"
    );
    let errs = errors_after(|v| {
        v["spec"]["model"]["weights"] = json!({"format": "safetensors",
            "huggingFace": {"repo": "Qwen/Qwen3-32B", "tokenSecretRef": {"name": "hf"}, "cachePvcName": "c"}});
        v["spec"]["engine"]["vllm"] = json!({"version": "0.21.1"});
    });
    assert!(errs.is_empty(), "{errs:#?}");
}

#[test]
fn routing_needs_an_endpoint_picker_for_an_inference_pool_and_its_port_when_it_is_a_service() {
    let errs = errors_after(|v| v["spec"]["routing"] = json!({"mode": "inferencePool"}));
    assert!(
        errs.iter()
            .any(|e| e.contains("routing.endpointPicker is required when routing.mode is inferencePool")),
        "{errs:?}"
    );
    let errs = errors_after(|v| {
        v["spec"]["routing"] = json!({"mode": "inferencePool", "endpointPicker": {"name": "epp"}});
    });
    assert!(
        errs.iter().any(|e| e.contains("endpointPicker.port is required")),
        "{errs:?}"
    );
    for ok in [
        json!({"mode": "inferencePool", "endpointPicker": {"name": "epp", "port": 9002, "failureMode": "FailOpen"}}),
        json!({"mode": "inferencePool", "endpointPicker": {"name": "epp", "kind": "Gateway", "group": "example.com"}}),
        json!({"mode": "kvfleet", "router": {"replicas": 3, "resources": {"requests": {"cpu": "1"}}}}),
        json!({"mode": "service"}),
    ] {
        let errs = errors_after(|v| v["spec"]["routing"] = ok.clone());
        assert!(errs.is_empty(), "{ok}: {errs:?}");
    }
    let errs = errors_after(|v| v["spec"]["routing"] = json!({"mode": "gateway"}));
    assert!(!errs.is_empty(), "an unknown mode is refused");
    let errs = errors_after(|v| v["spec"]["routing"] = json!({"mode": "kvfleet", "router": {"replicas": 0}}));
    assert!(!errs.is_empty(), "at least one router pod");
}
