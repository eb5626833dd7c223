//! `kvfleet plan`: KV-cache capacity, the vLLM way and the kvfleet way.

use std::path::PathBuf;
use std::process::ExitCode;

/// Plan KV-cache capacity for a model configuration.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The model's HF config.json.
    #[arg(long)]
    pub model_config: Option<PathBuf>,
}

pub fn run(_args: &PlanArgs) -> ExitCode {
    eprintln!("error: `kvfleet plan` is not yet available in this build (see issue 4)");
    ExitCode::from(2)
}
