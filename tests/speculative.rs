//! Speculative decoding (n-gram proposals verified in the batched step) through the serving
//! loop on the CPU engine: greedy requests emit exactly the tokens they emit without it
//! (SmolLM2, Gemma 3, under preemption, with stop tokens, penalties and log-probabilities), and
//! sampled requests draw from the same distribution (a two-sample test on a small random model).

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
    let off = runtime(s, limits.clone());
    let on = Arc::new(runtime(
        s,
        CpuLimits {
            speculative: ngram(4),
            ..limits
        },
    ));
    let want: Vec<Stream> = prompts
        .iter()
        .map(|p| run(&off, p.clone(), greedy(max_tokens)))
        .collect();
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
    assert_eq!(together, want);
    spec_stats(&on)
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
    let st = same_greedy_streams(s, &prompts, 48, limits);
    assert!(st.accepted_tokens > 0, "{st:?}");
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
    let (off, on) = (tiny(None), tiny(ngram(5)));
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
        let a = run(&off, tiny_prompt(), params.clone());
        let b = run(&on, tiny_prompt(), params.clone());
        assert_eq!(a.texts, b.texts, "{params:?}");
        assert_eq!(a.end, b.end, "{params:?}");
        assert_eq!(a.completion_tokens, b.completion_tokens, "{params:?}");
        assert_eq!(a.logprobs.len(), b.logprobs.len());
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!(x.0 == y.0 && (x.1 - y.1).abs() < 1e-4, "{x:?} vs {y:?}");
        }
    }
    let st = spec_stats(&on);
    assert!(st.accepted_tokens > 0 && st.drafts > 0, "{st:?}");
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
    for params in cases {
        let (off, on) = (tiny(None), tiny(ngram(3)));
        let a = histograms(&off, N, &params);
        let b = histograms(&on, N, &params);
        let st = spec_stats(&on);
        eprintln!("{params:?}: {st:?}");
        // Speculation ran, and accepted often enough that many draws at the later positions
        // came from verification rows.
        assert!(st.accepted_tokens as usize > N / 8, "{st:?}");
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
