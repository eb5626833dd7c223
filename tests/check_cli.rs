//! `kvfleet check` end to end: runs the built binary on every example in deploy/examples and
//! on unusable input, asserting exit codes and the key message text.

use std::path::Path;
use std::process::{Command, Output};

fn kvfleet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run kvfleet")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `check` and asserts the exit code and that each expected fragment is printed.
fn check(args: &[&str], code: i32, expected: &[&str]) -> String {
    let mut all = vec!["check"];
    all.extend_from_slice(args);
    let o = kvfleet(&all);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(code), "kvfleet {all:?}:\n{out}");
    for e in expected {
        assert!(out.contains(e), "{e:?} missing from kvfleet {all:?}:\n{out}");
    }
    assert!(!out.contains("panicked"), "{out}");
    out
}

#[test]
fn nvfp4_on_rtx_pro_6000_is_denied_with_fp8_hint() {
    check(
        &["-f", "deploy/examples/nvfp4-rtx-pro-6000.yaml", "--nodes", "deploy/examples/nodes/rtx-pro-6000.yaml"],
        1,
        &[
            "denied: spec.engine.kvCacheDtype [UnsupportedKvCacheDtype]",
            "kvCacheDtype nvfp4 needs compute capability 10.0 or 10.3 (B200/B300); the selected nodes have 12.0 (NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition); use fp8",
        ],
    );
    // Without nodes, the spec's selected products stand for the nodes.
    check(
        &["-f", "deploy/examples/nvfp4-rtx-pro-6000.yaml"],
        1,
        &["use fp8"],
    );
}

#[test]
fn nvfp4_on_b200_is_admitted_with_flashinfer() {
    check(
        &["-f", "deploy/examples/nvfp4-b200.yaml", "--nodes", "deploy/examples/nodes/b200.yaml"],
        0,
        &[
            "admitted",
            "resolved: kvCacheDtype nvfp4, attentionBackend FLASHINFER on compute capability 10.0 (NVIDIA-B200)",
            "nvidia.com/gpu.compute.major In [10]",
            "warning: FLASHINFER on compute capability 10.x downloads TRTLLM/XQA kernels",
        ],
    );
}

#[test]
fn fp8_e4m3_with_vllm_on_rtx_3090_is_denied_with_e5m2_hint() {
    check(
        &[
            "-f",
            "deploy/examples/fp8-e4m3-rtx-3090-vllm.yaml",
            "--nodes",
            "deploy/examples/nodes/rtx-3090.yaml",
        ],
        1,
        &[
            "fp8_e4m3 KV cache is not supported by vLLM's Triton kernels",
            "the selected nodes have 8.6 (NVIDIA-GeForce-RTX-3090); use fp8_e5m2",
        ],
    );
}

#[test]
fn gemma_per_layer_windows_with_flashinfer_are_denied() {
    check(
        &[
            "-f",
            "deploy/examples/gemma3-sliding-window-flashinfer.yaml",
            "--nodes",
            "deploy/examples/nodes/h100.yaml",
        ],
        1,
        &[
            "[PerLayerSlidingWindow]",
            "use attentionBackend FLASH_ATTN or TRITON_ATTN",
        ],
    );
}

#[test]
fn mixed_pool_is_admitted_with_affinity_to_sm90_only() {
    let out = check(
        &[
            "-f",
            "deploy/examples/mixed-pool-fp8-sm90-only.yaml",
            "--nodes",
            "deploy/examples/nodes/mixed-a10-h100.yaml",
        ],
        0,
        &[
            "resolved: kvCacheDtype fp8_e4m3, attentionBackend FLASH_ATTN on compute capability 9.0",
            "nodes: 2 can run it: h100-0, h100-1",
            "node affinity: nvidia.com/gpu.compute.major In [9] and nvidia.com/gpu.compute.minor In [0]\n",
            "warning: 2 of 5 selected GPU nodes can run this; the affinity excludes the others",
        ],
    );
    assert!(!out.contains("In [8]"), "{out}");
}

#[test]
fn max_model_len_that_cannot_fit_one_request_is_denied_by_the_planner() {
    check(
        &["-f", "deploy/examples/long-context-rtx-3090.yaml", "--nodes", "deploy/examples/nodes/rtx-3090.yaml"],
        1,
        &[
            "denied: spec.engine.maxModelLen [KvCacheTooSmall]: maxModelLen 1048576 needs 128.00 GiB of KV cache per GPU for one request",
            "lower maxModelLen to",
            "the selected nodes have NVIDIA-GeForce-RTX-3090 (24.00 GiB)",
        ],
    );
}

#[test]
fn llama_h100_example_is_admitted_by_gpu_flag() {
    check(
        &[
            "-f",
            "deploy/examples/llama-3.1-8b-h100.yaml",
            "--gpu",
            "NVIDIA-H100-80GB-HBM3",
        ],
        0,
        &[
            "attentionBackend KVFLEET_CUDA",
            "capacity: ",
            "KV-cache tokens per replica",
        ],
    );
}

#[test]
fn fp8_checkpoint_on_l4_and_h100_is_admitted_for_vllm_without_the_marlin_warning() {
    for gpu in ["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"] {
        let out = check(
            &["-f", "deploy/examples/fp8-checkpoint-l4-vllm.yaml", "--gpu", gpu],
            0,
            &["capacity: "],
        );
        assert!(!out.contains("Marlin"), "{gpu}: {out}");
    }
}

#[test]
fn fp8_at_load_on_a10_is_admitted_for_vllm_with_the_marlin_warning() {
    check(
        &["-f", "deploy/examples/fp8-at-load-a10-vllm.yaml", "--gpu", "NVIDIA-A10"],
        0,
        &[
            "FP8 weights (engine.quantization fp8) on compute capability 8.6 runs in vLLM as weight-only FP8 through the Marlin kernels",
            "vllm.fp8-weights-marlin-below-sm89",
            "engine.quantization fp8: weights 16.00 GiB in bf16 become",
        ],
    );
}

#[test]
fn fp8_checkpoint_on_a10_is_denied_for_kvfleet_naming_the_gpus_that_can() {
    check(
        &[
            "-f",
            "deploy/examples/fp8-checkpoint-a10-kvfleet.yaml",
            "--gpu",
            "NVIDIA-A10",
        ],
        1,
        &[
            "spec.gpu.selector.minComputeCapability [UnsupportedWeightQuantization]",
            "needs FP8 tensor cores (compute capability 8.9 or newer)",
            "select GPUs that can: L4, L40S, RTX 4090 (8.9), H100, H200 (9.0)",
        ],
    );
    // The same spec selecting GPUs with FP8 tensor cores: the kvfleet runtime serves it.
    let a10 = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples/fp8-checkpoint-a10-kvfleet.yaml"),
    )
    .unwrap();
    for gpu in ["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"] {
        let spec = std::env::temp_dir().join(format!("kvfleet-fp8-{gpu}-{}.yaml", std::process::id()));
        std::fs::write(&spec, a10.replace("NVIDIA-A10", gpu)).unwrap();
        let out = check(
            &["-f", spec.to_str().unwrap(), "--gpu", gpu],
            0,
            &["attentionBackend KVFLEET_CUDA", "capacity: "],
        );
        let _ = std::fs::remove_file(&spec);
        assert!(!out.contains("UnsupportedWeightQuantization"), "{gpu}: {out}");
    }
}

#[test]
fn every_example_documents_a_verdict_that_check_reproduces() {
    // Each example names its command and expected exit code in its header comment.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let body = std::fs::read_to_string(&path).unwrap();
        let Some(cmd) = body
            .lines()
            .find_map(|l| l.trim_start_matches('#').trim().strip_prefix("kvfleet check "))
        else {
            continue;
        };
        let code = if body.contains("DENIED (exit 1)") {
            1
        } else if body.contains("ADMITTED (exit 0)") {
            0
        } else {
            panic!("{} documents no verdict", path.display());
        };
        let args: Vec<&str> = cmd.split_whitespace().collect();
        check(&args, code, &[]);
        seen += 1;
    }
    assert!(seen >= 5, "only {seen} documented examples");
}

#[test]
fn json_output_carries_the_verdict() {
    let o = kvfleet(&[
        "check",
        "-f",
        "deploy/examples/mixed-pool-fp8-sm90-only.yaml",
        "--nodes",
        "deploy/examples/nodes/mixed-a10-h100.yaml",
        "--output",
        "json",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v[0]["allowed"], true);
    assert_eq!(v[0]["verdict"]["resolved"]["computeCapabilities"][0], "9.0");
    assert_eq!(v[0]["verdict"]["compatibleNodes"].as_array().unwrap().len(), 2);
}

#[test]
fn one_denied_document_makes_the_file_exit_1() {
    check(
        &[
            "-f",
            "tests/fixtures/compat/two-deployments.yaml",
            "--gpu",
            "NVIDIA-H100-80GB-HBM3",
        ],
        1,
        &[
            "ok-on-h100 (tests/fixtures/compat/two-deployments.yaml, document 1): admitted",
            "nvfp4-on-h100",
            "document 2): denied",
        ],
    );
}

#[test]
fn unusable_input_exits_2_naming_file_and_field() {
    check(
        &["-f", "tests/fixtures/compat/malformed.yaml", "--gpu", "NVIDIA-L4"],
        2,
        &["malformed.yaml: document 1: not valid YAML"],
    );
    check(
        &[
            "-f",
            "tests/fixtures/compat/unknown-dtype.yaml",
            "--gpu",
            "NVIDIA-L4",
        ],
        2,
        &["unknown-dtype.yaml: document 1: field spec.engine.kvCacheDtype: unknown variant `fp4`"],
    );
    check(
        &[
            "-f",
            "tests/fixtures/compat/missing-field.yaml",
            "--gpu",
            "NVIDIA-L4",
        ],
        2,
        &["missing-field.yaml: document 1: field spec.model.geometry: missing field `kvHeads`"],
    );
    check(
        &[
            "-f",
            "deploy/examples/nvfp4-b200.yaml",
            "--nodes",
            "tests/fixtures/compat/bad-nodes.yaml",
        ],
        2,
        &["bad-nodes.yaml: document 1: field items[0].status.allocatable.nvidia.com/gpu"],
    );
    check(
        &["-f", "tests/fixtures/compat/absent.yaml", "--gpu", "NVIDIA-L4"],
        2,
        &["cannot read tests/fixtures/compat/absent.yaml"],
    );
    check(
        &[
            "-f",
            "deploy/examples/nvfp4-b200.yaml",
            "--gpu",
            "NVIDIA-Imaginary-9000",
        ],
        2,
        &["unknown GPU product \"NVIDIA-Imaginary-9000\""],
    );
    check(
        &["-f", "tests/fixtures/compat/two-deployments.yaml"],
        2,
        &["no nodes to check against"],
    );
    check(&[], 2, &["pass -f FILE"]);
}

#[test]
fn explain_prints_both_rule_sets_with_sources() {
    check(
        &["--explain"],
        0,
        &[
            "vllm.nvfp4-kv-needs-sm100",
            "vllm#43562, vllm#43669 (D)",
            "kvfleet.cuda-needs-sm80",
            "kvfleet kernels/attention/",
            "family 120: TRITON_ATTN > FLASH_ATTN > FLASHINFER",
            "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
        ],
    );
}

// === hostile numbers (issue 22): each a denial naming the field and the bound ===

/// Writes `spec` as an InferenceDeployment into a temporary file and returns its path.
fn spec_file(name: &str, engine: &str, geometry_extra: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvfleet-check-{name}-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "apiVersion: kvfleet.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {{name: {name}}}\nspec:\n  model:\n    name: m\n    geometry: {{layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128{geometry_extra}}}\n  engine: {{{engine}}}\n  gpu: {{selector: {{products: [NVIDIA-H100-80GB-HBM3]}}}}\n"
        ),
    )
    .unwrap();
    path
}

#[test]
fn hostile_sizes_are_denied_quickly_naming_the_field_and_the_bound() {
    let cases = [
        (
            "draft",
            "runtime: kvfleet",
            ", draftLayers: 2147483647",
            "spec.model.geometry.draftLayers 2147483647 is above the maximum 1024",
        ),
        (
            "draft20m",
            "runtime: vllm",
            ", draftLayers: 20000000",
            "spec.model.geometry.draftLayers 20000000 is above the maximum 1024",
        ),
        (
            "tp",
            "runtime: kvfleet, tensorParallelSize: 2147483647",
            "",
            "spec.engine.tensorParallelSize 2147483647 is above the maximum 64",
        ),
        (
            "tpvllm",
            "runtime: vllm, tensorParallelSize: 2147483647",
            "",
            "spec.engine.tensorParallelSize 2147483647 is above the maximum 64",
        ),
        (
            "len",
            "runtime: vllm, maxModelLen: 9223372036854775807",
            "",
            "spec.engine.maxModelLen 9223372036854775807 is above the maximum 33554432",
        ),
        (
            "window",
            "runtime: vllm",
            ", slidingWindow: 2147483647",
            "spec.model.geometry.slidingWindow 2147483647 is above the maximum 33554432",
        ),
    ];
    for (name, engine, extra, message) in cases {
        let path = spec_file(name, engine, extra);
        let start = std::time::Instant::now();
        check(
            &["-f", path.to_str().unwrap()],
            1,
            &["denied", "[ValueOutOfBounds]", message],
        );
        let took = start.elapsed();
        assert!(took < std::time::Duration::from_secs(3), "{name}: {took:?}");
        let _ = std::fs::remove_file(path);
    }
}

/// Writes `yaml` (an InferenceDeployment) into a temporary file and returns its path.
fn yaml_file(name: &str, yaml: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("kvfleet-check-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap();
    path
}

#[test]
fn values_the_crd_schema_forbids_are_denied_naming_the_field_and_the_minimum() {
    // Each passes serde (the types are signed) and was admitted before issue 35.
    let base_path = spec_file("below", "runtime: vllm", "");
    let base = std::fs::read_to_string(&base_path).unwrap();
    let _ = std::fs::remove_file(base_path);
    let cases = [
        (
            "replicas",
            "  replicas: -1\n",
            "spec.replicas -1 is below the minimum 0",
        ),
        (
            "seqs",
            "  engine: {runtime: vllm, maxNumSeqs: 0}\n",
            "spec.engine.maxNumSeqs 0 is below the minimum 1",
        ),
        (
            "draft",
            "",
            "spec.model.geometry.draftLayers -3 is below the minimum 0",
        ),
        (
            "vocab",
            "",
            "spec.model.geometry.vocabSize 0 is below the minimum 1",
        ),
    ];
    for (name, extra, message) in cases {
        let mut yaml = base.replace("  engine: {runtime: vllm}\n", "");
        yaml = match name {
            "draft" => yaml.replace("headDim: 128}", "headDim: 128, draftLayers: -3}"),
            "vocab" => yaml.replace("headDim: 128}", "headDim: 128, vocabSize: 0}"),
            _ => yaml,
        };
        yaml.push_str(extra);
        let path = yaml_file(name, &yaml);
        check(
            &["-f", path.to_str().unwrap()],
            1,
            &["denied", "[ValueOutOfBounds]", message],
        );
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn every_problem_of_a_spec_is_printed_at_once_most_important_first() {
    // nvfp4 KV on sm_120 and a maxModelLen no RTX PRO 6000 holds: the second was printed
    // only once the first was fixed (issue 35).
    let path = yaml_file(
        "two-problems",
        "apiVersion: kvfleet.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: two}\nspec:\n  model:\n    name: m\n    geometry: {layers: 32, queryHeads: 32, kvHeads: 8, headDim: 128}\n    weights: {format: dummy}\n  engine: {runtime: vllm, kvCacheDtype: nvfp4, maxModelLen: 33554432}\n  gpu: {selector: {products: [NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition]}}\n",
    );
    let out = check(
        &["-f", path.to_str().unwrap()],
        1,
        &[
            "denied: spec.engine.kvCacheDtype [UnsupportedKvCacheDtype]",
            "denied: spec.engine.maxModelLen [KvCacheTooSmall]",
            "judged with kvCacheDtype nvfp4 as requested",
        ],
    );
    assert!(
        out.find("[UnsupportedKvCacheDtype]") < out.find("[KvCacheTooSmall]"),
        "{out}"
    );
    let _ = std::fs::remove_file(path);
}

#[test]
fn network_peers_over_the_bound_or_invalid_are_denied_by_check() {
    let base = spec_file("network", "runtime: vllm", "");
    let spec = std::fs::read_to_string(&base).unwrap();
    let peers: Vec<&str> = vec!["{podSelector: {matchLabels: {app: gateway}}}"; 33];
    for (name, allow_from, reason, message) in [
        (
            "many",
            format!("[{}]", peers.join(", ")),
            "[ValueOutOfBounds]",
            "spec.network.allowFrom has 33 peers, more than the maximum 32",
        ),
        (
            "empty-peer",
            "[{}]".to_string(),
            "[InvalidNetworkPeer]",
            "spec.network.allowFrom[0] [InvalidNetworkPeer]: a peer needs a podSelector and/or namespaceSelector, or an ipBlock",
        ),
    ] {
        let path = std::env::temp_dir().join(format!(
            "kvfleet-check-network-{name}-{}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, format!("{spec}  network: {{allowFrom: {allow_from}}}\n")).unwrap();
        check(&["-f", path.to_str().unwrap()], 1, &["denied", reason, message]);
        let _ = std::fs::remove_file(path);
    }
    let _ = std::fs::remove_file(base);
}

// === YAML limits (issue 35) ===

/// A file of `text` in a directory of this test's own.
fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvfleet-check-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_megabyte_of_open_flow_mappings_exits_2_at_the_depth_limit_naming_the_file() {
    // With serde_yaml 0.9 (libyaml) this input took 192 s in a release build; 10 s here is
    // only a guard for a debug build on a busy machine (it takes some 20 ms).
    let path = temp_file("deep.yaml", &"{a: ".repeat(256 * 1024));
    let p = path.to_str().unwrap();
    let started = std::time::Instant::now();
    let out = check(
        &["-f", p],
        2,
        &[
            &format!("error: {p}: document 1, line 1 column "),
            "nested deeper than 64 levels",
        ],
    );
    let elapsed = started.elapsed();
    assert!(elapsed < std::time::Duration::from_secs(10), "{elapsed:?}: {out}");
    // The same file as the node list.
    check(
        &["-f", "deploy/examples/nvfp4-b200.yaml", "--nodes", p],
        2,
        &[
            &format!("{p}: document 1, line 1 column "),
            "nested deeper than 64 levels",
        ],
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn an_input_over_16_mib_exits_2_naming_the_file_and_the_limit() {
    let path = temp_file("big.yaml", &"#".repeat((16 << 20) + 1));
    let p = path.to_str().unwrap();
    check(
        &["-f", p],
        2,
        &[&format!(
            "error: {p}: larger than 16777216 bytes, the most `kvfleet check` reads from one input"
        )],
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_drafter_geometry_is_counted_and_its_absence_warned() {
    let example = "deploy/examples/eagle3-llama-3.1-8b-h100.yaml";
    let with = check(
        &["-f", example],
        0,
        &[
            "eagle3 drafter: weights and buffers",
            "1 layer(s) of K/V on every full-attention page",
        ],
    );
    assert!(!with.contains("draftModel.geometry is not set"), "{with}");
    let body = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(example)).unwrap();
    let bare: String = body
        .lines()
        .filter(|l| {
            !l.contains("geometry: {layers: 1") && !l.contains("intermediateSize: 14336, vocabSize: 32000")
        })
        .collect::<Vec<_>>()
        .join("\n");
    let spec = std::env::temp_dir().join(format!("kvfleet-eagle3-bare-{}.yaml", std::process::id()));
    std::fs::write(&spec, bare).unwrap();
    let without = check(
        &["-f", spec.to_str().unwrap()],
        0,
        &["draftModel.geometry is not set"],
    );
    let _ = std::fs::remove_file(&spec);
    let tokens = |out: &str| -> u64 {
        let at = out.find("capacity: ").expect("a capacity line") + "capacity: ".len();
        out[at..].split_whitespace().next().unwrap().parse().unwrap()
    };
    let (w, wo) = (tokens(&with), tokens(&without));
    assert!(w < wo && (wo - w) * 100 / wo >= 3, "with {w}, without {wo}");
}
