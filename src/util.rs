//! Small helpers shared by every layer: atomic file writes, the model cache directory, byte progress bars, hex.
//! The cache directory lives here, not in [`crate::fetch`], so that the model layer (fingerprints cached beside
//! the models) does not depend on the downloader.

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsynced, then renamed over the
/// target, so a crash or a full disk never leaves a half-written file under the final name.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    tmp.as_file().sync_all().ok();
    tmp.persist(path)
        .with_context(|| format!("cannot rename into {}", path.display()))?;
    Ok(())
}

/// The model cache directory (created if missing): `$BATON_MODELS`, else `<user cache dir>/baton/models`.
pub fn models_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("BATON_MODELS") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => dirs::cache_dir()
            .ok_or_else(|| anyhow!("cannot find the user cache directory; set BATON_MODELS to a writable directory"))?
            .join("baton")
            .join("models"),
    };
    ensure_dir(&dir)?;
    Ok(dir)
}

pub(crate) fn ensure_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| anyhow!("cannot create model cache directory {}: {e}", dir.display()))?;
    if !dir.is_dir() {
        bail!("model cache directory {} is not a directory", dir.display());
    }
    Ok(())
}

/// A byte progress bar on stderr (drawn only when stderr is a terminal).
pub fn byte_bar(len: u64, msg: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(msg.to_owned());
    bar
}

/// Lower-case hex of `bytes` (digests).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}
