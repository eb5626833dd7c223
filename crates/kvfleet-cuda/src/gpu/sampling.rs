//! Sampling on the device (`kernels/sampling.cu`): each row's pick packed into the words
//! `kvf_pick_rows` reads, the launchers of the argmax and of the pick, and the pick on its own
//! for tests and timing.

use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use kvfleet_engine::model::sampling::{RowPick, RowSample, ADJUST_WORDS};

use crate::device::Gpu;
use crate::launch::Launch;

use super::error::{drv, need, GpuError};
use super::kernels::{rows_cfg, ModelKernels};
use super::options::GpuTuning;

/// Words of one row's pick in `kvf_pick_rows`' input.
pub(super) const PICK_WORDS: usize = kvfleet_core::plan::engine_memory::PICK_WORDS as usize;

/// The kernel's words for each pick: temperature (0 for the argmax), top-k clamped to `i32`,
/// top-p, the key's low and high halves, and min-p.
fn pick_words(picks: &[RowPick]) -> Vec<u32> {
    picks
        .iter()
        .flat_map(|p| match p {
            RowPick::Greedy => [0; PICK_WORDS],
            RowPick::Draw(d) => [
                d.temperature.to_bits(),
                d.top_k.min(i32::MAX as u32),
                d.top_p.to_bits(),
                d.key as u32,
                (d.key >> 32) as u32,
                d.min_p.to_bits(),
            ],
        })
        .collect()
}

/// The rows' adjustments as `kvf_adjust_rows` reads them: `rows + 1` offsets (in entries),
/// then [`ADJUST_WORDS`] words an entry. `None` when no row has any.
pub(super) fn adjust_words(rows: &[RowSample]) -> Option<Vec<u32>> {
    if rows.iter().all(|r| r.adjust.is_empty()) {
        return None;
    }
    let entries: usize = rows.iter().map(|r| r.adjust.len()).sum();
    let mut w = Vec::with_capacity(rows.len() + 1 + ADJUST_WORDS * entries);
    let mut at = 0u32;
    w.push(0);
    for r in rows {
        at += r.adjust.len() as u32;
        w.push(at);
    }
    for a in rows.iter().flat_map(|r| &r.adjust) {
        w.extend_from_slice(&a.words());
    }
    Some(w)
}

impl ModelKernels {
    /// Applies the adjustments `words` ([`adjust_words`], uploaded into `buf`) to the first
    /// rows of `logits` in place (`kvf_adjust_rows`).
    pub fn adjust_rows(
        &self,
        logits: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        words: &[u32],
        buf: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        need("logits", logits, rows * vocab)?;
        need("adjustment words", buf, words.len())?;
        if words.len() < rows + 1 {
            return Err(GpuError::Invalid(format!(
                "{} adjustment words for {rows} rows",
                words.len()
            )));
        }
        let mut view = buf.slice_mut(..words.len());
        self.stream()
            .memcpy_htod(words, &mut view)
            .map_err(drv("copying logit adjustments to the device"))?;
        let v = vocab as i32;
        let mut l = Launch::new(self.stream());
        l.ptr_mut(logits).i32(v).ptr(buf);
        // SAFETY: matches `kvf_adjust_rows` in kernels/sampling.cu (pointer, int, pointer);
        // `logits` holds `rows * vocab` f32 (checked above) and the kernel skips token ids at or
        // past `vocab`; `buf` holds `rows + 1` offsets and the entries they count (built by
        // `adjust_words`); one block of 128 threads per row, no shared memory; it waits for the
        // previous kernel first (PDL).
        unsafe { l.launch(&self.adjust_rows, rows_cfg(rows, 128, 0), self.pdl) }
            .map_err(drv("launching kvf_adjust_rows"))?;
        Ok(())
    }

    /// `out[r] = argmax(logits[r, :vocab])` for `rows` rows.
    pub fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        need("logits", logits, rows * vocab)?;
        need("argmax output", out, rows)?;
        let v = vocab as i32;
        let mut l = Launch::new(self.stream());
        l.ptr(logits).i32(v).ptr_mut(out);
        // SAFETY: matches `kvf_argmax_rows` in kernels/sampling.cu (pointer, int, pointer);
        // `logits` holds `rows * vocab` f32 and `out` `rows` ints (checked above); one block of
        // 1024 threads (a multiple of 32) per row, static shared memory only; it waits for the
        // previous kernel first (PDL).
        unsafe { l.launch(&self.argmax_rows, rows_cfg(rows, 1024, 0), self.pdl) }
            .map_err(drv("launching kvf_argmax_rows"))?;
        Ok(())
    }

    /// `out[r]` = the token `picks[r]` chooses from `logits[r, :vocab]` (`kvf_pick_rows`), with
    /// the picks uploaded into `words` ([`PICK_WORDS`] a row).
    pub fn pick_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        picks: &[RowPick],
        words: &mut CudaSlice<u32>,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), GpuError> {
        let rows = picks.len();
        need("logits", logits, rows * vocab)?;
        need("pick output", out, rows)?;
        need("pick words", words, rows * PICK_WORDS)?;
        let host = pick_words(picks);
        let mut view = words.slice_mut(..host.len());
        self.stream()
            .memcpy_htod(&host, &mut view)
            .map_err(drv("copying sampling parameters to the device"))?;
        let v = vocab as i32;
        let mut l = Launch::new(self.stream());
        l.ptr(logits).i32(v).ptr(words).ptr_mut(out);
        // SAFETY: matches `kvf_pick_rows` in kernels/sampling.cu (pointer, int, pointer,
        // pointer); `logits` holds `rows * vocab` f32, `words` 6 words a row, `out` `rows` ints
        // (checked above); one block of 1024 threads (a multiple of 32) per row, static shared
        // memory only; it waits for the previous kernel first (PDL).
        unsafe { l.launch(&self.pick_rows, rows_cfg(rows, 1024, 0), self.pdl) }
            .map_err(drv("launching kvf_pick_rows"))?;
        Ok(())
    }
}

/// Picks a token from each row of `logits` (`[rows.len(), vocab]` f32) as a step does: each
/// row's adjustments with `kvf_adjust_rows` (when any row has some), then `kvf_pick_rows`; for
/// tests that hold the device to the host's [`RowSample::pick`].
pub fn sample_rows_on_device(
    gpu: &Gpu,
    logits: &[f32],
    vocab: usize,
    rows: &[RowSample],
) -> Result<Vec<u32>, GpuError> {
    let n = rows.len();
    if vocab == 0 || logits.len() != n * vocab {
        return Err(GpuError::Invalid(format!(
            "{} logits for {n} rows of {vocab}",
            logits.len()
        )));
    }
    let k = ModelKernels::load(gpu, false, &GpuTuning::default())?;
    let s = k.stream();
    let mut d_logits = s
        .clone_htod(logits)
        .map_err(drv("copying logits to the device"))?;
    if let Some(words) = adjust_words(rows) {
        let mut buf = s
            .alloc_zeros::<u32>(words.len())
            .map_err(drv("allocating adjustment words"))?;
        k.adjust_rows(&mut d_logits, n, vocab, &words, &mut buf)?;
    }
    let mut words = s
        .alloc_zeros::<u32>(n * PICK_WORDS)
        .map_err(drv("allocating pick words"))?;
    let mut out = s.alloc_zeros::<i32>(n).map_err(drv("allocating picks"))?;
    let picks: Vec<RowPick> = rows.iter().map(|r| r.pick).collect();
    k.pick_rows(&d_logits, vocab, &picks, &mut words, &mut out)?;
    gpu.synchronize()?;
    let ids = s.clone_dtoh(&out).map_err(drv("copying picks to the host"))?;
    Ok(ids.into_iter().map(|i| i as u32).collect())
}

/// Picks a token from each row of `logits` (`[picks.len(), vocab]` f32) with `kvf_pick_rows`, as
/// a step does after its LM head: for tests that hold the device to the host's
/// [`RowPick::pick`], and for timing the kernel alone. Runs it `1 + reps` times and returns the
/// tokens and the mean time of the last `reps` launches (the first loads the module).
pub fn pick_rows_on_device(
    gpu: &Gpu,
    logits: &[f32],
    vocab: usize,
    picks: &[RowPick],
    reps: usize,
) -> Result<(Vec<u32>, Duration), GpuError> {
    let rows = picks.len();
    if vocab == 0 || logits.len() != rows * vocab {
        return Err(GpuError::Invalid(format!(
            "{} logits for {rows} rows of {vocab}",
            logits.len()
        )));
    }
    let k = ModelKernels::load(gpu, false, &GpuTuning::default())?;
    let s = k.stream();
    let d_logits = s
        .clone_htod(logits)
        .map_err(drv("copying logits to the device"))?;
    let mut words = s
        .alloc_zeros::<u32>(rows * PICK_WORDS)
        .map_err(drv("allocating pick words"))?;
    let mut out = s.alloc_zeros::<i32>(rows).map_err(drv("allocating picks"))?;
    k.pick_rows(&d_logits, vocab, picks, &mut words, &mut out)?;
    gpu.synchronize()?;
    let start = Instant::now();
    for _ in 0..reps {
        k.pick_rows(&d_logits, vocab, picks, &mut words, &mut out)?;
    }
    gpu.synchronize()?;
    let each = start.elapsed() / reps.max(1) as u32;
    let ids = s.clone_dtoh(&out).map_err(drv("copying picks to the host"))?;
    Ok((ids.into_iter().map(|i| i as u32).collect(), each))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_engine::model::sampling::Draw;

    #[test]
    fn adjustments_are_offsets_then_four_words_an_entry_and_none_without_any() {
        use kvfleet_engine::model::sampling::Adjust;
        let plain = RowSample::from(RowPick::Greedy);
        assert_eq!(adjust_words(&[plain.clone(), plain.clone()]), None);
        let a = Adjust {
            token: 7,
            bias: 1.0,
            factor: 2.0,
            add: f32::NEG_INFINITY,
        };
        let with = RowSample {
            adjust: vec![a, Adjust { token: 9, ..a }],
            ..plain.clone()
        };
        let w = adjust_words(&[plain, with]).unwrap();
        assert_eq!(w[..3], [0, 0, 2]);
        assert_eq!(
            w[3..7],
            [7, 1.0f32.to_bits(), 2.0f32.to_bits(), f32::NEG_INFINITY.to_bits()]
        );
        assert_eq!(w[7], 9);
        assert_eq!(w.len(), 3 + 8);
    }

    #[test]
    fn a_pick_is_six_words_in_the_kernels_order_and_greedy_rows_are_zeros() {
        let draw = Draw {
            temperature: 0.7,
            top_k: u32::MAX,
            top_p: 0.9,
            min_p: 0.0,
            key: 0x1234_5678_9abc_def0,
        };
        let words = pick_words(&[RowPick::Greedy, RowPick::Draw(draw)]);
        assert_eq!(words[..PICK_WORDS], [0; PICK_WORDS]);
        assert_eq!(
            words[PICK_WORDS..],
            [
                0.7f32.to_bits(),
                i32::MAX as u32,
                0.9f32.to_bits(),
                0x9abc_def0,
                0x1234_5678,
                0.0f32.to_bits()
            ]
        );
    }
}
