//! Shared helpers of the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// Path of a default model (`smollm2` or `gemma3`), fetched into the cache on first use.
pub fn model(name: &str) -> PathBuf {
    baton::fetch::resolve(name).unwrap_or_else(|e| panic!("model {name} unavailable: {e:#}"))
}

/// The `baton` binary built for this test run.
pub fn baton_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_baton"))
}
