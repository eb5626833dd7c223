//! `kvfleet webhook` (not yet available).

/// Options of `kvfleet webhook`.
#[derive(clap::Args, Debug)]
pub struct WebhookArgs {}

/// Errors of the webhook.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`kvfleet webhook` is not yet available in this build")]
    NotYetAvailable,
}

pub async fn run(_args: WebhookArgs) -> Result<(), Error> {
    Err(Error::NotYetAvailable)
}
