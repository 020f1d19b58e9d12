//! Model fingerprint (placeholder until its owner lands the cached version).
use anyhow::Result;
use std::path::Path;

pub fn fingerprint(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let bytes = std::fs::read(path)?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
