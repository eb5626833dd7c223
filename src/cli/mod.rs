//! The command line: one binary, several modes.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

pub mod check;
pub mod crd;
pub mod plan;

/// kvfleet runs LLM inference fleets on NVIDIA GPUs: it rejects configurations the GPUs
/// cannot run, plans KV-cache capacity exactly and serves batched paged attention.
#[derive(Parser, Debug)]
#[command(name = "kvfleet", version, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr (filter with RUST_LOG, e.g. RUST_LOG=kvfleet=debug).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "KVFLEET_LOG_FORMAT")]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Reconcile InferenceDeployments into Deployments, Services and monitors, and report
    /// compatibility and KV capacity in their status.
    Controller(crate::controller::ControllerArgs),
    /// Serve the validating admission webhook that rejects InferenceDeployments the
    /// selected GPUs cannot run or whose KV cache cannot fit, naming the fix.
    Webhook(crate::webhook::WebhookArgs),
    /// Run an inference worker: probe the GPU, refuse configurations it cannot run,
    /// size the KV pool, serve the batched paged-attention engine and its metrics.
    Worker(crate::worker::WorkerArgs),
    /// Plan KV-cache capacity for a model on a GPU, the way vLLM counts it and the way
    /// kvfleet's sliding-window-aware engine does, with the arithmetic explained.
    Plan(plan::PlanArgs),
    /// Check InferenceDeployment files offline against GPU nodes: exit 0 admitted,
    /// 1 denied, 2 unusable input.
    Check(check::CheckArgs),
    /// Print the InferenceDeployment CustomResourceDefinition as YAML.
    Crd(crd::CrdArgs),
    /// Route an InferenceDeployment's requests: each goes to the worker that already holds its
    /// prompt's prefix (from the workers' KV events) and has KV room, OpenAI API unchanged.
    Router(crate::router::RouterArgs),
    /// Run beside a vLLM server: read the KV pool vLLM allocated from its /metrics and
    /// annotate the own pod with it, for the controller's measured capacity.
    CapacitySidecar(crate::sidecar::SidecarArgs),
}

/// Runs the CLI and maps every outcome to an exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_log = match cli.command {
        Command::Check(_) | Command::Plan(_) | Command::Crd(_) => "warn",
        _ => "info,kvfleet=info",
    };
    crate::telemetry::init(cli.log_format, default_log);
    match cli.command {
        Command::Crd(args) => crd::run(&args),
        Command::Check(args) => check::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Controller(args) => serve(crate::controller::run(args)),
        Command::Webhook(args) => serve(crate::webhook::run(args)),
        Command::Worker(args) => crate::worker::main(args),
        Command::Router(args) => serve(crate::router::run(args)),
        Command::CapacitySidecar(args) => serve(crate::sidecar::run(args)),
    }
}

/// Runs a long-lived mode on a multi-threaded runtime; an error is logged once and
/// becomes exit code 1.
pub fn serve<E>(fut: impl std::future::Future<Output = Result<(), E>>) -> ExitCode
where
    E: std::error::Error,
{
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(error) => {
            tracing::error!(%error, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = %crate::error_chain(&error), "exiting");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn every_mode_has_unique_well_formed_arguments() {
        // clap checks this lazily at parse time; catch a clash (e.g. a flattened group reusing
        // a flag) here instead of in a pod.
        Cli::command().debug_assert();
    }

    #[test]
    fn every_mode_explains_itself_in_help() {
        let cmd = Cli::command();
        for name in [
            "controller",
            "webhook",
            "worker",
            "plan",
            "check",
            "crd",
            "capacity-sidecar",
            "router",
        ] {
            let sub = cmd
                .find_subcommand(name)
                .unwrap_or_else(|| panic!("mode {name} missing"));
            let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
            assert!(
                about.len() > 40,
                "`kvfleet {name} --help` says too little: {about:?}"
            );
        }
    }
}
