//! Host planning of one step: a CSR batch becomes work items (one CTA per item and KV head)
//! and merge jobs for split-KV partials. Planned once per step on the host; the kernels only
//! run it. Pure.

use super::spec::{Arch, KernelSpec};
use super::CudaError;

/// A batch in CSR form, host side (the same arrays are uploaded for the kernels).
///
/// `u32`, as the engine writes them (`engine::layout::GroupTable`: page ids are `u32` and
/// positions and offsets never negative), so a step's tables cross to the device with no
/// conversion. The kernels read them as `int`: [`CsrBatch::validate`] refuses a value past
/// `i32::MAX`, which no pool reaches (a slot `page * block_size + offset` fits `u32`, so a
/// page id of pages of 16 tokens is below 2^28, and positions are below the context length).
#[derive(Clone, Debug, Default)]
pub struct CsrBatch {
    /// `[B+1]` offsets into packed Q/O rows `[total_q, q_heads, head_dim]`.
    pub qo_indptr: Vec<u32>,
    /// `[B+1]` offsets into `kv_indices`.
    pub kv_indptr: Vec<u32>,
    /// Page ids, request by request, in position order.
    pub kv_indices: Vec<u32>,
    /// `[B]` tokens held in each request's last page (1..=page size when it has pages).
    pub kv_last_page_len: Vec<u32>,
    /// `[B]` absolute position of the first held token (non-zero once leading pages were freed).
    pub kv_first_pos: Vec<u32>,
}

impl CsrBatch {
    pub fn num_requests(&self) -> usize {
        self.kv_last_page_len.len()
    }

    pub fn q_len(&self, r: usize) -> usize {
        (self.qo_indptr[r + 1] - self.qo_indptr[r]) as usize
    }

    /// Keys held by request `r`.
    pub fn num_keys(&self, r: usize, page: usize) -> usize {
        let pages = (self.kv_indptr[r + 1] - self.kv_indptr[r]) as usize;
        if pages == 0 {
            0
        } else {
            (pages - 1) * page + self.kv_last_page_len[r] as usize
        }
    }

    pub fn total_q(&self) -> usize {
        self.qo_indptr.last().copied().unwrap_or(0) as usize
    }

    /// Checks every invariant the kernels rely on; a bad batch is an error, never a bad read.
    pub fn validate(&self, page: usize, num_blocks: usize) -> Result<(), CudaError> {
        let b = self.kv_last_page_len.len();
        let bad = |m: String| Err(CudaError::InvalidBatch(m));
        if self.qo_indptr.len() != b + 1 || self.kv_indptr.len() != b + 1 || self.kv_first_pos.len() != b {
            return bad(format!(
                "array lengths disagree: qo_indptr {}, kv_indptr {}, kv_last_page_len {}, kv_first_pos {} (want B+1, B+1, B, B)",
                self.qo_indptr.len(),
                self.kv_indptr.len(),
                b,
                self.kv_first_pos.len()
            ));
        }
        if self.qo_indptr[0] != 0 || self.kv_indptr[0] != 0 {
            return bad("indptr arrays must start at 0".into());
        }
        if self.kv_indptr[b] as usize != self.kv_indices.len() {
            return bad("kv_indptr[B] must equal kv_indices.len()".into());
        }
        if self.qo_indptr[b] > i32::MAX as u32 || self.kv_indptr[b] > i32::MAX as u32 {
            return bad("more rows or pages in one step than the kernels' int counts".into());
        }
        for r in 0..b {
            if self.qo_indptr[r + 1] < self.qo_indptr[r] || self.kv_indptr[r + 1] < self.kv_indptr[r] {
                return bad(format!("request {r}: indptr decreases"));
            }
            let pages = self.kv_indptr[r + 1] - self.kv_indptr[r];
            let last = self.kv_last_page_len[r];
            if pages > 0 && !(1..=page as u32).contains(&last) {
                return bad(format!("request {r}: kv_last_page_len {last} outside 1..={page}"));
            }
            if self.kv_first_pos[r] > i32::MAX as u32 {
                return bad(format!(
                    "request {r}: kv_first_pos {} past the kernels' int",
                    self.kv_first_pos[r]
                ));
            }
            let keys = self.num_keys(r, page);
            if self.q_len(r) > self.kv_first_pos[r] as usize + keys {
                return bad(format!(
                    "request {r}: {} query tokens but only {keys} keys held",
                    self.q_len(r)
                ));
            }
            if self.q_len(r) > keys {
                return bad(format!(
                    "request {r}: query tokens must have their own keys appended first"
                ));
            }
        }
        if let Some(p) = self
            .kv_indices
            .iter()
            .find(|p| **p as usize >= num_blocks || **p > i32::MAX as u32)
        {
            return bad(format!("page id {p} outside the pool of {num_blocks} blocks"));
        }
        Ok(())
    }
}

/// One CTA's work (times KV heads). `repr(C)`, 8 x i32, mirrored by `WorkItem` in
/// `kernels/attention/common.cuh` (the kernels read it as one 32-byte struct).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct WorkItem {
    pub request: i32,
    pub row_base: i32,
    pub key_begin: i32,
    pub key_end: i32,
    /// Partial slot for split-KV, or -1: the CTA writes O directly.
    pub slot: i32,
    /// The merge job (index into [`LaunchPlan::merges`]) that combines `slot`, or -1 without
    /// one: `kvf_decode` counts the CTAs of a job with it and its last CTA runs the merge.
    pub merge: i32,
    pub pad: [i32; 2],
}

/// Combines `slot_count` partial slots of one request. Mirrored by `MergeJob` in the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct MergeJob {
    pub request: i32,
    pub slot_begin: i32,
    pub slot_count: i32,
    pub pad: i32,
}

const _: () = assert!(std::mem::size_of::<WorkItem>() == 32 && std::mem::size_of::<MergeJob>() == 16);

/// How one step's batch runs on the device (the engine's `StepPlan` is the step itself):
/// `items[..n_prefill]` are prefill CTAs, the rest decode CTAs.
#[derive(Clone, Debug, Default)]
pub struct LaunchPlan {
    pub items: Vec<WorkItem>,
    pub n_prefill: usize,
    pub merges: Vec<MergeJob>,
    pub n_slots: usize,
}

impl LaunchPlan {
    pub fn items_as_i32(&self) -> Vec<i32> {
        self.items
            .iter()
            .flat_map(|w| {
                [
                    w.request,
                    w.row_base,
                    w.key_begin,
                    w.key_end,
                    w.slot,
                    w.merge,
                    0,
                    0,
                ]
            })
            .collect()
    }

    pub fn merges_as_i32(&self) -> Vec<i32> {
        self.merges
            .iter()
            .flat_map(|m| [m.request, m.slot_begin, m.slot_count, 0])
            .collect()
    }
}

/// Plans a step for kernels built for `arch` (prefill rows per item depend on it). `slots` is how many decode CTAs the GPU holds at once (SMs x the decode
/// kernel's occupancy, [`super::device::Kernels::decode_slots`]); long decode requests are split
/// into chunks of whole tiles, sized by [`decode_chunk_tiles`] so the CTAs fill whole waves.
pub fn plan_step(
    batch: &CsrBatch,
    spec: &KernelSpec,
    arch: Arch,
    kv_heads: usize,
    slots: usize,
) -> LaunchPlan {
    let g = spec.group.get();
    let page = spec.page.get();
    let tile = spec.tile_keys();
    let prefill_rows = spec.prefill_rows_on(arch);
    let mut prefill: Vec<(usize, WorkItem)> = Vec::new();
    let mut decode_reqs = Vec::new();
    for r in 0..batch.num_requests() {
        let rows = batch.q_len(r) * g;
        let keys = batch.num_keys(r, page);
        if rows == 0 {
            continue;
        }
        if rows <= spec.decode_rows() {
            decode_reqs.push(r);
        } else {
            let mut base = 0;
            while base < rows {
                // work ~ keys visible to the tile's last token (causal) or all keys
                let last_tok = ((base + prefill_rows).min(rows) - 1) / g;
                let work = if spec.mask.causal() {
                    keys - batch.q_len(r) + last_tok + 1
                } else {
                    keys
                };
                prefill.push((
                    work,
                    WorkItem {
                        request: r as i32,
                        row_base: base as i32,
                        key_begin: 0,
                        key_end: keys as i32,
                        slot: -1,
                        merge: -1,
                        pad: [0; 2],
                    },
                ));
                base += prefill_rows;
            }
        }
    }
    // heaviest first so the long causal tiles do not form the tail
    prefill.sort_by_key(|w| std::cmp::Reverse(w.0));
    let mut plan = LaunchPlan {
        n_prefill: prefill.len(),
        ..Default::default()
    };
    plan.items.extend(prefill.into_iter().map(|(_, w)| w));

    let tiles: Vec<usize> = decode_reqs
        .iter()
        .map(|&r| batch.num_keys(r, page).div_ceil(tile))
        .collect();
    let chunk = decode_chunk_tiles(&tiles, kv_heads, slots) * tile;
    for r in decode_reqs {
        let keys = batch.num_keys(r, page);
        let n_chunks = keys.div_ceil(chunk).max(1);
        if n_chunks == 1 {
            plan.items.push(WorkItem {
                request: r as i32,
                row_base: 0,
                key_begin: 0,
                key_end: keys as i32,
                slot: -1,
                merge: -1,
                pad: [0; 2],
            });
            continue;
        }
        let slot_begin = plan.n_slots;
        let merge = plan.merges.len() as i32;
        for c in 0..n_chunks {
            plan.items.push(WorkItem {
                request: r as i32,
                row_base: 0,
                key_begin: (c * chunk) as i32,
                key_end: ((c + 1) * chunk).min(keys) as i32,
                slot: (slot_begin + c) as i32,
                merge,
                pad: [0; 2],
            });
        }
        plan.n_slots += n_chunks;
        plan.merges.push(MergeJob {
            request: r as i32,
            slot_begin: slot_begin as i32,
            slot_count: n_chunks as i32,
            pad: 0,
        });
    }
    plan
}

/// Tiles per decode chunk for requests of `tiles` key tiles each (times `kv_heads` CTAs) on
/// `slots` resident CTAs. A step lasts about max(longest item, waves x mean item), counting one
/// tile of per-item overhead (Q load, epilogue, merge share): too few items leave SMs idle in
/// the last wave, too many pay the overhead. Tries the splits of the longest request into
/// 1..=64 chunks (at least 2 tiles each) and keeps the cheapest, the larger chunk on ties.
pub fn decode_chunk_tiles(tiles: &[usize], kv_heads: usize, slots: usize) -> usize {
    if tiles.is_empty() {
        return 2; // no decode requests (a prefill-only step): nothing to split
    }
    let max_t = tiles.iter().copied().max().unwrap_or(0).max(1);
    let total: usize = tiles.iter().sum();
    let slots = slots.max(1);
    let mut best = (usize::MAX, max_t.max(2));
    let mut last = 0;
    for n in 1..=64usize {
        let c = max_t.div_ceil(n).max(2);
        if c == last {
            continue;
        }
        last = c;
        let items: usize = tiles.iter().map(|&t| t.div_ceil(c).max(1)).sum();
        let ctas = items * kv_heads.max(1);
        let waves = ctas.div_ceil(slots);
        // cost in tiles x items, kept integral: waves x (mean item + 1) vs the longest item + 1
        let wave_cost = waves * (total + items);
        let longest = (c.min(max_t) + 1) * items;
        let cost = wave_cost.max(longest) * 1_000 / items;
        if cost < best.0 {
            best = (cost, c);
        }
        if c == 2 {
            break;
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{GroupSize, HeadDim, KvDtype, Mask, PageSize};

    fn spec() -> KernelSpec {
        KernelSpec {
            dtype: KvDtype::Bf16,
            head_dim: HeadDim::D128,
            page: PageSize::P16,
            group: GroupSize::G4,
            mask: Mask::Causal,
        }
    }

    fn batch(reqs: &[(usize, usize)]) -> CsrBatch {
        // (q_len, keys)
        let mut b = CsrBatch {
            qo_indptr: vec![0],
            kv_indptr: vec![0],
            ..Default::default()
        };
        for &(q, k) in reqs {
            let pages = k.div_ceil(16);
            for _ in 0..pages {
                b.kv_indices.push(b.kv_indices.len() as u32);
            }
            b.qo_indptr.push(b.qo_indptr.last().unwrap() + q as u32);
            b.kv_indptr.push(b.kv_indices.len() as u32);
            b.kv_last_page_len.push((k - (pages - 1) * 16) as u32);
            b.kv_first_pos.push(0);
        }
        b
    }

    #[test]
    fn long_decode_is_split_and_every_key_is_covered_once() {
        let b = batch(&[(1, 4096), (1, 100)]);
        b.validate(16, 1000).unwrap();
        let p = plan_step(&b, &spec(), Arch::Sm80, 8, 132 * 8);
        assert_eq!(p.n_prefill, 0);
        let mut covered = [0usize; 2];
        for it in &p.items {
            covered[it.request as usize] += (it.key_end - it.key_begin) as usize;
            // the kernels' tile loader needs every split to start on a page boundary
            assert_eq!(it.key_begin as usize % spec().page.get(), 0, "{it:?}");
        }
        assert_eq!(covered, [4096, 100]);
        assert!(p.merges.iter().any(|m| m.request == 0 && m.slot_count > 1));
        let slots: usize = p.merges.iter().map(|m| m.slot_count as usize).sum();
        assert_eq!(slots, p.n_slots);
    }

    #[test]
    fn every_split_item_names_its_merge_job_and_each_job_counts_its_items() {
        // a mixed step (a prefill chunk first) and a decode-only one, each with several split
        // requests among unsplit ones
        for reqs in [
            vec![(40, 300), (1, 4096), (1, 100), (1, 2000), (2, 3000)],
            vec![(1, 4096), (1, 17), (1, 2000), (1, 1000)],
        ] {
            let b = batch(&reqs);
            b.validate(16, 10_000).unwrap();
            let p = plan_step(&b, &spec(), Arch::Sm80, 8, 64);
            assert!(p.merges.len() >= 2, "{reqs:?}: {} merge jobs", p.merges.len());
            let mut counted = vec![0; p.merges.len()];
            for (i, it) in p.items.iter().enumerate() {
                if it.slot < 0 {
                    assert_eq!(it.merge, -1, "{it:?}");
                    continue;
                }
                // only decode items are split: prefill items never leave partials for kvf_merge
                assert!(i >= p.n_prefill, "{it:?}");
                let job = p.merges[it.merge as usize];
                assert_eq!(job.request, it.request, "{it:?}");
                assert!(
                    (job.slot_begin..job.slot_begin + job.slot_count).contains(&it.slot),
                    "{it:?}"
                );
                counted[it.merge as usize] += 1;
            }
            let want: Vec<i32> = p.merges.iter().map(|m| m.slot_count).collect();
            assert_eq!(counted, want, "{reqs:?}");
            assert!(want.iter().all(|&n| n >= 2));
            // the uploaded rows carry the job where the kernel's struct has it
            let rows = p.items_as_i32();
            for (it, row) in p.items.iter().zip(rows.chunks(8)) {
                assert_eq!(row[4..6], [it.slot, it.merge]);
            }
        }
    }

    #[test]
    fn prefill_rows_are_tiled_heaviest_first() {
        let b = batch(&[(100, 100), (1, 50)]);
        let p = plan_step(&b, &spec(), Arch::Sm80, 8, 1);
        // 100 tokens x group 4 = 400 rows -> 4 tiles of 128 (head_dim 128: two m-tiles a warp)
        assert_eq!(spec().prefill_rows(), 128);
        assert_eq!(p.n_prefill, 4);
        assert_eq!(p.items[0].row_base, 384);
        let bases: Vec<i32> = p.items[..p.n_prefill].iter().map(|w| w.row_base).collect();
        assert_eq!(bases, [384, 256, 128, 0]);
        assert_eq!(p.items[p.n_prefill].request, 1);
    }

    #[test]
    fn prefill_items_are_one_wgmma_slab_on_sm90a() {
        let b = batch(&[(100, 100)]);
        let p = plan_step(&b, &spec(), Arch::Sm90a, 8, 1);
        // bf16, head_dim 128 on sm_90a: 64-row items, so 400 rows -> 7
        assert!(spec().wgmma_prefill(Arch::Sm90a));
        assert_eq!(p.n_prefill, 7);
        let mut bases: Vec<i32> = p.items.iter().map(|w| w.row_base).collect();
        bases.sort();
        assert_eq!(bases, [0, 64, 128, 192, 256, 320, 384]);
        // quantized caches keep the mma.sync CTA and its 128 rows
        let fp8 = KernelSpec {
            dtype: KvDtype::Fp8E4m3,
            ..spec()
        };
        assert!(!fp8.wgmma_prefill(Arch::Sm90a));
        assert_eq!(plan_step(&b, &fp8, Arch::Sm90a, 8, 1).n_prefill, 4);
    }

    #[test]
    fn decode_chunks_fill_whole_waves() {
        // 64 requests x 4096 keys (64 tiles) x 8 KV heads on 132 SMs x 3 CTAs: 1 chunk = 2
        // waves of 64 tiles, 2 chunks = 2.6 waves (the third 59% idle), 3 chunks of 22 tiles =
        // 3.9 waves: the cheapest.
        assert_eq!(decode_chunk_tiles(&[64; 64], 8, 396), 22);
        // 8 such requests: one wave of 384 CTAs with 6 chunks of 11 tiles each.
        assert_eq!(decode_chunk_tiles(&[64; 8], 8, 396), 11);
        // Enough requests to fill every SM ten times over: at most two chunks.
        assert!(decode_chunk_tiles(&[64; 512], 8, 396) >= 32);
        // nvfp4's 128-key tiles at 2 CTAs per SM: 512 CTAs are exactly two waves, no split.
        assert_eq!(decode_chunk_tiles(&[32; 64], 8, 264), 32);
        // One long request among short ones: split it finely, it would be the whole step.
        let mut t = vec![1; 255];
        t.push(1000);
        let c = decode_chunk_tiles(&t, 8, 396);
        assert!(c <= 32, "chunk {c}");
    }

    #[test]
    fn a_prefill_only_step_plans_without_decode_chunks() {
        assert_eq!(decode_chunk_tiles(&[], 8, 396), 2);
        let b = batch(&[(100, 100)]);
        let p = plan_step(&b, &spec(), Arch::Sm80, 8, 396);
        assert_eq!(p.n_prefill, p.items.len());
        assert!(p.merges.is_empty());
    }

    #[test]
    fn decode_chunks_are_at_least_two_tiles_and_never_empty() {
        for slots in [1, 7, 264, 396, 1056] {
            for t in [vec![0], vec![1], vec![2, 3], vec![500; 3], vec![0, 64, 1]] {
                let c = decode_chunk_tiles(&t, 8, slots);
                assert!(c >= 2, "{t:?} on {slots}: {c}");
                assert!(
                    c <= t.iter().copied().max().unwrap().max(2),
                    "{t:?} on {slots}: {c}"
                );
            }
        }
    }

    #[test]
    fn invalid_batches_are_rejected_with_reasons() {
        let mut b = batch(&[(1, 20)]);
        b.kv_last_page_len[0] = 17;
        assert!(b
            .validate(16, 100)
            .unwrap_err()
            .to_string()
            .contains("kv_last_page_len"));
        let mut b = batch(&[(1, 20)]);
        b.kv_indices[1] = 500;
        assert!(b.validate(16, 100).is_err());
        let b = batch(&[(30, 20)]);
        assert!(b.validate(16, 100).is_err());
    }
}
