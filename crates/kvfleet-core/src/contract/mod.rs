//! The contract between the controller and the worker: the one place both import, so neither
//! imports the other. The controller renders a worker config and pod annotations from an
//! InferenceDeployment; the worker reads the config, exits with one of [`exit`]'s codes when it
//! cannot serve, and writes its measured capacity into [`MEASURED_TOKENS_ANNOTATION`], which the
//! controller reads back into status.

pub mod config;
pub mod model;

/// Label that selects the pods of one InferenceDeployment (the scale selector).
pub const INSTANCE_LABEL: &str = "kvfleet.io/inference-deployment";
/// Pod annotation the kvfleet worker writes with its measured KV capacity in tokens.
pub const MEASURED_TOKENS_ANNOTATION: &str = "kvfleet.io/measured-kv-tokens";
/// Pod-template annotation holding a hash of the worker config, so a config change rolls the pods.
pub const CONFIG_HASH_ANNOTATION: &str = "kvfleet.io/config-hash";
/// Key of the worker configuration in the ConfigMap.
pub const WORKER_CONFIG_KEY: &str = "worker.yaml";
/// Port of the serving container (kvfleet worker and vLLM both default to 8000).
pub const HTTP_PORT: i32 = 8000;

/// The worker's exit codes: the controller tells a failed preflight (2, 3, 4) from a crash.
pub mod exit {
    /// A runtime failure after start (cannot listen, engine error).
    pub const RUNTIME: u8 = 1;
    /// The configuration cannot be read or is invalid.
    pub const CONFIG: u8 = 2;
    /// The configuration cannot run on this machine (GPU, architecture, feature).
    pub const INCOMPATIBLE: u8 = 3;
    /// The KV cache does not fit in the memory left.
    pub const NO_MEMORY: u8 = 4;
}
