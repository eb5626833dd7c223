//! Sampling on the device (`kernels/sampling.cu`): each row's pick packed into the words
//! `kvf_pick_rows` reads, the launchers of the argmax and of the pick, and the pick on its own
//! for tests and timing.

use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use kvfleet_engine::model::sampling::RowPick;

use crate::device::Gpu;
use crate::launch::Launch;

use super::error::{drv, need, GpuError};
use super::kernels::{rows_cfg, ModelKernels};

/// Words of one row's pick in `kvf_pick_rows`' input.
pub(super) const PICK_WORDS: usize = kvfleet_core::plan::engine_memory::PICK_WORDS as usize;

/// The kernel's words for each pick: temperature (0 for the argmax), top-k clamped to `i32`,
/// top-p, the key's low and high halves, and an unused word.
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
                0,
            ],
        })
        .collect()
}

impl ModelKernels {
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
    let k = ModelKernels::load(gpu)?;
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
    fn a_pick_is_six_words_in_the_kernels_order_and_greedy_rows_are_zeros() {
        let draw = Draw {
            temperature: 0.7,
            top_k: u32::MAX,
            top_p: 0.9,
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
                0
            ]
        );
    }
}
