//! KV-capacity planning (pure, no I/O).
