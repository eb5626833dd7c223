//! Speculative decoding (n-gram proposals verified in the batched step) through the serving
//! loop on the CPU engine: greedy requests emit exactly the tokens they emit without it
//! (SmolLM2, Gemma 3, under preemption, with stop tokens, penalties and log-probabilities), and
//! sampled requests draw from the same distribution (a two-sample test on a small random model).

mod prom_support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvfleet::serving::metrics::{Metrics, SpecStats};
use kvfleet::serving::runtime::{GenEvent, ModelRuntime};
use kvfleet::serving::serve::{loaded, start_cpu, CpuLimits};
use kvfleet_engine::engine::speculative::SpecConfig;
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::llama::{Llama, LlamaConfig};
use kvfleet_engine::model::sampling::SamplingParams;
use kvfleet_engine::model::tokenizer::{ChatMessage, Tokenizer};

fn model_file(env: &str, name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(".tools/models")
        .join(name);
    assert!(
        p.exists(),
        "{} not found and {env} is unset: run .ci/install-tools",
        p.display()
    );
    p
}

struct Served {
    gguf: Gguf,
    model: Arc<Llama>,
    tokenizer: Tokenizer,
}

fn smollm2() -> &'static Served {
    static S: OnceLock<Served> = OnceLock::new();
    S.get_or_init(|| {
        let g = Gguf::open(&model_file(
            "KVFLEET_SMOLLM2_GGUF",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
        ))
        .unwrap();
        Served {
            model: Arc::new(Llama::from_gguf(&g).unwrap()),
            tokenizer: Tokenizer::from_gguf(&g).unwrap(),
            gguf: g,
        }
    })
}

fn gemma3() -> &'static Served {
    static S: OnceLock<Served> = OnceLock::new();
    S.get_or_init(|| {
        let g = Gguf::open(&model_file("KVFLEET_GEMMA3_GGUF", "gemma-3-270m-q4_k_m.gguf")).unwrap();
        Served {
            model: Arc::new(Llama::from_gguf(&g).unwrap()),
            tokenizer: Tokenizer::from_gguf(&g).unwrap(),
            gguf: g,
        }
    })
}

fn runtime(s: &Served, limits: CpuLimits) -> ModelRuntime {
    let metrics = Arc::new(Metrics::new().unwrap());
    let tokenizer = Tokenizer::from_gguf(&s.gguf).unwrap();
    start_cpu(loaded(s.model.clone(), tokenizer, "m"), limits, metrics).unwrap()
}

fn ngram(k: usize) -> Option<SpecConfig> {
    Some(SpecConfig::ngram(k))
}

/// A request's whole stream: each token's text, the log-probabilities, and the end.
#[derive(Debug, Clone, PartialEq)]
struct Stream {
    texts: Vec<String>,
    logprobs: Vec<(u32, f32)>,
    end: String,
    completion_tokens: usize,
}

fn run(rt: &ModelRuntime, prompt: Vec<u32>, params: SamplingParams) -> Stream {
    let mut rx = rt.generate(prompt, params).unwrap();
    let mut s = Stream {
        texts: Vec::new(),
        logprobs: Vec::new(),
        end: String::new(),
        completion_tokens: 0,
    };
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenEvent::Text(t) => s.texts.push(t),
            GenEvent::Logprobs(lp) => s.logprobs.push((lp.token, lp.logprob)),
            GenEvent::PromptLogprobs(_) => {}
            GenEvent::Done {
                reason,
                text,
                completion_tokens,
                ..
            } => {
                s.end = format!("{} {text:?}", reason.as_str());
                s.completion_tokens = completion_tokens;
                break;
            }
            GenEvent::Error(e) | GenEvent::Unavailable(e) => panic!("{e}"),
        }
    }
    s
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..SamplingParams::default()
    }
}

fn spec_stats(rt: &ModelRuntime) -> SpecStats {
    rt.metrics.live().speculative.expect("speculation is configured")
}

const TEXT: &str = "The operator checks what each GPU can run before a pod starts. It sizes the KV cache \
from the model's layers, keeps sliding-window layers to their window, and routes every request to the \
replica that holds its prefix. Replicas scale on the KV demand of the requests they hold.";

fn chat(tok: &Tokenizer, content: &str) -> Vec<u32> {
    let text = tok
        .apply_chat_template(&[ChatMessage {
            role: "user".into(),
            content: content.into(),
        }])
        .unwrap();
    tok.encode(&text, true)
}

/// Runs `prompts` one at a time without speculation, then all at once with it (verification
/// rows batched with other requests' rows and prefills); every stream must be equal.
fn same_greedy_streams(s: &Served, prompts: &[Vec<u32>], max_tokens: usize, limits: CpuLimits) -> SpecStats {
    let want = alone(s, prompts, max_tokens, &limits);
    same_greedy_streams_as(s, prompts, max_tokens, limits, ngram(4), &want)
}

/// Each prompt's greedy stream without speculation, one request at a time (computed once per
/// prompts and limits: the n-gram and the drafter tests compare with the same streams).
fn alone(s: &Served, prompts: &[Vec<u32>], max_tokens: usize, limits: &CpuLimits) -> Vec<Stream> {
    type Key = (Vec<Vec<u32>>, usize, String);
    static DONE: OnceLock<std::sync::Mutex<HashMap<Key, Vec<Stream>>>> = OnceLock::new();
    let key = (prompts.to_vec(), max_tokens, format!("{limits:?}"));
    let done = DONE.get_or_init(Default::default);
    if let Some(v) = done.lock().unwrap().get(&key) {
        return v.clone();
    }
    let off = runtime(s, limits.clone());
    let v: Vec<Stream> = prompts
        .iter()
        .map(|p| run(&off, p.clone(), greedy(max_tokens)))
        .collect();
    done.lock().unwrap().insert(key, v.clone());
    v
}

/// All `prompts` at once with speculation `spec`: every stream must equal `want`.
fn same_greedy_streams_as(
    s: &Served,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    limits: CpuLimits,
    spec: Option<SpecConfig>,
    want: &[Stream],
) -> SpecStats {
    let on = Arc::new(runtime(
        s,
        CpuLimits {
            speculative: spec,
            ..limits
        },
    ));
    let together: Vec<Stream> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let on = on.clone();
                sc.spawn(move || run(&on, p.clone(), greedy(max_tokens)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let st = spec_stats(&on);
    assert_eq!(together, want, "{st:?}");
    st
}

#[test]
fn smollm2_greedy_tokens_are_the_same_with_ngram_speculation() {
    let s = smollm2();
    let prompts = vec![
        chat(&s.tokenizer, &format!("Repeat this text exactly:\n\n{TEXT}")),
        chat(&s.tokenizer, "What is the capital of France?"),
        chat(
            &s.tokenizer,
            "List the numbers from 1 to 20, separated by commas.",
        ),
    ];
    let st = same_greedy_streams(s, &prompts, 32, CpuLimits::default());
    eprintln!("{st:?}");
    // The copy prompt makes speculation run and pay: many proposed tokens are accepted, and
    // some proposals were accepted whole.
    assert!(st.drafts > 10 && st.accepted_tokens > 25, "{st:?}");
    assert!(st.accepted_per_position[3] > 0, "{st:?}");
}

#[test]
fn gemma3_greedy_tokens_are_the_same_with_ngram_speculation() {
    let s = gemma3();
    // The GGUF carries no chat template: plain text prompts.
    let prompts = vec![
        s.tokenizer
            .encode(&format!("Text: {TEXT}\nThe same text again: "), true),
        s.tokenizer
            .encode("Count from one to ten in words: one, two,", true),
    ];
    let st = same_greedy_streams(s, &prompts, 32, CpuLimits::default());
    eprintln!("{st:?}");
    assert!(st.accepted_tokens > 10, "{st:?}");
}

/// A drafter checkpoint (`kind` eagle3 or dflash, DFlash with 2 layers) with random weights
/// for a target of `hidden` / `vocab` / `layers`, made by `tests/fixtures/eagle3/generate.py`
/// (the layouts their authors and vLLM use), whose draft vocabulary is `draft_tokens`; `aux`
/// overrides the feature layers (EAGLE-3's `eagle_aux_hidden_state_layer_ids`, DFlash's
/// `target_layer_ids`).
fn make_drafter(
    kind: &str,
    name: &str,
    hidden: usize,
    vocab: usize,
    layers: usize,
    aux: Option<&str>,
    draft_tokens: &[u32],
) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{kind}-{name}"));
    let tokens: Vec<String> = draft_tokens.iter().map(u32::to_string).collect();
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eagle3/generate.py"))
        .args(["--kind", kind])
        .args(["--out", dir.to_str().unwrap()])
        .args(["--hidden", &hidden.to_string(), "--vocab", &vocab.to_string()])
        .args(["--target-layers", &layers.to_string()])
        .args([
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--ff",
            "64",
        ])
        .args(["--draft-tokens", &tokens.join(",")]);
    if let Some(a) = aux {
        cmd.args([
            if kind == "dflash" {
                "--target-layer-ids"
            } else {
                "--aux-layers"
            },
            a,
        ]);
    }
    let out = cmd
        .output()
        .expect("python3 runs tests/fixtures/eagle3/generate.py");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

fn eagle3(dir: &std::path::Path, k: usize) -> Option<SpecConfig> {
    drafted_by("eagle3", dir, k)
}

fn dflash(dir: &std::path::Path, k: usize) -> Option<SpecConfig> {
    drafted_by("dflash", dir, k)
}

fn drafted_by(method: &str, dir: &std::path::Path, k: usize) -> Option<SpecConfig> {
    Some(
        SpecConfig::from_json(&format!(
            r#"{{"method":"{method}","num_speculative_tokens":{k},"model":{:?}}}"#,
            dir.to_str().unwrap()
        ))
        .unwrap(),
    )
}

/// The `n` tokens the streams emit most: a random drafter over these proposes tokens the
/// target does emit, so some proposals are accepted and the accept path runs.
fn frequent(tok: &Tokenizer, streams: &[Stream], n: usize) -> Vec<u32> {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for s in streams {
        for t in tok.encode(&s.texts.concat(), false) {
            *counts.entry(t).or_default() += 1;
        }
    }
    let mut v: Vec<(u32, usize)> = counts.into_iter().collect();
    v.sort_by_key(|&(t, c)| (std::cmp::Reverse(c), t));
    v.into_iter().take(n).map(|(t, _)| t).collect()
}

/// Greedy streams of `prompts` batched together with an EAGLE-3 drafter (3 tokens a proposal)
/// and then a DFlash drafter (a block of 4), each made by the script for `s`'s model with the
/// 3 tokens the streams emit most as its draft vocabulary, equal each prompt alone without
/// speculation. The drafters must have run and chained: a random drafter is rarely right on a
/// vocabulary of tens of thousands, so the back-off spaces its proposals out (accepted
/// proposals with drafters are exercised on the tiny model below, where they are often right).
fn drafters_keep_greedy_streams(s: &Served, name: &str, prompts: &[Vec<u32>]) {
    let limits = CpuLimits::default();
    let want = alone(s, prompts, 32, &limits);
    let c = &s.model.config;
    let vocab = frequent(&s.tokenizer, &want, 3);
    for (kind, k) in [("eagle3", 3), ("dflash", 4)] {
        let dir = make_drafter(kind, name, c.d_model, c.vocab, c.n_layers, None, &vocab);
        let st = same_greedy_streams_as(s, prompts, 32, limits.clone(), drafted_by(kind, &dir, k), &want);
        eprintln!("{st:?}");
        assert!(
            st.drafts >= 8 && st.draft_tokens as usize >= (k - 1) * st.drafts as usize,
            "{st:?}"
        );
    }
}

/// SmolLM2 with EAGLE-3 (features of layers 2, 15, 27) and DFlash (context K/V from layers 1,
/// 15, 29: target_layer_ids 0, 14, 28) drafters: each reads SmolLM2's features every step and
/// keeps its own K/V on SmolLM2's pages.
#[test]
fn smollm2_greedy_tokens_are_the_same_with_eagle3_and_dflash_drafters() {
    let s = smollm2();
    let prompts = vec![
        chat(&s.tokenizer, &format!("Repeat this text exactly:\n\n{TEXT}")),
        chat(&s.tokenizer, "What is the capital of France?"),
        chat(
            &s.tokenizer,
            "List the numbers from 1 to 20, separated by commas.",
        ),
    ];
    drafters_keep_greedy_streams(s, "smollm2", &prompts);
}

/// Gemma 3 (sliding-window layers; the drafter's K/V follow the full-attention pages) with
/// EAGLE-3 and DFlash drafters.
#[test]
fn gemma3_greedy_tokens_are_the_same_with_eagle3_and_dflash_drafters() {
    let s = gemma3();
    let prompts = vec![
        s.tokenizer
            .encode(&format!("Text: {TEXT}\nThe same text again: "), true),
        s.tokenizer
            .encode("Count from one to ten in words: one, two,", true),
    ];
    drafters_keep_greedy_streams(s, "gemma3", &prompts);
}

/// A pool too small for every request at once: requests are preempted and recompute while
/// others verify proposals (proposals go first when pages run short), and every greedy stream
/// stays what it is alone, every page comes back.
#[test]
fn greedy_tokens_survive_preemption_with_speculation() {
    let s = smollm2();
    let base = chat(&s.tokenizer, &format!("Repeat this text exactly:\n\n{TEXT}"));
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            let mut p = base.clone();
            p.insert(1, 100 + i);
            p
        })
        .collect();
    let limits = CpuLimits {
        kv_tokens: 2 * 1024,
        max_model_len: Some(1024),
        max_num_batched_tokens: 128,
        ..CpuLimits::default()
    };
    let want = alone(s, &prompts, 48, &limits);
    let st = same_greedy_streams_as(s, &prompts, 48, limits.clone(), ngram(4), &want);
    assert!(st.accepted_tokens > 0, "{st:?}");
    // The drafter's K/V live on the same pages: preempted and recomputed with them.
    let c = &s.model.config;
    let dir = make_drafter(
        "eagle3",
        "smollm2-preempt",
        c.d_model,
        c.vocab,
        c.n_layers,
        None,
        &frequent(&s.tokenizer, &want, 3),
    );
    let st = same_greedy_streams_as(s, &prompts, 48, limits, eagle3(&dir, 3), &want);
    assert!(st.drafts > 0, "{st:?}");
}

/// A small random model with a 16-token vocabulary (byte tokens 0..16): fast enough for many
/// thousand requests, and proposals are accepted often enough to matter.
fn tiny(spec: Option<SpecConfig>) -> ModelRuntime {
    static M: OnceLock<Arc<Llama>> = OnceLock::new();
    let model = M
        .get_or_init(|| {
            let mut cfg = LlamaConfig::llama(2, 32, 64, 4, 2, 16);
            cfg.context_len = 64;
            Arc::new(Llama::dummy(cfg, 11).unwrap())
        })
        .clone();
    let limits = CpuLimits {
        max_num_seqs: 256,
        max_num_batched_tokens: 1024,
        max_model_len: Some(64),
        kv_tokens: 64 * 256,
        speculative: spec.map(|s| SpecConfig {
            disable_by_batch_size: Some(1000),
            ..s
        }),
        ..CpuLimits::default()
    };
    let metrics = Arc::new(Metrics::new().unwrap());
    start_cpu(loaded(model, Tokenizer::bytes_only(), "tiny"), limits, metrics).unwrap()
}

/// The tiny model's prompt: a seed and 30 tokens of the model's own greedy continuation, which
/// runs in loops (`0 1 5 1 5 1 0 ...`), so the n-gram proposer finds what the model is likely to
/// say next, and the model's near-ties between loops keep the draws varied.
fn tiny_prompt() -> Vec<u32> {
    static P: OnceLock<Vec<u32>> = OnceLock::new();
    P.get_or_init(|| {
        let mut p = vec![1, 2, 3, 4, 5];
        let g = run(&tiny(None), p.clone(), greedy(30));
        p.extend(g.texts.iter().map(|t| t.chars().next().map_or(0, |c| c as u32)));
        p
    })
    .clone()
}

/// Greedy streams on the tiny model with every parameter that acts per token: stop tokens
/// inside an accepted run, min_tokens, penalties, logit bias, log-probabilities.
#[test]
fn greedy_streams_with_every_token_parameter_are_the_same_with_speculation() {
    let off = tiny(None);
    for on in [
        tiny(ngram(5)),
        tiny(eagle3(&tiny_drafter("eagle3"), 4)),
        tiny(dflash(&tiny_drafter("dflash"), 4)),
    ] {
        greedy_streams_with_every_token_parameter(&off, &on);
    }
}

/// Drafters for the tiny model (`kind` eagle3 or dflash; 2 layers: features from layers 0, 1,
/// 1), drafting over the whole 16-token vocabulary; made once for all tests.
fn tiny_drafter(kind: &str) -> PathBuf {
    static D: OnceLock<[PathBuf; 2]> = OnceLock::new();
    let [eagle, dflash] = D.get_or_init(|| {
        let all: Vec<u32> = (0..16).collect();
        ["eagle3", "dflash"].map(|k| make_drafter(k, "tiny", 32, 16, 2, Some("0,1,1"), &all))
    });
    if kind == "dflash" { dflash } else { eagle }.clone()
}

fn greedy_streams_with_every_token_parameter(off: &ModelRuntime, on: &ModelRuntime) {
    let cases = [
        greedy(30),
        SamplingParams {
            stop_token_ids: vec![3],
            ..greedy(30)
        },
        SamplingParams {
            stop_token_ids: vec![3],
            min_tokens: 6,
            ..greedy(30)
        },
        SamplingParams {
            frequency_penalty: 0.7,
            presence_penalty: 0.3,
            repetition_penalty: 1.3,
            ..greedy(30)
        },
        SamplingParams {
            logit_bias: vec![(5, 3.0), (2, -1.0)],
            logprobs: Some(3),
            ..greedy(30)
        },
        SamplingParams {
            stop: vec!["\u{7}".into()],
            include_stop_str_in_output: true,
            ..greedy(30)
        },
    ];
    for params in cases {
        let a = run(off, tiny_prompt(), params.clone());
        let b = run(on, tiny_prompt(), params.clone());
        assert_eq!(a.texts, b.texts, "{params:?}");
        assert_eq!(a.end, b.end, "{params:?}");
        assert_eq!(a.completion_tokens, b.completion_tokens, "{params:?}");
        assert_eq!(a.logprobs.len(), b.logprobs.len());
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!(x.0 == y.0 && (x.1 - y.1).abs() < 1e-4, "{x:?} vs {y:?}");
        }
    }
    let st = spec_stats(on);
    eprintln!("{st:?}");
    assert!(st.drafts > 0, "{st:?}");
    // A random DFlash drafter proposes nearly the same token at every mask (the masks share an
    // embedding), which this model seldom emits: its accepted proposals are exercised by the
    // sampled test below. The others are right often enough here.
    if st.method != "dflash" {
        assert!(st.accepted_tokens > 0, "{st:?}");
    }
}

/// Counts of each output position's token over `n` sampled requests, 32 at a time.
fn histograms(rt: &ModelRuntime, n: usize, params: &SamplingParams) -> Vec<HashMap<String, u64>> {
    let mut counts: Vec<HashMap<String, u64>> = vec![HashMap::new(); params.max_tokens];
    for _ in 0..n / 32 {
        let streams: Vec<Stream> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..32)
                .map(|_| sc.spawn(|| run(rt, tiny_prompt(), params.clone())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for s in streams {
            for (pos, t) in s.texts.iter().enumerate() {
                *counts[pos].entry(t.clone()).or_default() += 1;
            }
            // The position after the last token: how the request ended, so that a length
            // difference shows too.
            if s.texts.len() < params.max_tokens {
                *counts[s.texts.len()].entry(format!("end {}", s.end)).or_default() += 1;
            }
        }
    }
    counts
}

/// Sampled requests draw every output token from the target model's distribution with
/// speculation as without it: at each of the first output positions (the first is never
/// speculated, the others come from verification rows) the frequency of every token over
/// 12,800 draws a side differs by less than 5 standard deviations of the difference of two
/// binomial proportions. With plain sampling, with penalties (adjustments that depend on the
/// proposals accepted before a row), and with top-k / top-p / min-p.
#[test]
fn sampled_tokens_follow_the_same_distribution_with_speculation() {
    const N: usize = 12_800;
    // Low temperatures: the random model's logits are close together, and proposals are
    // accepted only where its distribution has a clear favourite.
    let cases = [
        SamplingParams {
            temperature: 0.1,
            max_tokens: 4,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.15,
            max_tokens: 4,
            frequency_penalty: 0.05,
            repetition_penalty: 1.02,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.2,
            top_k: 3,
            top_p: 0.9,
            min_p: 0.05,
            max_tokens: 4,
            ..SamplingParams::default()
        },
    ];
    // The first two cases again with drafters (random weights: they propose what they
    // propose, and the output must still be the target's).
    let drafted = [
        (cases[0].clone(), eagle3(&tiny_drafter("eagle3"), 3)),
        (cases[1].clone(), dflash(&tiny_drafter("dflash"), 3)),
    ];
    let runs = cases.into_iter().map(|p| (p, ngram(3))).chain(drafted);
    for (params, spec) in runs {
        let (off, on) = (tiny(None), tiny(spec));
        let a = histograms(&off, N, &params);
        let b = histograms(&on, N, &params);
        let st = spec_stats(&on);
        eprintln!("{params:?}: {st:?}");
        // Speculation ran for most requests (the draws after the first come from verification
        // rows, a correction or an accepted proposal), and accepted proposals: n-gram and
        // EAGLE-3 often (many draws are accepted proposals), the random DFlash drafter rarely.
        assert!(st.drafts as usize >= N / 2, "{st:?}");
        let least = if st.method == "dflash" { N / 200 } else { N / 8 };
        assert!(st.accepted_tokens as usize > least, "{st:?}");
        let n = (N / 32 * 32) as f64;
        let mut worst = 0f64;
        for (pos, (ha, hb)) in a.iter().zip(&b).enumerate() {
            let keys: std::collections::BTreeSet<&String> = ha.keys().chain(hb.keys()).collect();
            for k in keys {
                let (ca, cb) = (ha.get(k).copied().unwrap_or(0), hb.get(k).copied().unwrap_or(0));
                let p = (ca + cb) as f64 / (2.0 * n);
                let sd = (p * (1.0 - p) * 2.0 / n).sqrt().max(1e-9);
                let z = ((ca as f64 - cb as f64) / n).abs() / sd;
                worst = worst.max(z);
                assert!(
                    z < 5.0,
                    "position {pos}, token {k:?}: {ca} without speculation, {cb} with ({z:.1} sigma); {params:?}"
                );
            }
        }
        eprintln!("largest difference: {worst:.2} sigma");
    }
}

/// `kvfleet worker` itself (the embedded SmolLM2 on the CPU engine): a drafter of the other kind
/// than `method`, or one made for another model, stops the start naming what is wrong, before
/// the port opens; a SmolLM2 EAGLE-3 drafter serves, and vLLM's speculative-decoding counters
/// count its proposals.
#[test]
fn the_worker_checks_its_drafter_at_start_and_serves_with_it() {
    use std::process::{Command, Stdio};
    let s = smollm2();
    let c = &s.model.config;
    let vocab = [198u32, 28, 30];
    let eagle = make_drafter("eagle3", "worker", c.d_model, c.vocab, c.n_layers, None, &vocab);
    let dflash = make_drafter("dflash", "worker", c.d_model, c.vocab, c.n_layers, None, &vocab);
    let spec = |method: &str, dir: &std::path::Path| {
        format!(
            r#"{{"method":"{method}","num_speculative_tokens":3,"model":{:?}}}"#,
            dir.to_str().unwrap()
        )
    };
    let worker = |port: u16, config: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvfleet"));
        cmd.args(["worker", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--speculative-config", config])
            .env_remove("KVFLEET_SPECULATIVE_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd
    };
    for (config, want) in [
        (
            spec("eagle3", &dflash),
            "holds a dflash drafter, the speculative config says method eagle3",
        ),
        (
            spec("eagle3", &tiny_drafter("eagle3")),
            "trained for another model",
        ),
    ] {
        let out = worker(prom_support::free_port(), &config).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains("cannot load the speculative drafter") && err.contains(want),
            "{err}"
        );
    }
    let port = prom_support::free_port();
    let _w = prom_support::Proc(
        worker(port, &spec("eagle3", &eagle)).spawn().unwrap(),
        "kvfleet worker",
    );
    let t0 = std::time::Instant::now();
    while prom_support::http(port, "GET", "/readyz", None).ok().map(|r| r.0) != Some(200) {
        assert!(t0.elapsed().as_secs() < 120, "the worker did not get ready");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let (status, body) = prom_support::http(
        port,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt":"1, 2, 3, 4, 5, 6,","max_tokens":12,"temperature":0}"#),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let (_, metrics) = prom_support::http(port, "GET", "/metrics", None).unwrap();
    let drafts = metrics
        .lines()
        .find(|l| l.starts_with("vllm:spec_decode_num_draft_tokens_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(drafts >= 3.0, "draft tokens counted: {drafts}\n{metrics}");
}
