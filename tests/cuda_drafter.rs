//! EAGLE-3 and DFlash drafters on the GPU (issue 36) against the same drafter on the CPU, on
//! SmolLM2-135M (GGUF from env `KVFLEET_SMOLLM2_GGUF`, else `.tools/models/`) and on a random
//! Gemma 3-shaped model (sliding-window and full layers: the drafter's K/V on the full group's
//! pages), with drafter checkpoints made by `tests/fixtures/eagle3/generate.py` (random
//! weights, the target's hidden size).
//!
//! Every test needs an NVIDIA GPU: `cargo test --test cuda_drafter -- --ignored` on the device.
//!
//! The GPU runs the target and the drafter in bf16 (f32 residual streams and accumulation), the
//! CPU in f32: a drafted token can differ where the drafter's two best logits are within bf16
//! rounding of each other. The test feeds both sides the same tokens (the CPU's) so that one
//! such near-tie does not carry into the next comparison, and holds the GPU to the CPU's
//! drafts at all but one position in eight.

use std::path::PathBuf;
use std::sync::Arc;

use kvfleet_cuda::gpu::{DraftReserve, GpuLlama, GpuOptions};
use kvfleet_engine::engine::block::BlockTable;
use kvfleet_engine::engine::capacity::{pool_layout, PoolParams, PoolSize};
use kvfleet_engine::engine::cpu::CpuBackend;
use kvfleet_engine::engine::scheduler::write_plan;
use kvfleet_engine::engine::{KvDtype, StepPlan};
use kvfleet_engine::model::drafter::Drafter;
use kvfleet_engine::model::forward::{CpuForward, Forward};
use kvfleet_engine::model::gguf::Gguf;
use kvfleet_engine::model::llama::{Llama, LlamaConfig, SeqChunk};
use kvfleet_engine::model::proposer::{CatchUp, DraftRow, Proposer};
use kvfleet_engine::model::tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};

fn gguf_path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFLEET_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The drafter-making script: in this checkout, else under the directory the test runs in
/// (a test binary carried to another machine runs from a copy of the repository).
fn generate_py() -> PathBuf {
    let rel = "tests/fixtures/eagle3/generate.py";
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    if here.exists() {
        here
    } else {
        PathBuf::from(rel)
    }
}

/// A drafter's attention heads: query heads, KV heads, head dim.
type Heads = (usize, usize, usize);

/// A random drafter (`kind` eagle3, or dflash with 2 layers) for a target of geometry `c`, with
/// attention heads `heads` (shapes the GPU kernels take), drafting among `draft_tokens`.
fn make_drafter(kind: &str, name: &str, c: &LlamaConfig, heads: Heads, draft_tokens: &[u32]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvfleet-cuda-{kind}-{name}"));
    let tokens: Vec<String> = draft_tokens.iter().map(u32::to_string).collect();
    let n = |v: usize| v.to_string();
    let out = std::process::Command::new("python3")
        .arg(generate_py())
        .args(["--kind", kind, "--out", dir.to_str().unwrap()])
        .args(["--hidden", &n(c.d_model), "--vocab", &n(c.vocab)])
        .args(["--target-layers", &n(c.n_layers)])
        .args(["--heads", &n(heads.0), "--kv-heads", &n(heads.1)])
        .args(["--head-dim", &n(heads.2), "--ff", &n(c.d_ff)])
        .args(["--draft-tokens", &tokens.join(",")])
        .output()
        .expect("python3 runs tests/fixtures/eagle3/generate.py");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    dir
}

/// One request's pages, 16 tokens each.
fn table(seq: u64) -> Vec<BlockTable> {
    vec![BlockTable {
        blocks: (0..8).map(|i| (seq as u32) * 8 + i).collect(),
        freed: 0,
    }]
}

fn plan(t: &[BlockTable], start: usize, len: usize) -> StepPlan {
    let mut p = StepPlan::default();
    write_plan(&mut p, 16, 1, [(t, start, len)]);
    p
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

const PROMPTS: [&str; 3] = [
    "The operator checks what each GPU can run before a pod starts.",
    "List the numbers from one to twenty, separated by commas:",
    "Once upon a time, in a small village by the sea, there lived",
];

/// SmolLM2 on both engines, each with the same script-made drafter of `kind` attached, and the
/// drafter's vocabulary: common English tokens, so that its choices are among a few.
struct Pair {
    tok: Tokenizer,
    draft: Vec<u32>,
    cpu: Engine,
    gpu: Engine,
}

/// A model with its attached drafter's proposer, which the comparisons drive one pass at a time.
struct Engine {
    model: Box<dyn Forward>,
    proposer: Box<dyn Proposer>,
}

impl Engine {
    fn new(mut model: Box<dyn Forward>) -> Self {
        let proposer = model.take_proposer().expect("a drafter is attached");
        Engine { model, proposer }
    }

    /// The drafter's catch-up on `rows` of request `seq`, its pass planned by `draft`; then
    /// the proposal of up to `k` tokens the request has at scheduling.
    fn catch_up(&mut self, seq: u64, rows: &[CatchUp<'_>], k: usize, draft: &Planner) -> (usize, Vec<u32>) {
        self.proposer
            .catch_up(self.model.as_mut(), &[seq], rows, &mut |r, p| {
                *p = draft(r[0].0, r[0].1, r[0].2);
                Ok(())
            })
            .unwrap();
        let mut out = Vec::new();
        let n = self.proposer.propose(seq, &[], k, &mut out);
        (n, out)
    }

    /// `row`'s proposal completed once its pages are allocated, its passes planned by `draft`.
    fn draft(&mut self, mut row: DraftRow, draft: &Planner) -> Vec<u32> {
        self.proposer
            .draft(
                self.model.as_mut(),
                std::slice::from_mut(&mut row),
                &mut |r, p| {
                    *p = draft(r[0].0, r[0].1, r[0].2);
                    Ok(())
                },
            )
            .unwrap();
        row.proposal
    }
}

fn pair(kind: &str) -> Pair {
    let g = Gguf::open(&gguf_path()).expect("SmolLM2 GGUF (see docs/model.md)");
    let model = Arc::new(Llama::from_gguf(&g).unwrap());
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let c = model.config.clone();
    let mut draft: Vec<u32> = tok.encode(" the, of and. to a in is", false);
    draft.sort_unstable();
    draft.dedup();
    let heads = (c.n_heads, c.n_kv_heads, c.head_dim);
    let dir = make_drafter(kind, "smollm2", &c, heads, &draft);
    let pools = pool_layout(
        &c.kv_layers(c.n_kv_heads).unwrap(),
        0,
        &PoolParams::pages(KvDtype::Bf16, 16),
        PoolSize::Pages(64),
    )
    .unwrap();
    let mut cpu = CpuForward::new(model.clone(), CpuBackend::new(pools).unwrap()).unwrap();
    cpu.attach_drafter(Drafter::load(&dir, &c).unwrap()).unwrap();
    let opts = GpuOptions {
        max_kv_tokens: Some(4096),
        max_batched_tokens: 512,
        max_num_seqs: 16,
        ..GpuOptions::default()
    };
    let mut gpu = GpuLlama::from_llama(GpuLlama::open_gpu(0).expect("the GPU"), &model, &opts).unwrap();
    gpu.attach_drafter(Drafter::load(&dir, &c).unwrap()).unwrap();
    assert!(gpu.has_drafter());
    Pair {
        tok,
        draft,
        cpu: Engine::new(Box::new(cpu)),
        gpu: Engine::new(Box::new(gpu)),
    }
}

/// How a comparison's steps are planned for request `seq` over positions `start..start + len`:
/// the target's (every layer group's pages) and the drafter's (the pages it follows).
struct Plans<'a> {
    target: &'a Planner,
    draft: &'a Planner,
}

type Planner = dyn Fn(u64, usize, usize) -> StepPlan;

/// Each prompt prefilled by the target on both engines, caught up by the EAGLE-3 drafter, then
/// chained three drafts further on each drafter's own outputs (the CPU's token fed to both):
/// the drafts of both engines, which must come from the draft vocabulary. Returns how many
/// drafts were equal, and of how many.
fn eagle3_drafts(
    cpu: &mut Engine,
    gpu: &mut Engine,
    draft: &[u32],
    prompts: &[Vec<u32>],
    plans: &Plans,
) -> (usize, usize) {
    let (mut same, mut total) = (0, 0);
    for (i, prompt) in prompts.iter().enumerate() {
        let seq = i as u64 + 1;
        let p = prompt.len();
        let batch = [SeqChunk {
            seq,
            start_pos: 0,
            tokens: prompt,
            logits: 1,
        }];
        let pl = (plans.target)(seq, 0, p);
        let next = argmax(&cpu.model.forward(&batch, &pl).unwrap());
        let gpu_next = argmax(&gpu.model.forward(&batch, &pl).unwrap());
        eprintln!("prompt {i}: {p} tokens, target's next token CPU {next} GPU {gpu_next}");
        // Every prompt position paired with the token after it (the CPU's pick last).
        let mut after: Vec<u32> = prompt[1..].to_vec();
        after.push(next);
        let rows = [CatchUp {
            seq,
            start_pos: 0,
            next: &after,
            row: 0,
            draft: true,
        }];
        let (n, want) = cpu.catch_up(seq, &rows, 4, plans.draft);
        let (m, got) = gpu.catch_up(seq, &rows, 4, plans.draft);
        assert_eq!((n, want.len(), m, got.len()), (4, 1, 4, 1));
        let mut drafts = vec![(want[0], got[0])];
        let mut token = want[0];
        // One chain step at a time, at `pos`, on the CPU's last draft.
        for j in 0..3 {
            let row = DraftRow {
                seq,
                pos: p + j,
                token: 0,
                drafts: 2,
                proposal: vec![token],
            };
            let want = cpu.draft(row.clone(), plans.draft);
            let got = gpu.draft(row, plans.draft);
            drafts.push((want[1], got[1]));
            token = want[1];
        }
        eprintln!("prompt {i}: drafts (CPU, GPU) {drafts:?}");
        assert!(
            drafts.iter().all(|(w, _)| draft.contains(w)),
            "drafts come from the draft vocabulary {draft:?}: {drafts:?}"
        );
        same += drafts.iter().filter(|(w, g)| w == g).count();
        total += drafts.len();
        cpu.proposer.forget(seq);
        gpu.proposer.forget(seq);
    }
    (same, total)
}

/// Each prompt prefilled by the target on both engines, its context K/V written by the DFlash
/// drafter's catch-up, then one block of the newest token and 3 masks: the drafts of both
/// engines, from the draft vocabulary. Returns how many were equal, and of how many.
fn dflash_drafts(
    cpu: &mut Engine,
    gpu: &mut Engine,
    draft: &[u32],
    prompts: &[Vec<u32>],
    plans: &Plans,
) -> (usize, usize) {
    let (mut same, mut total) = (0, 0);
    for (i, prompt) in prompts.iter().enumerate() {
        let seq = i as u64 + 1;
        let p = prompt.len();
        let batch = [SeqChunk {
            seq,
            start_pos: 0,
            tokens: prompt,
            logits: 1,
        }];
        let pl = (plans.target)(seq, 0, p);
        let next = argmax(&cpu.model.forward(&batch, &pl).unwrap());
        gpu.model.forward(&batch, &pl).unwrap();
        let mut after: Vec<u32> = prompt[1..].to_vec();
        after.push(next);
        let rows = [CatchUp {
            seq,
            start_pos: 0,
            next: &after,
            row: 0,
            draft: true,
        }];
        // The catch-up stores context and drafts nothing: the whole block comes at the step.
        assert_eq!(cpu.catch_up(seq, &rows, 3, plans.draft), (3, Vec::new()));
        assert_eq!(gpu.catch_up(seq, &rows, 3, plans.draft), (3, Vec::new()));
        let block = DraftRow {
            seq,
            pos: p,
            token: next,
            drafts: 3,
            proposal: Vec::new(),
        };
        let want = cpu.draft(block.clone(), plans.draft);
        let got = gpu.draft(block, plans.draft);
        eprintln!("prompt {i}: drafts CPU {want:?} GPU {got:?}");
        assert_eq!((want.len(), got.len()), (3, 3));
        assert!(want.iter().all(|w| draft.contains(w)), "{want:?} from {draft:?}");
        same += want.iter().zip(&got).filter(|(w, g)| w == g).count();
        total += want.len();
    }
    (same, total)
}

/// [`eagle3_drafts`] or [`dflash_drafts`].
type Drafts = fn(&mut Engine, &mut Engine, &[u32], &[Vec<u32>], &Plans) -> (usize, usize);

/// SmolLM2 with a drafter of `kind` on both engines: `run`'s drafts of the three prompts, 7 in 8
/// of them equal.
fn on_smollm2(kind: &str, run: Drafts) {
    let Pair {
        tok,
        draft,
        mut cpu,
        mut gpu,
    } = pair(kind);
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|t| tok.encode(t, true)).collect();
    let plans = Plans {
        target: &smollm2_plan,
        draft: &smollm2_plan,
    };
    let (same, total) = run(&mut cpu, &mut gpu, &draft, &prompts, &plans);
    eprintln!("the GPU {kind} drafter drafted the CPU's token {same} times of {total}");
    assert!(8 * same >= 7 * total, "{same} of {total}");
}

/// SmolLM2's plans: one layer group, the drafter on the same pages.
fn smollm2_plan(seq: u64, start: usize, len: usize) -> StepPlan {
    plan(&table(seq), start, len)
}

/// Three prompts, each prefilled by the target on both engines, caught up by the drafter, then
/// chained three drafts further: the GPU drafter drafts what the CPU drafter drafts.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_eagle3_drafter_drafts_what_the_cpu_drafter_drafts() {
    on_smollm2("eagle3", eagle3_drafts);
}

/// A DFlash drafter (2 layers, non-causal blocks) on both engines: three prompts prefilled by the
/// target, their context K/V written by the catch-up, then one block of the newest token and
/// 3 masks each: the GPU drafts what the CPU drafts.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_dflash_drafter_drafts_what_the_cpu_drafter_drafts() {
    on_smollm2("dflash", dflash_drafts);
}

// === Beside a model with sliding-window layers ===

/// A random Gemma 3-shaped target (6 layers: 5 sliding over 24 tokens, then 1 full; hidden 256,
/// 4 query heads over 1 KV head of 256, vocabulary 300) on both engines, with the same random
/// drafter of `kind` attached (attention of 2 query heads over 1 KV head of 128: not the
/// target's shape). The GPU sizes its pools with the drafter reserved, so the drafter's layers
/// join the full group in the split; the CPU's pools have the GPU's groups in the GPU's order,
/// 64 pages each, so one plan serves both (the drafter's plans: the full group's table alone).
struct GemmaPair {
    draft: Vec<u32>,
    cpu: Engine,
    gpu: Engine,
    /// The full-attention group, whose pages the drafter's K/V follow.
    full: usize,
    groups: usize,
}

const GEMMA_WINDOW: usize = 24;

fn gemma_pair(kind: &str) -> GemmaPair {
    let c = LlamaConfig::gemma3(6, 256, 512, 300, GEMMA_WINDOW);
    let model = Arc::new(Llama::dummy(c.clone(), 9).expect("random Gemma 3"));
    let draft: Vec<u32> = vec![3, 17, 42, 99, 150, 201, 256, 299];
    let dir = make_drafter(kind, "gemma3", &c, (2, 1, 128), &draft);
    let opts = GpuOptions {
        max_kv_tokens: Some(4096),
        max_batched_tokens: 512,
        max_num_seqs: 16,
        max_model_len: Some(1024),
        drafter: Some(DraftReserve::of(
            &Drafter::load(&dir, &c).unwrap(),
            KvDtype::Bf16,
            512,
            16,
        )),
        ..GpuOptions::default()
    };
    let mut gpu = GpuLlama::from_llama(GpuLlama::open_gpu(0).expect("the GPU"), &model, &opts)
        .unwrap_or_else(|e| panic!("{e}"));
    gpu.attach_drafter(Drafter::load(&dir, &c).unwrap()).unwrap();
    let cfg = gpu.kv_config().clone();
    let cap = gpu.capacity().clone();
    let full = cfg.draft_group();
    eprintln!(
        "random Gemma 3 with a {kind} drafter: groups {:?}, drafter {} bytes",
        cfg.groups, cap.drafter_bytes
    );
    assert_eq!(cfg.groups.len(), 2, "a sliding and a full group");
    assert_eq!(cfg.groups[full].window, None);
    assert!(cap.drafter_bytes > 0, "the drafter's pool is reserved");
    let mut cpu_pools = cfg.clone();
    for g in &mut cpu_pools.groups {
        g.num_blocks = 64;
    }
    for l in &mut cpu_pools.layers {
        // The GPU may store KV heads more than once for its kernels; the CPU stores the model's.
        l.attn.kv_heads = c.n_kv_heads;
    }
    let mut cpu = CpuForward::new(model.clone(), CpuBackend::new(cpu_pools).unwrap()).unwrap();
    cpu.attach_drafter(Drafter::load(&dir, &c).unwrap()).unwrap();
    GemmaPair {
        draft,
        cpu: Engine::new(Box::new(cpu)),
        gpu: Engine::new(Box::new(gpu)),
        full,
        groups: cfg.groups.len(),
    }
}

/// Prompts of 40, 57 and 70 random tokens: longer than the window, so the sliding layers'
/// features (which the drafters read) differ from full attention's.
fn gemma_prompts() -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(36);
    [40usize, 57, 70]
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(1..300u32)).collect())
        .collect()
}

/// Request `seq`'s page tables, one per group (8 pages of 16 tokens each).
fn tables(seq: u64, groups: usize) -> Vec<BlockTable> {
    (0..groups).map(|_| table(seq).remove(0)).collect()
}

/// The random Gemma 3 with a drafter of `kind` on both engines: `run`'s drafts of the prompts,
/// the target planned over every group's pages, the drafter over the full group's alone; 7 in 8
/// of them equal.
fn beside_gemma(kind: &str, run: Drafts) {
    let GemmaPair {
        draft,
        mut cpu,
        mut gpu,
        full,
        groups,
    } = gemma_pair(kind);
    let target = move |seq: u64, start: usize, len: usize| plan_groups(&tables(seq, groups), start, len);
    let drafter = move |seq: u64, start: usize, len: usize| {
        plan_groups(&tables(seq, groups)[full..full + 1], start, len)
    };
    let plans = Plans {
        target: &target,
        draft: &drafter,
    };
    let (same, total) = run(&mut cpu, &mut gpu, &draft, &gemma_prompts(), &plans);
    eprintln!("beside Gemma 3, the GPU {kind} drafter drafted the CPU's token {same} times of {total}");
    assert!(8 * same >= 7 * total, "{same} of {total}");
}

/// A plan over `tables` (every group) for positions `start..start + len`.
fn plan_groups(tables: &[BlockTable], start: usize, len: usize) -> StepPlan {
    let mut p = StepPlan::default();
    write_plan(&mut p, 16, tables.len(), [(tables, start, len)]);
    p
}

/// EAGLE-3 beside the random Gemma 3: each prompt prefilled by the target on both engines (all
/// groups' pages), caught up by the drafter and chained three drafts further on the full
/// group's pages alone: the GPU drafts what the CPU drafts.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_eagle3_drafter_beside_sliding_window_layers_drafts_what_the_cpu_drafter_drafts() {
    beside_gemma("eagle3", eagle3_drafts);
}

/// DFlash beside the random Gemma 3: context K/V of each prompt written on the full group's
/// pages, then one block of the newest token and 3 masks: the GPU drafts what the CPU drafts.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_dflash_drafter_beside_sliding_window_layers_drafts_what_the_cpu_drafter_drafts() {
    beside_gemma("dflash", dflash_drafts);
}
