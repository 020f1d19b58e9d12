//! Model fingerprint: SHA-256 of the whole file, so two nodes (or a node and a cached KV file) can prove they hold
//! the same weights and metadata before exchanging anything.
//!
//! Hashing a 100 GB model takes minutes, so results are cached per file, keyed by (canonical path, size, mtime), in
//! `fingerprints.json` in the models directory. A file that changed in place gets a new mtime and is rehashed. If the
//! cache cannot be read or written, fingerprints are still computed, just not remembered.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

const CACHE_FILE: &str = "fingerprints.json";
/// Files above this size get a progress bar while hashing.
const PROGRESS_ABOVE: u64 = 1 << 30;

/// Full SHA-256 (lower-case hex) of the file's content, from the cache when the file is unchanged.
pub fn fingerprint(path: &Path) -> Result<String> {
    let cache_dir = crate::util::models_dir().ok();
    fingerprint_with_cache(path, cache_dir.as_deref(), &mut || {})
}

/// The first 16 hex digits: enough to tell models apart in a message.
pub fn short(fingerprint: &str) -> &str {
    fingerprint.get(..16).unwrap_or(fingerprint)
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Entry {
    size: u64,
    mtime_ns: u128,
    sha256: String,
}

/// Cache file content: canonical path → entry.
type Cache = BTreeMap<String, Entry>;

/// `on_hash` is called each time the file is actually read and hashed (tests count cache misses with it).
fn fingerprint_with_cache(path: &Path, cache_dir: Option<&Path>, on_hash: &mut dyn FnMut()) -> Result<String> {
    let canonical: PathBuf =
        fs::canonicalize(path).with_context(|| format!("cannot fingerprint {}: file not found", path.display()))?;
    let meta = fs::metadata(&canonical).with_context(|| format!("cannot read {}", path.display()))?;
    let size = meta.len();
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let key = canonical.to_string_lossy().into_owned();
    let cache_path = cache_dir.map(|d| d.join(CACHE_FILE));

    let mut cache: Cache = cache_path.as_deref().and_then(load).unwrap_or_default();
    if let Some(e) = cache.get(&key)
        && e.size == size
        && e.mtime_ns == mtime_ns
        && mtime_ns != 0
    {
        return Ok(e.sha256.clone());
    }

    on_hash();
    let sha256 = hash_file(&canonical, size)?;
    if let Some(cache_path) = cache_path {
        // Re-read just before writing so concurrent processes lose as little as possible; failures are ignored.
        let mut fresh = load(&cache_path).unwrap_or_default();
        fresh.insert(
            key,
            Entry {
                size,
                mtime_ns,
                sha256: sha256.clone(),
            },
        );
        cache = fresh;
        if let Ok(bytes) = serde_json::to_vec_pretty(&cache) {
            let _ = crate::util::write_atomic(&cache_path, &bytes);
        }
    }
    Ok(sha256)
}

fn load(path: &Path) -> Option<Cache> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

fn hash_file(path: &Path, size: u64) -> Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let bar = (size > PROGRESS_ABOVE).then(|| crate::util::byte_bar(size, "fingerprinting model"));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        if let Some(b) = &bar {
            b.inc(n as u64);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(crate::util::hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn counted(path: &Path, cache: Option<&Path>) -> (String, u32) {
        let mut n = 0;
        let fp = fingerprint_with_cache(path, cache, &mut || n += 1).unwrap();
        (fp, n)
    }

    #[test]
    fn content_decides_the_print() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("c"));
        fs::write(&a, b"GGUF weights 123").unwrap();
        fs::write(&b, b"GGUF weights 123").unwrap();
        fs::write(&c, b"GGUF weights 124").unwrap();
        let (fa, fb, fc) = (counted(&a, None).0, counted(&b, None).0, counted(&c, None).0);
        assert_eq!(fa, fb);
        assert_ne!(fa, fc);
        assert_eq!(fa.len(), 64);
        // Known vector: sha256("abc").
        fs::write(&a, b"abc").unwrap();
        assert_eq!(
            counted(&a, None).0,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(short("ba7816bf8f01cfea414140de5dae2223"), "ba7816bf8f01cfea");
        assert_eq!(short("abc"), "abc");
    }

    #[test]
    fn cache_hit_does_not_rehash_and_mtime_change_invalidates() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("models");
        fs::create_dir(&cache).unwrap();
        let model = dir.path().join("m.gguf");
        fs::write(&model, b"weights v1").unwrap();

        let (first, n1) = counted(&model, Some(&cache));
        assert_eq!(n1, 1);
        assert!(cache.join(CACHE_FILE).is_file());
        let (again, n2) = counted(&model, Some(&cache));
        assert_eq!(
            (again.as_str(), n2),
            (first.as_str(), 0),
            "second call must come from the cache"
        );
        // Through a different (non-canonical) spelling of the same path: still a hit.
        let odd = dir.path().join(".").join("m.gguf");
        assert_eq!(counted(&odd, Some(&cache)).1, 0);

        // Same size, new content, new mtime: rehashed, new print.
        fs::write(&model, b"weights v2").unwrap();
        let f = fs::File::options().write(true).open(&model).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(10)).unwrap();
        drop(f);
        let (changed, n3) = counted(&model, Some(&cache));
        assert_eq!(n3, 1);
        assert_ne!(changed, first);

        // Touching the mtime alone also invalidates (the print stays the same, of course).
        let f = fs::File::options().write(true).open(&model).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(20)).unwrap();
        drop(f);
        let (same, n4) = counted(&model, Some(&cache));
        assert_eq!((same, n4), (changed, 1));
    }

    #[test]
    fn unwritable_or_corrupt_cache_falls_back_silently() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        fs::write(&model, b"weights").unwrap();
        let not_a_dir = dir.path().join("plain-file");
        fs::write(&not_a_dir, b"").unwrap();
        let (fp, n) = counted(&model, Some(&not_a_dir));
        assert_eq!(n, 1);
        assert_eq!(fp, counted(&model, None).0);

        let cache = dir.path().join("cache");
        fs::create_dir(&cache).unwrap();
        fs::write(cache.join(CACHE_FILE), b"{ not json").unwrap();
        assert_eq!(counted(&model, Some(&cache)), (fp.clone(), 1));
        assert_eq!(counted(&model, Some(&cache)), (fp, 0), "a corrupt cache is replaced");
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let err = fingerprint_with_cache(Path::new("/nonexistent/model.gguf"), None, &mut || {}).unwrap_err();
        assert!(err.to_string().contains("file not found"), "{err}");
    }

    /// The real cached models hash to the pinned fetch digests: `cargo test -- --ignored real_model_fingerprints`.
    #[test]
    #[ignore]
    fn real_model_fingerprints() {
        let dir = crate::util::models_dir().unwrap();
        for m in crate::fetch::known_models() {
            let path = dir.join(m.file_name);
            let t = std::time::Instant::now();
            let (fp, _) = counted(&path, None);
            eprintln!("{}: {} in {:?}", m.name, short(&fp), t.elapsed());
            assert_eq!(fp, m.sha256);
        }
    }
}
