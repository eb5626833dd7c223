//! Logging set-up: `RUST_LOG` env-filter, human or JSON lines on stderr.

use tracing_subscriber::{fmt, EnvFilter};

/// Log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the global subscriber. `default_directive` applies when `RUST_LOG` is unset.
pub fn init(format: LogFormat, default_directive: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_directive));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
