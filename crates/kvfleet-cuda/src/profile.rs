//! Where a serving step's time goes, when `KVFLEET_PROFILE=1`: the serving loop times its host
//! parts (schedule, forward, sample and stream, metrics) and the GPU model times each part of
//! its forward pass with CUDA events recorded between them. Both log a table every
//! [`REPORT_EVERY`] (and the GPU one when the model is dropped), averaged per step and grouped by
//! step shape, so a benchmark's log says what limits it. Off by default: the events cost a
//! little launch time and the GPU side synchronises once per step (it does anyway).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream, DriverError};

/// Whether the serving loop times its host parts: set once at start by the worker from
/// `GpuTuning::profile` (`KVFLEET_PROFILE=1`), read by the loop.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// How often a profile table is logged.
pub const REPORT_EVERY: Duration = Duration::from_secs(10);

/// Whether profiling was asked for ([`enable`]).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Turns the serving loop's profile on or off (the worker, at start).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// A step's shape: decode only or with prefill, and its sampling rows rounded up to a power of
/// two (so a closed loop's ramp does not blur the steady state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Shape {
    pub prefill: bool,
    pub rows: usize,
}

impl Shape {
    pub fn new(tokens: usize, rows: usize) -> Self {
        Shape {
            prefill: tokens > rows,
            rows: rows.max(1).next_power_of_two(),
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Sums {
    steps: u64,
    tokens: u64,
    ms: Vec<f64>,
}

/// Per-shape sums of named parts, and the table they make.
#[derive(Debug)]
pub struct Table {
    title: &'static str,
    parts: &'static [&'static str],
    sums: BTreeMap<Shape, Sums>,
    since: Instant,
}

impl Table {
    pub fn new(title: &'static str, parts: &'static [&'static str]) -> Self {
        Table {
            title,
            parts,
            sums: BTreeMap::new(),
            since: Instant::now(),
        }
    }

    /// Adds one step: `ms[i]` is the time of `parts[i]`.
    pub fn add(&mut self, shape: Shape, tokens: usize, ms: &[f64]) {
        let s = self.sums.entry(shape).or_default();
        s.ms.resize(self.parts.len(), 0.0);
        s.steps += 1;
        s.tokens += tokens as u64;
        for (a, b) in s.ms.iter_mut().zip(ms) {
            *a += b;
        }
    }

    /// The table (ms per step, by shape), or `None` when no step was added.
    pub fn render(&self) -> Option<String> {
        if self.sums.is_empty() {
            return None;
        }
        let mut out = format!(
            "{}: ms per step over {:.1} s\n",
            self.title,
            self.since.elapsed().as_secs_f64()
        );
        let _ = write!(out, "{:<16} {:>7} {:>8}", "shape", "steps", "tok/step");
        for p in self.parts {
            let _ = write!(out, " {p:>9}");
        }
        let _ = writeln!(out, " {:>9}", "total");
        for (shape, s) in &self.sums {
            let n = s.steps as f64;
            let kind = if shape.prefill { "prefill" } else { "decode" };
            let _ = write!(
                out,
                "{:<16} {:>7} {:>8.1}",
                format!("{kind} <={}", shape.rows),
                s.steps,
                s.tokens as f64 / n
            );
            for v in &s.ms {
                let _ = write!(out, " {:>9.3}", v / n);
            }
            let _ = writeln!(out, " {:>9.3}", s.ms.iter().sum::<f64>() / n);
        }
        Some(out)
    }

    /// Logs the table when [`REPORT_EVERY`] has passed, then starts a new one.
    pub fn maybe_report(&mut self) {
        if self.since.elapsed() >= REPORT_EVERY {
            self.report();
        }
    }

    /// Logs the table now and starts a new one.
    pub fn report(&mut self) {
        if let Some(t) = self.render() {
            tracing::info!("profile\n{t}");
        }
        self.sums.clear();
        self.since = Instant::now();
    }
}

/// CUDA events recorded between the parts of a GPU step; the time of a part is the time
/// between its event and the one before.
pub struct GpuSteps {
    ctx: Arc<CudaContext>,
    events: Vec<CudaEvent>,
    /// Part index of each recorded event after the first.
    marks: Vec<usize>,
    used: usize,
    pub table: Table,
}

impl GpuSteps {
    pub fn new(ctx: Arc<CudaContext>, parts: &'static [&'static str]) -> Self {
        GpuSteps {
            ctx,
            events: Vec::new(),
            marks: Vec::new(),
            used: 0,
            table: Table::new("GPU forward pass (CUDA events)", parts),
        }
    }

    fn record(&mut self, s: &CudaStream) -> Result<(), DriverError> {
        if self.used == self.events.len() {
            self.events
                .push(self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?);
        }
        self.events[self.used].record(s)?;
        self.used += 1;
        Ok(())
    }

    /// Starts a step.
    pub fn start(&mut self, s: &CudaStream) -> Result<(), DriverError> {
        self.used = 0;
        self.marks.clear();
        self.record(s)
    }

    /// Ends part `part` (an index into the parts) here.
    pub fn mark(&mut self, s: &CudaStream, part: usize) -> Result<(), DriverError> {
        self.marks.push(part);
        self.record(s)
    }

    /// Waits for the step's last event and adds its parts to the table.
    pub fn finish(&mut self, tokens: usize, rows: usize) -> Result<(), DriverError> {
        if self.used < 2 {
            return Ok(());
        }
        let mut ms = vec![0.0; self.table.parts.len()];
        for (i, &part) in self.marks.iter().enumerate() {
            ms[part] += self.events[i].elapsed_ms(&self.events[i + 1])? as f64;
        }
        self.table.add(Shape::new(tokens, rows), tokens, &ms);
        self.table.maybe_report();
        Ok(())
    }
}

impl Drop for GpuSteps {
    fn drop(&mut self) {
        self.table.report();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_averages_parts_per_shape() {
        let mut t = Table::new("t", &["a", "b"]);
        assert!(t.render().is_none());
        t.add(Shape::new(3, 3), 3, &[1.0, 2.0]);
        t.add(Shape::new(4, 4), 4, &[3.0, 4.0]);
        t.add(Shape::new(100, 2), 100, &[10.0, 0.0]);
        let r = t.render().unwrap();
        // 3 and 4 rows share the <=4 decode bucket: (1 + 3) / 2 and (2 + 4) / 2.
        let decode = r.lines().find(|l| l.starts_with("decode <=4")).unwrap();
        let f: Vec<&str> = decode.split_whitespace().collect();
        assert_eq!(f[2], "2", "steps");
        assert_eq!(&f[4..], ["2.000", "3.000", "5.000"]);
        let prefill = r.lines().find(|l| l.starts_with("prefill <=2")).unwrap();
        assert!(prefill.contains("100.0"), "{prefill}");
    }
}
