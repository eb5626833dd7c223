//! Autoscaling simulator (issue 31): replays seeded request traces against simulated kvfleet
//! replicas and compares replica-count policies.
//!
//!     cargo run --release -p kvfleet-core --example autoscale [-- --quick]
//!
//! Replicas use the planner's real numbers (`plan::plan` for Llama-3.1-8B and Gemma 3 27B on
//! one 80 GB H100, bf16 KV, maxModelLen 32768, chunk 8192, block 16: the engine's per-group
//! pools) and the scheduler's admission arithmetic (`plan::blocks_per_request` per group:
//! a request holds cdiv(tokens, 16) blocks in full groups, window-capped in sliding ones;
//! FCFS admission when the first chunk fits; the newest running request is preempted and
//! recomputes when a group runs out). Time and the service model are described in
//! `bench/RESULTS.md` ("Autoscaling policy simulation") and `docs/autoscaling.md`.

use std::collections::VecDeque;

use kvfleet_core::autoscale::{Autoscaler, Observation, Policy, Rules, Sample};
use kvfleet_core::plan::KvCacheDtype;
use kvfleet_core::plan::{
    self, blocks_per_request, EngineParams, Geometry, LayerKind, MemoryInput, PlanInputs, ReportingEra,
};

/// Simulation tick (s).
const DT: f64 = 0.1;
/// Controller period (s): the HPA's default sync period.
const PERIOD: f64 = 15.0;
/// TTFT SLO (s): a second counts against the SLO while a request has waited longer.
const SLO_TTFT: f64 = 2.0;
const MAX_NUM_SEQS: usize = 256;
const MAX_MODEL_LEN: u64 = 32_768;
const CHUNK: u64 = 8_192;
const BLOCK: u32 = 16;
const MAX_REPLICAS: u32 = 16;

// === models ===

struct Group {
    kind: LayerKind,
    num_blocks: u64,
}

struct Model {
    name: &'static str,
    groups: Vec<Group>,
    /// kvfleet's `capacity_tokens` (full-layer-equivalent tokens of one replica).
    capacity_tokens: u64,
    /// vLLM's `num_gpu_blocks` for the same memory (`cache_config_info`).
    vllm_num_gpu_blocks: u64,
    vllm_groups: usize,
    /// Step time = t0 + k x tokens in the step (s).
    t0: f64,
    k: f64,
    cold_start: f64,
    /// Requests per second of one load unit.
    unit_rate: f64,
}

fn model(name: &'static str, config: serde_json::Value, weight_bytes: u64, unit_rate: f64) -> Model {
    let geometry = Geometry::from_hf_config(&config).expect("geometry");
    let inputs = PlanInputs {
        engine: EngineParams {
            tp: 1,
            dtype: KvCacheDtype::Bfloat16,
            block_size: BLOCK,
            max_model_len: MAX_MODEL_LEN,
            max_num_batched_tokens: CHUNK,
        },
        era: ReportingEra::V0_21On,
        memory: MemoryInput::Predict {
            gpu_memory_bytes: plan::gpu_memory_bytes("NVIDIA-H100-80GB-HBM3").expect("H100"),
            gpu_memory_utilization: 0.9,
            weight_bytes_total: Some(weight_bytes),
            activation_reserve_bytes: plan::DEFAULT_ACTIVATION_RESERVE_BYTES,
        },
        request_len: None,
    };
    let p = plan::plan(&geometry, &inputs).expect("plan");
    // Service model (bench/RESULTS.md): Llama-3.1-8B on an H100, 169.5 tok/s at one stream
    // (t0 = 1 / 169.5 s: reading the 16.06 GB of weights, 2.72 TB/s effective) and 16,163
    // tok/s at 256 streams of 130 in / 512 out (a step of 256 / 16,163 s processes 256 decode
    // tokens and 256 x 130 / 512 prefill tokens: k = (15.84 - 5.90) ms / 321 tokens).
    // Another model: t0 scales with its weight bytes (same bandwidth), k with its parameters.
    let llama_bytes = 16.06e9;
    let t0_8b = 1.0 / 169.5;
    let k_8b = (256.0 / 16_163.0 - t0_8b) / (256.0 + 256.0 * 130.0 / 512.0);
    let scale = weight_bytes as f64 / llama_bytes;
    Model {
        name,
        groups: p
            .kvfleet
            .groups
            .iter()
            .map(|g| Group {
                kind: g.kind,
                num_blocks: g.num_blocks,
            })
            .collect(),
        capacity_tokens: p.kvfleet.capacity_tokens,
        vllm_num_gpu_blocks: p.vllm.num_blocks,
        vllm_groups: p.vllm.groups.len(),
        t0: t0_8b * scale,
        k: k_8b * scale,
        // Pod start and CUDA context 5 s, then weights from the node's disk at 2 GB/s.
        cold_start: 5.0 + weight_bytes as f64 / 2e9,
        unit_rate,
    }
}

fn llama_8b() -> Model {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "head_dim": 128, "max_position_embeddings": 131072
    });
    model("Llama-3.1-8B", config, 16_060_000_000, 12.0)
}

fn gemma3_27b() -> Model {
    let config = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
            "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072
        }
    });
    model("Gemma 3 27B", config, 54_000_000_000, 1.0)
}

// === traces ===

/// SplitMix64: a small seeded generator (reproducible tables without a dependency).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-12), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    fn lognormal(&mut self, median: f64, sigma: f64, lo: f64, hi: f64) -> u64 {
        (median * (sigma * self.normal()).exp()).clamp(lo, hi).round() as u64
    }
}

#[derive(Clone, Copy)]
struct Arrival {
    t: f64,
    prompt: u64,
    output: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Trace {
    Step,
    Diurnal,
    Bursts,
}

impl Trace {
    fn name(self) -> &'static str {
        match self {
            Trace::Step => "step 1-8-1",
            Trace::Diurnal => "diurnal",
            Trace::Bursts => "bursts",
        }
    }
    fn duration(self) -> f64 {
        match self {
            Trace::Step => 3600.0,
            Trace::Diurnal => 7200.0,
            Trace::Bursts => 3600.0,
        }
    }
    /// Load in units at time t.
    fn load(self, t: f64, bursts: &[(f64, f64)]) -> f64 {
        match self {
            // 20 min at 1, 20 at 8, 20 at 1.
            Trace::Step => {
                if (1200.0..2400.0).contains(&t) {
                    8.0
                } else {
                    1.0
                }
            }
            // A day in 2 h: trough 1 at night, peak 8 in the afternoon.
            Trace::Diurnal => {
                let phase = t / 7200.0 * 2.0 * std::f64::consts::PI;
                1.0 + 3.5 * (1.0 - phase.cos())
            }
            // Base 2 with bursts to 8 lasting 60-180 s.
            Trace::Bursts => {
                if bursts.iter().any(|&(s, d)| t >= s && t < s + d) {
                    8.0
                } else {
                    2.0
                }
            }
        }
    }
}

fn arrivals(trace: Trace, unit_rate: f64, seed: u64) -> Vec<Arrival> {
    let mut rng = Rng(seed);
    let mut bursts = Vec::new();
    let mut s = 300.0;
    while s < trace.duration() - 300.0 {
        let d = 60.0 + 120.0 * rng.uniform();
        bursts.push((s, d));
        s += d + 240.0 + 480.0 * rng.uniform();
    }
    // Thinning of a Poisson process at the peak rate.
    let peak = 8.0 * unit_rate;
    let mut out = Vec::new();
    let mut t = 0.0;
    loop {
        t += -(1.0 - rng.uniform()).ln() / peak;
        if t >= trace.duration() {
            break;
        }
        if rng.uniform() * 8.0 < trace.load(t, &bursts) {
            out.push(Arrival {
                t,
                // Chat-like: median 1,000 prompt and 300 output tokens, long tails.
                prompt: rng.lognormal(1000.0, 0.8, 16.0, 12_000.0),
                output: rng.lognormal(300.0, 0.7, 8.0, 2_000.0),
            });
        }
    }
    out
}

// === replicas ===

#[derive(Clone)]
struct Req {
    arrival: f64,
    prompt: u64,
    output: u64,
    generated: f64,
    /// Tokens to (re)compute before decoding: the prompt, or prompt + generated after a preemption.
    first_token: Option<f64>,
}

impl Req {
    fn held(&self) -> u64 {
        self.prompt + self.generated as u64
    }
}

struct Replica {
    ready_at: f64,
    draining: bool,
    running: Vec<Req>,
    waiting: VecDeque<Req>,
    used: Vec<u64>,
    /// Per group, blocks the running and waiting requests need to finish (kept incrementally).
    need: Vec<u64>,
}

impl Replica {
    fn ready(&self, t: f64) -> bool {
        t >= self.ready_at
    }
    fn account(&mut self, m: &Model, r: &Req, add: bool) {
        for g in 0..m.groups.len() {
            let b = blocks(m, g, r.prompt + r.output);
            if add {
                self.need[g] += b;
            } else {
                self.need[g] -= b;
            }
        }
    }
}

fn blocks(m: &Model, g: usize, tokens: u64) -> u64 {
    blocks_per_request(m.groups[g].kind, tokens, CHUNK, BLOCK)
}

/// kvfleet's demand gauge: the KV every running and waiting request needs to finish, as the
/// fraction of its binding group, in full-layer-equivalent tokens.
fn kv_demand_tokens(m: &Model, r: &Replica) -> u64 {
    let frac = (0..m.groups.len())
        .map(|g| r.need[g] as f64 / m.groups[g].num_blocks as f64)
        .fold(0.0, f64::max);
    (frac * m.capacity_tokens as f64) as u64
}

/// One request's demand in full-layer-equivalent tokens (the router's gauge for its queue).
fn req_demand_tokens(m: &Model, r: &Req) -> u64 {
    let frac = (0..m.groups.len())
        .map(|g| blocks(m, g, r.prompt + r.output) as f64 / m.groups[g].num_blocks as f64)
        .fold(0.0, f64::max);
    (frac * m.capacity_tokens as f64) as u64
}

// === policies ===

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// Target demand ratio and scale-down stabilization window (s).
    Kvfleet(f64, u32),
    /// llm-d's deprecated token utilisation: tokens held / (num_gpu_blocks x block_size).
    TokenUtil,
    /// KEDA: requests waiting (workers' num_requests_waiting plus the router's queue),
    /// AverageValue 10 per replica.
    Keda,
    /// Replays a schedule that knows the trace.
    Oracle,
}

impl Kind {
    fn label(self) -> String {
        match self {
            Kind::Kvfleet(t, w) => format!("kvfleet (target {t}, down window {w} s)"),
            Kind::TokenUtil => "llm-d token util (blocks x block_size)".into(),
            Kind::Keda => "KEDA waiting > 10".into(),
            Kind::Oracle => "oracle".into(),
        }
    }
}

struct Outcome {
    replica_seconds: f64,
    preempt_seconds: f64,
    slo_seconds: f64,
    scale_events: u32,
    peak: u32,
    ttft_p99: f64,
    /// Total kvfleet demand (tokens) per controller period: the oracle's input.
    demand: Vec<u64>,
}

fn simulate(m: &Model, trace: &[Arrival], duration: f64, kind: Kind, schedule: &[u32]) -> Outcome {
    let policy = Policy {
        target_demand_ratio: match kind {
            Kind::Kvfleet(t, _) => t,
            Kind::TokenUtil => 0.8,
            _ => 1.0,
        },
        scale_up: Rules::default_up(),
        scale_down: Rules {
            stabilization_window_seconds: match kind {
                Kind::Kvfleet(_, w) => w,
                _ => 300,
            },
            ..Rules::default_down()
        },
        ..Policy::with_bounds(1, MAX_REPLICAS)
    };
    let mut scaler = Autoscaler::default();
    let new_replica = |ready_at: f64| Replica {
        ready_at,
        draining: false,
        running: Vec::new(),
        waiting: VecDeque::new(),
        used: vec![0; m.groups.len()],
        need: vec![0; m.groups.len()],
    };
    let start = match kind {
        Kind::Oracle => schedule[0].max(1),
        _ => 1,
    };
    let mut fleet: Vec<Replica> = (0..start).map(|_| new_replica(0.0)).collect();
    let mut router: VecDeque<Req> = VecDeque::new();
    let mut next = 0;
    let mut out = Outcome {
        replica_seconds: 0.0,
        preempt_seconds: 0.0,
        slo_seconds: 0.0,
        scale_events: 0,
        peak: start,
        ttft_p99: 0.0,
        demand: Vec::new(),
    };
    let mut ttfts: Vec<f64> = Vec::new();
    let forward_always = std::env::var("AUTOSCALE_FORWARD_ALWAYS").is_ok_and(|v| v == "1");
    let mut period_demand = 0u64;
    let steps = (duration / DT).round() as usize;
    for step in 0..steps {
        let t = step as f64 * DT;
        // Route: arrivals and the router's queue go to the ready replica with the least demand.
        while next < trace.len() && trace[next].t < t + DT {
            let a = trace[next];
            router.push_back(Req {
                arrival: a.t,
                prompt: a.prompt,
                output: a.output,
                generated: 0.0,
                first_token: None,
            });
            next += 1;
        }
        while let Some(r) = router.pop_front() {
            let best = fleet
                .iter()
                .enumerate()
                .filter(|(_, x)| x.ready(t) && !x.draining)
                .min_by_key(|(_, x)| kv_demand_tokens(m, x))
                .map(|(i, _)| i);
            // The router holds a request while the least-loaded replica cannot take its demand
            // (AUTOSCALE_FORWARD_ALWAYS=1 forwards anyway: worker queues, no migration).
            let best = best.filter(|&i| {
                forward_always
                    || kv_demand_tokens(m, &fleet[i]) + req_demand_tokens(m, &r) <= m.capacity_tokens
            });
            match best {
                Some(i) => {
                    fleet[i].account(m, &r, true);
                    fleet[i].waiting.push_back(r);
                }
                None => {
                    router.push_front(r);
                    break;
                }
            }
        }
        let mut preempted = false;
        for rep in fleet.iter_mut().filter(|x| x.ready(t)) {
            // Admission: FCFS while the head's first chunk fits in every group.
            let mut prefill = 0u64;
            while rep.running.len() < MAX_NUM_SEQS && !rep.draining {
                let Some(head) = rep.waiting.front() else { break };
                // The whole prompt is prefilled within the tick here, so all of it must fit
                // (the engine checks the first chunk; prompts past 8,192 tokens are rare here).
                let fits = (0..m.groups.len())
                    .all(|g| rep.used[g] + blocks(m, g, head.held()) <= m.groups[g].num_blocks);
                if !fits {
                    break;
                }
                let Some(mut r) = rep.waiting.pop_front() else {
                    break;
                };
                prefill += r.held();
                for g in 0..m.groups.len() {
                    rep.used[g] += blocks(m, g, r.held());
                }
                if r.first_token.is_none() {
                    r.first_token = Some(t + m.t0 + m.k * prefill as f64);
                    ttfts.push(t + m.t0 + m.k * prefill as f64 - r.arrival);
                }
                rep.running.push(r);
            }
            // Decode: the tick's time after the prefill work, in steps of t0 + k x batch.
            let b = rep.running.len();
            if b > 0 {
                // Prefill shares steps with decodes: at least the steps of full 8,192-token
                // chunks pass, so decodes progress under a prefill backlog too.
                let steps = ((DT - m.k * prefill as f64) / (m.t0 + m.k * b as f64))
                    .max(DT / (m.t0 + m.k * CHUNK as f64));
                let tokens_per_req = steps;
                for r in rep.running.iter_mut() {
                    r.generated = (r.generated + tokens_per_req).min(r.output as f64);
                }
            }
            let mut i = 0;
            while i < rep.running.len() {
                if rep.running[i].generated >= rep.running[i].output as f64 {
                    let r = rep.running.remove(i);
                    rep.account(m, &r, false);
                } else {
                    i += 1;
                }
            }
            // Pages for the tokens now held; the newest request yields when a group is short.
            loop {
                for g in 0..m.groups.len() {
                    rep.used[g] = rep.running.iter().map(|r| blocks(m, g, r.held())).sum();
                }
                let over = (0..m.groups.len()).any(|g| rep.used[g] > m.groups[g].num_blocks);
                if !over {
                    break;
                }
                let Some(victim) = rep.running.pop() else { break };
                preempted = true;
                rep.waiting.push_front(victim);
            }
        }
        // Draining replicas leave once empty; their queues go back to the router.
        for rep in fleet.iter_mut().filter(|x| x.draining) {
            while let Some(r) = rep.waiting.pop_back() {
                rep.account(m, &r, false);
                router.push_front(r);
            }
        }
        fleet.retain(|x| !(x.draining && x.running.is_empty()));
        out.replica_seconds += fleet.len() as f64 * DT;
        if preempted {
            out.preempt_seconds += DT;
        }
        let late = router
            .iter()
            .chain(fleet.iter().flat_map(|x| x.waiting.iter()))
            .any(|r| t - r.arrival > SLO_TTFT);
        if late {
            out.slo_seconds += DT;
        }
        let demand: u64 = fleet.iter().map(|x| kv_demand_tokens(m, x)).sum::<u64>()
            + router.iter().map(|r| req_demand_tokens(m, r)).sum::<u64>();
        period_demand = period_demand.max(demand);

        // The controller, once per period.
        if step % (PERIOD / DT).round() as usize == 0 {
            out.demand.push(period_demand);
            period_demand = 0;
            let current = fleet.iter().filter(|x| !x.draining).count() as u32;
            let ready: Vec<&Replica> = fleet.iter().filter(|x| x.ready(t) && !x.draining).collect();
            let desired = match kind {
                Kind::Oracle => schedule[(step as f64 * DT / PERIOD) as usize].max(1),
                _ => {
                    let samples: Vec<Sample> = ready
                        .iter()
                        .map(|x| match kind {
                            Kind::TokenUtil => Sample {
                                demand_tokens: x.running.iter().map(Req::held).sum(),
                                capacity_tokens: m.vllm_num_gpu_blocks * u64::from(BLOCK),
                            },
                            Kind::Keda => Sample {
                                demand_tokens: x.waiting.len() as u64 * 1000,
                                capacity_tokens: 10_000,
                            },
                            _ => Sample {
                                demand_tokens: kv_demand_tokens(m, x),
                                capacity_tokens: m.capacity_tokens,
                            },
                        })
                        .collect();
                    let pending = match kind {
                        // The queue the router holds counts as waiting (EPP flow control's queue).
                        Kind::Keda => router.len() as u64 * 1000,
                        // In its own units: the queued requests' tokens.
                        Kind::TokenUtil => router.iter().map(|r| r.prompt + r.output).sum(),
                        _ => router.iter().map(|r| req_demand_tokens(m, r)).sum(),
                    };
                    let obs = Observation {
                        now_seconds: t,
                        current_replicas: current,
                        ready: samples,
                        pending_demand_tokens: pending,
                        capacity_hint_tokens: Some(m.capacity_tokens),
                    };
                    scaler.decide(&policy, &obs).desired
                }
            };
            if desired != current {
                out.scale_events += 1;
            }
            if desired > current {
                for _ in current..desired {
                    fleet.push(new_replica(t + m.cold_start));
                }
            } else {
                // Not-ready replicas go first (as a ReplicaSet picks), then the least loaded.
                for _ in desired..current {
                    let pick = fleet
                        .iter()
                        .enumerate()
                        .filter(|(_, x)| !x.draining)
                        .min_by_key(|(_, x)| (x.ready(t), x.running.len() + x.waiting.len()))
                        .map(|(i, _)| i);
                    if let Some(i) = pick {
                        fleet[i].draining = true;
                    }
                }
            }
            out.peak = out.peak.max(fleet.iter().filter(|x| !x.draining).count() as u32);
            if std::env::var("AUTOSCALE_DEBUG").is_ok_and(|v| v == kind.label()) && step % 600 == 0 {
                eprintln!(
                    "t {t:.0} replicas {} ready {} running {:?} waiting {:?} router {} used {:?} need {:?} preempt_s {:.1}",
                    fleet.len(),
                    fleet.iter().filter(|x| x.ready(t)).count(),
                    fleet.iter().map(|x| x.running.len()).collect::<Vec<_>>(),
                    fleet.iter().map(|x| x.waiting.len()).collect::<Vec<_>>(),
                    router.len(),
                    fleet.iter().map(|x| x.used.clone()).collect::<Vec<_>>(),
                    fleet.iter().map(|x| x.need.clone()).collect::<Vec<_>>(),
                    out.preempt_seconds
                );
            }
        }
    }
    ttfts.sort_by(f64::total_cmp);
    out.ttft_p99 = ttfts.get(ttfts.len() * 99 / 100).copied().unwrap_or(0.0);
    out
}

/// The oracle's schedule: per period the fewest replicas that hold its KV demand (measured with
/// every replica up, at 100% of capacity) and do its work (GPU seconds of its arrivals at a full
/// batch), started a cold start plus one period ahead.
fn oracle_schedule(m: &Model, demand: &[u64], trace: &[Arrival], periods: usize) -> Vec<u32> {
    let mean_len = trace.iter().map(|a| a.prompt + a.output).sum::<u64>() / trace.len().max(1) as u64;
    let full_batch = (0..m.groups.len())
        .map(|g| m.groups[g].num_blocks / blocks(m, g, mean_len).max(1))
        .min()
        .unwrap_or(1)
        .clamp(1, MAX_NUM_SEQS as u64) as f64;
    let mut work = vec![0.0f64; periods];
    for a in trace {
        let i = ((a.t / PERIOD) as usize).min(periods - 1);
        work[i] += m.k * (a.prompt + a.output) as f64 + a.output as f64 * m.t0 / full_batch;
    }
    let need: Vec<u32> = (0..periods)
        .map(|i| {
            // demand[i + 1] is the peak over period i (recorded at its end).
            let d = demand.get(i + 1).copied().unwrap_or(0);
            let kv = d.div_ceil(m.capacity_tokens) as u32;
            let compute = (work[i] / PERIOD).ceil() as u32;
            kv.max(compute).clamp(1, MAX_REPLICAS)
        })
        .collect();
    let lead = ((m.cold_start + PERIOD) / PERIOD).ceil() as usize;
    (0..periods)
        .map(|i| {
            need[i..(i + lead + 1).min(periods)]
                .iter()
                .copied()
                .max()
                .unwrap_or(1)
        })
        .collect()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let variants: &[(f64, u32)] = if quick {
        &[(0.8, 300)]
    } else {
        &[(0.8, 300), (0.9, 300), (0.8, 120), (0.9, 120)]
    };
    println!("| model | trace | policy | replica-s | vs oracle | preempt s | SLO s (TTFT > {SLO_TTFT} s) | scale events | peak | TTFT p99 (s) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for m in [llama_8b(), gemma3_27b()] {
        eprintln!(
            "{}: kvfleet groups {:?}, capacity {} tokens, vLLM num_gpu_blocks {} in {} groups (x16 = {} tokens), step {:.2} ms + {:.4} ms/token, cold start {:.0} s",
            m.name,
            m.groups.iter().map(|g| (g.kind.label(), g.num_blocks)).collect::<Vec<_>>(),
            m.capacity_tokens,
            m.vllm_num_gpu_blocks,
            m.vllm_groups,
            m.vllm_num_gpu_blocks * u64::from(BLOCK),
            m.t0 * 1e3,
            m.k * 1e3,
            m.cold_start
        );
        for trace in [Trace::Step, Trace::Diurnal, Trace::Bursts] {
            let arr = arrivals(trace, m.unit_rate, 31);
            let d = trace.duration();
            // Oracle: KV demand measured with every replica up, work from the trace itself.
            let periods = (d / PERIOD) as usize + 2;
            let full = vec![MAX_REPLICAS; periods];
            let measured = simulate(&m, &arr, d, Kind::Oracle, &full);
            let schedule = oracle_schedule(&m, &measured.demand, &arr, periods);
            let oracle = simulate(&m, &arr, d, Kind::Oracle, &schedule);
            let mut rows = vec![(Kind::Oracle, oracle)];
            for &(target, window) in variants {
                let kind = Kind::Kvfleet(target, window);
                rows.push((kind, simulate(&m, &arr, d, kind, &[])));
            }
            rows.push((Kind::TokenUtil, simulate(&m, &arr, d, Kind::TokenUtil, &[])));
            rows.push((Kind::Keda, simulate(&m, &arr, d, Kind::Keda, &[])));
            let base = rows[0].1.replica_seconds;
            for (kind, o) in &rows {
                println!(
                    "| {} | {} | {} | {:.0} | {:.2}x | {:.1} | {:.1} | {} | {} | {:.2} |",
                    m.name,
                    trace.name(),
                    kind.label(),
                    o.replica_seconds,
                    o.replica_seconds / base,
                    o.preempt_seconds,
                    o.slo_seconds,
                    o.scale_events,
                    o.peak,
                    o.ttft_p99
                );
            }
        }
    }
}
