//! Property/fuzz tests over the untrusted inputs of the control plane and the model loaders
//! (issue 22): AdmissionReview bodies, InferenceDeployment specs, GGUF headers, safetensors
//! headers, HF `config.json`, `tokenizer.json` and tokenizer input. Each property must hold without a panic,
//! an allocation abort or a slow answer.
//!
//! Cases per input kind: `KVFLEET_FUZZ_CASES` (by default a few seconds per kind in a debug
//! build on 2 cores: 1,000 to 2,000, 64 for the served model's tokenizer);
//! the recorded runs use 100,000 (`KVFLEET_FUZZ_CASES=100000 cargo test --release --test fuzz`,
//! see bench/RESULTS.md). Proptest counts a case once it ran; a panic fails the test with the
//! shrunk input.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kvfleet::api::limits;
use kvfleet::api::InferenceDeploymentSpec;
use kvfleet::validate::{self, ClusterFacts, NodeFacts};
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::tokenizer::Tokenizer;
use proptest::prelude::*;
use serde_json::{json, Value};

/// `KVFLEET_FUZZ_CASES` when set, else `default` (sized for a few seconds in a debug build).
fn cases(default: u32) -> u32 {
    std::env::var("KVFLEET_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default_cases),
        failure_persistence: None,
        // Generators here reject nothing; keep shrinking short so a failure reports fast.
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    }
}

/// A spec answer slower than this is a failure (the unbounded tensorParallelSize loop took
/// more than 5 s); generous for debug builds on a loaded 2-core machine.
const SLOW: Duration = Duration::from_secs(2);

fn cluster() -> ClusterFacts {
    validate::synthetic_cluster(&[
        "NVIDIA-H100-80GB-HBM3",
        "NVIDIA-GeForce-RTX-3090",
        "NVIDIA-B200",
        "Tesla-T4",
    ])
    .unwrap()
}

// === generators ===

/// i32 values that find bugs: small valid ones, each bound and one above it, the extremes.
fn int32() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 1i64..256,
        1 => prop::sample::select(vec![
            0i64,
            -1,
            i64::from(i32::MIN),
            i64::from(i32::MAX),
            1024,
            1025,
            8192,
            65_536,
            65_537,
            20_000_000,
            i64::from(limits::MAX_NUM_BATCHED_TOKENS_MAX),
            i64::from(limits::MAX_NUM_BATCHED_TOKENS_MAX) + 1,
        ]),
        1 => any::<i32>().prop_map(i64::from),
    ]
}

fn int64() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 1i64..1_000_000,
        1 => prop::sample::select(vec![
            0i64,
            -1,
            i64::MIN,
            i64::MAX,
            limits::MAX_MODEL_LEN_MAX,
            limits::MAX_MODEL_LEN_MAX + 1,
        ]),
        1 => any::<i64>(),
    ]
}

fn maybe<S: Strategy>(s: S) -> impl Strategy<Value = Option<S::Value>> {
    prop::option::weighted(0.67, s)
}

/// An InferenceDeployment spec as JSON, every number drawn from [`int32`] / [`int64`].
fn spec_json() -> impl Strategy<Value = Value> {
    let geometry = (
        (int32(), int32(), int32(), int32()),
        (maybe(int32()), maybe(int32()), maybe(int32()), maybe(int32())),
        (maybe(int32()), maybe(int32()), maybe(int32()), maybe(int32())),
        maybe(prop::collection::vec(any::<bool>(), 0..40)),
    );
    let engine = (
        prop::sample::select(vec!["kvfleet", "vllm"]),
        prop::sample::select(vec!["auto", "bfloat16", "fp8", "fp8_e5m2", "nvfp4"]),
        int64(),
        (int32(), int32()),
        prop::sample::select(vec![1i64, 16, 128, 0, 7, -16, i64::from(i32::MAX)]),
        (
            int32(),
            prop::sample::select(vec![0.5f64, 0.85, 0.9, 1.0, 0.0, -1.0, 2.0]),
        ),
    );
    let gpu = (
        maybe(int32()),
        maybe(prop::collection::vec("[A-Za-z0-9-]{0,30}", 0..4)),
    );
    (geometry, engine, gpu, maybe("[0-9]{1,12}(Gi|Mi|k)?"), 0i64..4).prop_map(
        |(g, e, (count, products), weight_bytes, replicas)| {
            let ((layers, q, kv, hd), (sw, ghd, gkv, rank), (rope, draft, hidden, vocab), types) = g;
            let mut geometry = json!({"layers": layers, "queryHeads": q, "kvHeads": kv, "headDim": hd});
            for (k, v) in [
                ("slidingWindow", sw),
                ("globalHeadDim", ghd),
                ("globalKvHeads", gkv),
                ("kvLoraRank", rank),
                ("qkRopeHeadDim", rope),
                ("draftLayers", draft),
                ("hiddenSize", hidden),
                ("vocabSize", vocab),
            ] {
                if let Some(v) = v {
                    geometry[k] = json!(v);
                }
            }
            if let Some(t) = types {
                geometry["layerTypes"] = t
                    .iter()
                    .map(|s| if *s { "sliding_attention" } else { "full_attention" })
                    .collect();
            }
            let (runtime, dtype, max_model_len, (seqs, batched), block, (tp, util)) = e;
            let mut spec = json!({
                "replicas": replicas,
                "model": {"name": "m", "geometry": geometry},
                "engine": {"runtime": runtime, "kvCacheDtype": dtype, "maxModelLen": max_model_len,
                           "maxNumSeqs": seqs, "maxNumBatchedTokens": batched, "blockSize": block,
                           "tensorParallelSize": tp, "gpuMemoryUtilization": util},
            });
            if let Some(w) = weight_bytes {
                spec["model"]["weightBytes"] = json!(w);
            }
            if count.is_some() || products.is_some() {
                let mut gpu = json!({});
                if let Some(c) = count {
                    gpu["count"] = json!(c);
                }
                if let Some(p) = products {
                    gpu["selector"] = json!({"products": p});
                }
                spec["gpu"] = gpu;
            }
            spec
        },
    )
}

/// The fields of `spec` above their bound, as the denial's field path (independent of
/// `validate::bounds`: read from the JSON).
fn over_bounds(spec: &Value) -> Vec<&'static str> {
    let n = |p: &str| spec.pointer(p).and_then(Value::as_i64);
    let checks: [(&str, &'static str, i64); 8] = [
        (
            "/model/geometry/layers",
            "spec.model.geometry.layers",
            limits::LAYERS_MAX.into(),
        ),
        (
            "/model/geometry/draftLayers",
            "spec.model.geometry.draftLayers",
            limits::DRAFT_LAYERS_MAX.into(),
        ),
        (
            "/model/geometry/queryHeads",
            "spec.model.geometry.queryHeads",
            limits::HEADS_MAX.into(),
        ),
        (
            "/model/geometry/slidingWindow",
            "spec.model.geometry.slidingWindow",
            limits::SLIDING_WINDOW_MAX.into(),
        ),
        (
            "/engine/maxModelLen",
            "spec.engine.maxModelLen",
            limits::MAX_MODEL_LEN_MAX,
        ),
        (
            "/engine/maxNumSeqs",
            "spec.engine.maxNumSeqs",
            limits::MAX_NUM_SEQS_MAX.into(),
        ),
        (
            "/engine/tensorParallelSize",
            "spec.engine.tensorParallelSize",
            limits::GPUS_PER_REPLICA_MAX.into(),
        ),
        (
            "/gpu/count",
            "spec.gpu.count",
            limits::GPUS_PER_REPLICA_MAX.into(),
        ),
    ];
    checks
        .iter()
        .filter(|(p, _, max)| n(p).is_some_and(|v| v > *max))
        .map(|(_, f, _)| *f)
        .collect()
}

fn admission_review(spec: &Value, uid: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "kvfleet.io", "version": "v1alpha1", "kind": "InferenceDeployment"},
            "resource": {"group": "kvfleet.io", "version": "v1alpha1", "resource": "inferencedeployments"},
            "name": "fuzz", "namespace": "ml", "operation": "CREATE",
            "userInfo": {"username": "fuzz"},
            "object": {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                       "metadata": {"name": "fuzz", "namespace": "ml"}, "spec": spec}
        }
    }))
    .unwrap()
}

fn mutate(mut bytes: Vec<u8>, flips: &[(usize, u8)]) -> Vec<u8> {
    for &(at, b) in flips {
        if !bytes.is_empty() {
            let i = at % bytes.len();
            bytes[i] = b;
        }
    }
    bytes
}

// === specs and AdmissionReviews ===

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn specs_of_hostile_numbers_are_judged_quickly_and_out_of_bound_values_are_denied(spec in spec_json()) {
        // Every generated number fits its field's type, so every case reaches validate().
        let parsed = serde_json::from_value::<InferenceDeploymentSpec>(spec.clone());
        prop_assert!(parsed.is_ok(), "{spec}: {:?}", parsed.err());
        let parsed = parsed.unwrap();
        let facts = cluster();
        let start = Instant::now();
        let verdict = validate::validate(&parsed, &facts);
        let took = start.elapsed();
        prop_assert!(took < SLOW, "validate took {took:?} for {spec}");
        for field in over_bounds(&spec) {
            prop_assert!(
                verdict.denials.iter().any(|d| d.field == field && d.reason == validate::bounds::REASON),
                "{field} is over its bound but not denied: {:?}", verdict.denials
            );
        }
        if verdict.allowed() {
            // What is admitted is plannable: a capacity or a stated reason why not.
            prop_assert!(verdict.resolved.is_some());
        }
    }

    #[test]
    fn admission_reviews_of_hostile_specs_and_mutated_bodies_get_a_review(
        spec in spec_json(),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
        how in 0u8..3,
    ) {
        let body = admission_review(&spec, "0000-fuzz");
        let body = match how {
            0 => body,
            1 => mutate(body, &flips),
            _ => { let n = cut.index(body.len() + 1); body[..n].to_vec() }
        };
        let facts = cluster();
        let start = Instant::now();
        let review = kvfleet::webhook::review(&body, &facts);
        let took = start.elapsed();
        prop_assert!(took < SLOW, "review took {took:?}");
        let json = serde_json::to_value(&review).unwrap();
        prop_assert_eq!(&json["kind"], "AdmissionReview");
        if how == 0 && serde_json::from_value::<InferenceDeploymentSpec>(spec.clone()).is_ok() {
            prop_assert_eq!(json["response"]["uid"].as_str(), Some("0000-fuzz"));
            let over = over_bounds(&spec);
            if !over.is_empty() {
                prop_assert_eq!(&json["response"]["allowed"], false);
                let message = json["response"]["status"]["message"].as_str().unwrap_or_default();
                prop_assert!(message.contains(over[0]), "{message}");
            }
        }
    }
}

// === GGUF headers ===

fn gguf_string(out: &mut Vec<u8>, s: &[u8], len: u64) {
    out.extend(len.to_le_bytes());
    out.extend(s);
}

/// A GGUF image: header counts, string lengths, value types, dims and offsets drawn from
/// honest and hostile values, followed by a small data section.
fn gguf_bytes() -> impl Strategy<Value = Vec<u8>> {
    let count =
        prop_oneof![3 => 0u64..4, 1 => prop::sample::select(vec![u64::MAX, u64::MAX / 8, 1 << 40, 100_000])];
    let kv = (
        "[a-z.]{1,20}",
        prop_oneof![3 => 0u32..13, 1 => any::<u32>()],
        prop_oneof![3 => 0u64..8, 1 => any::<u64>()],
        any::<u64>(),
    );
    let tensor = (
        "[a-z.]{1,12}",
        prop_oneof![3 => 0u32..5, 1 => any::<u32>()],
        prop::collection::vec(prop_oneof![3 => 1u64..64, 1 => any::<u64>()], 0..5),
        prop_oneof![3 => prop::sample::select(vec![0u32, 1, 2, 3, 8, 30]), 1 => any::<u32>()],
        prop_oneof![3 => 0u64..256, 1 => any::<u64>()],
    );
    (
        prop_oneof![4 => Just(3u32), 1 => any::<u32>()],
        count.clone(),
        count,
        prop::collection::vec(kv, 0..4),
        prop::collection::vec(tensor, 0..4),
        prop::collection::vec(any::<u8>(), 0..512),
        prop::sample::select(vec![
            None,
            Some(32u64),
            Some(1),
            Some(u64::MAX),
            Some(1 << 40),
            Some(0),
        ]),
    )
        .prop_map(|(version, n_t, n_kv, kvs, tensors, data, alignment)| {
            let mut out = b"GGUF".to_vec();
            out.extend(version.to_le_bytes());
            let real_kv = kvs.len() as u64 + u64::from(alignment.is_some());
            let n_kv = if n_kv < 4 { real_kv } else { n_kv };
            let n_t = if n_t < 4 { tensors.len() as u64 } else { n_t };
            out.extend(n_t.to_le_bytes());
            out.extend(n_kv.to_le_bytes());
            if let Some(a) = alignment {
                gguf_string(&mut out, b"general.alignment", 17);
                out.extend(10u32.to_le_bytes());
                out.extend(a.to_le_bytes());
            }
            for (key, ty, len, raw) in kvs {
                gguf_string(&mut out, key.as_bytes(), key.len() as u64);
                out.extend(ty.to_le_bytes());
                match ty {
                    8 => gguf_string(&mut out, b"abc", len),
                    9 => {
                        out.extend(((raw % 13) as u32).to_le_bytes());
                        out.extend(len.to_le_bytes());
                        out.extend(raw.to_le_bytes());
                    }
                    _ => out.extend(raw.to_le_bytes()),
                }
            }
            for (name, nd, dims, ty, offset) in tensors {
                gguf_string(&mut out, name.as_bytes(), name.len() as u64);
                out.extend(nd.to_le_bytes());
                for d in dims.iter().take(nd.min(8) as usize) {
                    out.extend(d.to_le_bytes());
                }
                out.extend(ty.to_le_bytes());
                out.extend(offset.to_le_bytes());
            }
            out.extend(data);
            out
        })
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn gguf_headers_with_hostile_counts_lengths_and_dims_are_errors_not_panics(
        bytes in gguf_bytes(),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    ) {
        let bytes = mutate(bytes, &flips);
        let file_len = bytes.len();
        if let Ok(g) = Gguf::from_bytes(bytes) {
            let names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
            for name in names {
                if let Ok((t, data)) = g.tensor_bytes(&name) {
                    prop_assert!(data.len() <= file_len, "{name}: {} bytes in a {file_len}-byte file", data.len());
                    if t.elements() <= 1 << 16 {
                        let _ = g.dequantize(&name);
                    }
                }
            }
        }
    }
}

// === safetensors headers ===

fn safetensors_bytes() -> impl Strategy<Value = Vec<u8>> {
    let tensor = (
        "[a-z.]{1,10}",
        prop::sample::select(vec!["F32", "F16", "BF16", "I8", "U64", "XX"]),
        prop::collection::vec(prop_oneof![3 => 0u64..16, 1 => any::<u64>()], 0..4),
        prop_oneof![3 => 0u64..64, 1 => any::<u64>()],
        prop_oneof![3 => 0u64..64, 1 => any::<u64>()],
    );
    (
        prop::collection::vec(tensor, 0..4),
        prop_oneof![3 => Just(None), 1 => any::<u64>().prop_map(Some)],
        prop::collection::vec(any::<u8>(), 0..128),
    )
        .prop_map(|(tensors, declared_len, data)| {
            let mut header = serde_json::Map::new();
            for (name, dtype, shape, a, b) in tensors {
                header.insert(
                    name,
                    json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
                );
            }
            let header = serde_json::to_vec(&Value::Object(header)).unwrap();
            let mut out = declared_len.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
            out.extend(header);
            out.extend(data);
            out
        })
}

proptest! {
    #![proptest_config(config(2000))]

    /// `Safetensors::tensor_f32` slices `data_start + a .. data_start + b` on the strength of
    /// `read_metadata`'s checks: every header it accepts must keep those slices in the file.
    #[test]
    fn safetensors_headers_that_parse_keep_every_tensor_inside_the_file(
        bytes in safetensors_bytes(),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    ) {
        let bytes = mutate(bytes, &flips);
        if let Ok((header, meta)) = safetensors::SafeTensors::read_metadata(&bytes) {
            let data_start = 8 + header;
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                prop_assert!(a <= b && data_start + b <= bytes.len(), "{name}: {a}..{b} in {}", bytes.len());
                let elements = info.shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
                prop_assert!(elements.is_some(), "{name}: shape {:?} overflows", info.shape);
            }
        }
    }
}

// === HF config.json ===

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn hf_configs_with_hostile_sizes_are_errors_not_allocations(
        sizes in prop::collection::vec(prop_oneof![3 => 0u64..5000, 1 => any::<u64>(), 1 => Just(u64::MAX)], 9),
        rope in prop_oneof![Just(Value::Null), Just(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))],
    ) {
        let config = json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": sizes[0], "intermediate_size": sizes[1], "num_hidden_layers": sizes[2],
            "num_attention_heads": sizes[3], "num_key_value_heads": sizes[4], "head_dim": sizes[5],
            "vocab_size": sizes[6], "max_position_embeddings": sizes[7], "sliding_window": sizes[8],
            "rope_scaling": rope,
        });
        let text = config.to_string();
        let start = Instant::now();
        if let Ok(cfg) = kvfleet_engine::model::hf::HfConfig::parse(std::path::Path::new("config.json"), &text) {
            prop_assert!(cfg.llama.head_dim <= 16_384 && cfg.llama.n_layers <= 4096);
            let _ = cfg.llama.parameters();
        }
        prop_assert!(start.elapsed() < SLOW);
    }
}

// === tokenizer input ===

/// The served model's tokenizer when the tools are installed (CI), else the byte tokenizer.
fn tokenizer() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        std::env::var("KVFLEET_SMOLLM2_GGUF")
            .ok()
            .and_then(|p| Gguf::open(std::path::Path::new(&p)).ok())
            .and_then(|g| Tokenizer::from_gguf(&g).ok())
            .unwrap_or_else(Tokenizer::bytes_only)
    })
}

fn text_input() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        // Arbitrary bytes: invalid UTF-8 included.
        4 => prop::collection::vec(any::<u8>(), 0..256),
        // Special-token look-alikes and chat markup.
        2 => prop::collection::vec(prop::sample::select(vec![
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|", "|>", "\u{0}", "\u{FFFD}", "🦀",
            "\r\n", " ", "a", "é", "\u{202E}",
        ]), 0..64).prop_map(|parts| parts.concat().into_bytes()),
        // Long runs (the BPE merge loop's worst case), up to 1 KiB (tokenisation is still
        // quadratic in the run length: the worker part of issue 22 makes it linear).
        1 => (prop::sample::select(vec![b'a', b' ', b'.', 0xF0]), 0usize..1024).prop_map(|(b, n)| vec![b; n]),
    ]
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn tokenizer_input_of_any_bytes_encodes_and_decodes_without_panic(
        bytes in text_input(),
        ids in prop::collection::vec(prop_oneof![3 => 0u32..50_000, 1 => any::<u32>()], 0..32),
        special in any::<bool>(),
    ) {
        let tok = tokenizer();
        let text = String::from_utf8_lossy(&bytes);
        let encoded = tok.encode(&text, special);
        prop_assert!(encoded.iter().all(|&id| (id as usize) < tok.vocab_size()));
        let _ = tok.decode(&encoded, true);
        // Any ids, in range or not, from a hostile client or a bad sampler.
        let _ = tok.decode(&ids, special);
        for &id in &ids {
            let _ = tok.token_bytes(id, special);
        }
    }
}

#[test]
fn a_quarter_megabyte_prompt_of_invalid_utf8_tokenizes_without_panic() {
    let bytes: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8 | 0x80).collect();
    let text = String::from_utf8_lossy(&bytes);
    let ids = Tokenizer::bytes_only().encode(&text, true);
    assert!(!ids.is_empty());
}

#[test]
fn nodes_with_hostile_labels_do_not_break_validation() {
    let mut nodes = Vec::new();
    for (i, (major, minor, mem, count)) in [
        ("99999999999999999999", "x", "18446744073709551615", "-1"),
        ("9", "0", "-5", "9223372036854775807"),
        ("", "", "", ""),
    ]
    .into_iter()
    .enumerate()
    {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": format!("n{i}"), "labels": {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.compute.major": major, "nvidia.com/gpu.compute.minor": minor,
                "nvidia.com/gpu.memory": mem, "nvidia.com/gpu.count": count}},
            "status": {"allocatable": {"nvidia.com/gpu": count}}
        }))
        .unwrap();
        nodes.push(NodeFacts::from_node(&node));
    }
    let spec: InferenceDeploymentSpec = serde_json::from_value(json!({
        "model": {"name": "m", "geometry": {"layers": 32, "queryHeads": 32, "kvHeads": 8, "headDim": 128}}
    }))
    .unwrap();
    let _ = validate::validate(
        &spec,
        &ClusterFacts {
            nodes,
            ..ClusterFacts::default()
        },
    );
}

// === tokenizer.json ===

fn tokenizer_json() -> impl Strategy<Value = String> {
    let id = prop_oneof![6 => 0u64..400, 1 => prop::sample::select(vec![1u64 << 20, 1 << 24, 1 << 31, u64::from(u32::MAX), u64::MAX])];
    let token = "[a-zé ]{1,3}";
    (
        prop::collection::vec((token, id.clone()), 0..12),
        prop::collection::vec((token, token), 0..8),
        prop::collection::vec(("<\\|[a-z]{1,4}\\|>", id, any::<bool>()), 0..3),
        prop::sample::select(vec!["ByteLevel", "Metaspace", "Split", "Sequence", "Whitespace"]),
        any::<bool>(),
    )
        .prop_map(|(vocab, merges, added, pre, ignore_merges)| {
            let vocab: serde_json::Map<String, Value> =
                vocab.into_iter().map(|(t, i)| (t, json!(i))).collect();
            let added: Vec<Value> = added
                .into_iter()
                .map(|(c, i, s)| json!({"id": i, "content": c, "special": s}))
                .collect();
            json!({
                "added_tokens": added,
                "pre_tokenizer": {"type": pre, "add_prefix_space": false, "use_regex": true,
                                  "pretokenizers": [{"type": "ByteLevel"}]},
                "model": {"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": ignore_merges}
            })
            .to_string()
        })
}

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn tokenizer_json_with_hostile_ids_and_merges_is_an_error_or_a_working_tokenizer(
        json in tokenizer_json(),
        text in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let start = Instant::now();
        if let Ok(tok) = kvfleet_engine::model::tokenizer::Tokenizer::from_hf_json(&json, None) {
            prop_assert!(tok.vocab_size() <= 1 << 24, "a vocabulary of {} entries from {json}", tok.vocab_size());
            let ids = tok.encode(&String::from_utf8_lossy(&text), true);
            let _ = tok.decode(&ids, true);
        }
        prop_assert!(start.elapsed() < SLOW);
    }
}
