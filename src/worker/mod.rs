//! `kvfleet worker` (not yet available).

pub mod cuda;

use std::process::ExitCode;

/// Options of `kvfleet worker`.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {}

pub fn main(_args: WorkerArgs) -> ExitCode {
    eprintln!("error: `kvfleet worker` is not yet available in this build");
    ExitCode::FAILURE
}
