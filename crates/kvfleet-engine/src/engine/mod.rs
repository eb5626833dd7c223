//! The engine (pure: no I/O, no tokio, no CUDA): KV layout contract, element encodings,
//! block manager, scheduler, step plans, the attention backend interface, the CPU backend
//! and the f64 reference oracle.

pub mod backend;
pub mod block;
pub mod capacity;
pub mod cpu;
pub mod demand;
pub mod direct;
pub mod layout;
pub mod oracle;
pub mod prefix;
pub mod quant;
pub mod scheduler;
pub mod speculative;

pub use backend::{Backend, BackendError};
pub use layout::{BackendConfig, GroupSpec, GroupTable, KvDtype, KvScales, LayerAttn, LayerSpec, StepPlan};
