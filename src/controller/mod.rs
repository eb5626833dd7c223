//! `kvfleet controller` (not yet available).

/// Options of `kvfleet controller`.
#[derive(clap::Args, Debug)]
pub struct ControllerArgs {}

/// Errors of the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`kvfleet controller` is not yet available in this build")]
    NotYetAvailable,
}

pub async fn run(_args: ControllerArgs) -> Result<(), Error> {
    Err(Error::NotYetAvailable)
}
