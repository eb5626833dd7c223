//! The attention backend interface: one batched call per layer and step.

use super::layout::{BackendConfig, LayoutError, StepPlan};

/// Why a backend call failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("invalid step plan: {0}")]
    Plan(String),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("{what} buffer holds {have} elements, the step needs {need}")]
    BufferTooSmall {
        what: &'static str,
        have: usize,
        need: usize,
    },
    #[error("layer {layer} does not exist (the backend has {layers})")]
    NoLayer { layer: usize, layers: usize },
    #[error("call prepare() with the step's plan before append_kv/attention")]
    NotPrepared,
    #[error("device error: {0}")]
    Device(String),
    #[error("not supported by this backend: {0}")]
    Unsupported(String),
}

/// An attention backend: owns the KV pools of every layer (laid out as
/// [`super::layout`] says) and runs one step's attention for a whole batch in one call
/// per layer.
///
/// Per step: [`Backend::prepare`] once with the host-side plan (a device backend uploads
/// the CSR arrays here, once for all layers), then for each layer [`Backend::append_kv`]
/// and [`Backend::attention`]. Activation buffers are the backend's own type, so a GPU
/// backend keeps Q/K/V/O on the device; buffers may be longer than a step needs and only
/// their prefix is read or written:
/// - `q`, `out`: `[total_q, q_heads, head_dim]`;
/// - `k`, `v`: `[total_q, kv_heads, head_dim]` (the new tokens, in `qo_indptr` order).
pub trait Backend {
    /// Activation buffer (`Vec<f32>` on the CPU; device memory on a GPU).
    type Buf;

    /// Short name for logs and metrics (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// What the pools were allocated for.
    fn config(&self) -> &BackendConfig;

    /// A zeroed activation buffer of `elems` f32 elements (the element type inside may be
    /// narrower on a device).
    fn alloc(&mut self, elems: usize) -> Result<Self::Buf, BackendError>;

    /// Copies host values into the prefix of `dst`.
    fn upload(&mut self, src: &[f32], dst: &mut Self::Buf) -> Result<(), BackendError>;

    /// Copies the prefix of `src` back to the host.
    fn download(&mut self, src: &Self::Buf, dst: &mut [f32]) -> Result<(), BackendError>;

    /// Takes the step's plan; every later call of the step reads it.
    fn prepare(&mut self, plan: &StepPlan) -> Result<(), BackendError>;

    /// Writes K and V of every new token of the step into `layer`'s pools, quantizing on
    /// write, at the slots of the layer group's `slot_mapping`.
    fn append_kv(&mut self, layer: usize, k: &Self::Buf, v: &Self::Buf) -> Result<(), BackendError>;

    /// Attention of every query token of the step over `layer`'s paged cache (the step's
    /// new tokens included, so call [`Backend::append_kv`] first).
    fn attention(&mut self, layer: usize, q: &Self::Buf, out: &mut Self::Buf) -> Result<(), BackendError>;

    /// Waits for queued work (a no-op on the CPU).
    fn synchronize(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
}

/// Q, K, V and the output of a step shared by every layer: a backend driven without a model
/// ([`run_step`], for tests and benchmarks).
pub struct StepBuffers<B> {
    pub q: B,
    pub k: B,
    pub v: B,
    pub out: B,
}

/// Runs a whole step: `prepare`, then append and attention for every layer.
pub fn run_step<B: Backend>(
    backend: &mut B,
    plan: &StepPlan,
    bufs: &mut StepBuffers<B::Buf>,
) -> Result<(), BackendError> {
    backend.prepare(plan)?;
    for layer in 0..backend.config().layers.len() {
        backend.append_kv(layer, &bufs.k, &bufs.v)?;
        backend.attention(layer, &bufs.q, &mut bufs.out)?;
    }
    backend.synchronize()
}
