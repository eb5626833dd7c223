//! A model family's departures from the shared decoder block on the CPU. The layer loop
//! (`llama.rs`: norms, Q/K/V through the linear op, RoPE, attention, residuals) runs every
//! family; a family file implements [`Block`] for the math that is its own, and the table of
//! architectures in `llama.rs` (`ARCHITECTURES`) names the file that reads it. Switches that are
//! data (QKV biases, QK norms, post-norms, a layer's window) come from the config and the
//! tensors, not from here. The GPU's counterpart is `kvfleet_cuda::gpu::step::Family`.

/// The math where a family's block departs from a Llama block.
pub trait Block: Sync {
    /// The residual stream's first value of a token (`out`, `d_model` wide) from its embedding
    /// row `e`.
    fn embed(&self, e: &[f32], out: &mut [f32]);

    /// Scales the queries (`[tokens, q_heads * head_dim]`) before attention, whose backends
    /// scale by `1 / sqrt(head_dim)`.
    fn scale_queries(&self, head_dim: usize, q: &mut [f32]);

    /// The MLP's gated activation: `gate = act(gate) * up`, elementwise.
    fn glu(&self, gate: &mut [f32], up: &[f32]);
}
