//! The prefix cache on disk (`--kv-cache-dir`): KV of prompt prefixes kept across requests and restarts, so a
//! long prefix sent again is read back instead of prefilled.
//!
//! Entries are [`BLOCK`]-token blocks in the snapshot format (docs/kv-format.md, f16: exactly what the cache
//! holds). Block `i` holds positions `i*BLOCK..(i+1)*BLOCK` and is named by a hash of the weights' fingerprint, the
//! layer range, the numerics, the element type and every token id up to its end, so one name always means one
//! prefix. A lookup reads blocks in order until one is missing; an entry that fails any check (checksum, header,
//! token ids) is deleted and recomputed, never used. Files are written atomically (temporary file, fsync, rename)
//! by a background thread, so processes sharing a directory only ever see whole entries; the directory is kept
//! under its size by deleting the least recently used entries (a hit refreshes an entry's time).

use super::Session;
use super::kv_cache::KvBlock;
use super::snapshot::{self, RowDtype};
use crate::model::Model;
use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

/// Positions per entry: small enough that most of a long prefix is reused, large enough that a file costs little
/// next to its data.
pub const BLOCK: usize = 256;
/// Element type of the entries: the in-memory cache's own, so a hit computes exactly what a cold prefill would.
const DTYPE: RowDtype = RowDtype::F16;
const EXT: &str = "kv";
/// A temporary file older than this was left by a process that died mid-write.
const STALE_TMP: Duration = Duration::from_secs(600);

/// One block waiting for the writer thread.
struct Pending {
    path: PathBuf,
    model: Arc<Model>,
    block: KvBlock,
}

#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
    tx: Mutex<Option<mpsc::Sender<Pending>>>,
    writer: Option<JoinHandle<()>>,
}

impl DiskCache {
    /// Opens (creating) `dir`, kept under `max_bytes` of entries.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<DiskCache> {
        if max_bytes == 0 {
            bail!("--kv-cache-size must be above 0");
        }
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create --kv-cache-dir {}", dir.display()))?;
        let probe = tempfile::NamedTempFile::new_in(dir)
            .with_context(|| format!("--kv-cache-dir {} is not writable", dir.display()))?;
        drop(probe);
        let (tx, rx) = mpsc::channel::<Pending>();
        let (wdir, wmax) = (dir.to_path_buf(), max_bytes);
        let writer = std::thread::Builder::new()
            .name("kv-cache-writer".into())
            .spawn(move || write_loop(&wdir, wmax, rx))?;
        Ok(DiskCache {
            dir: dir.to_path_buf(),
            max_bytes,
            tx: Mutex::new(Some(tx)),
            writer: Some(writer),
        })
    }

    /// `--kv-cache-size` in GiB.
    pub fn open_gib(dir: &Path, gib: f64) -> Result<DiskCache> {
        if !(gib > 0.0 && gib.is_finite()) {
            bail!("--kv-cache-size must be a positive number of GiB, not {gib}");
        }
        DiskCache::open(dir, crate::util::gib_bytes(gib))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The file of the block ending at `tokens.len()` for this session's model, layers and numerics.
    fn path_of(&self, s: &Session, tokens: &[u32]) -> Result<PathBuf> {
        let mut h = Sha256::new();
        h.update(b"baton-kv-prefix\0");
        h.update(s.model().fingerprint()?.as_bytes());
        let layers = &s.kv().layers;
        h.update(
            format!(
                "\0{}..{}\0{:?}\0{}\0",
                layers.start,
                layers.end,
                s.numerics(),
                DTYPE.name()
            )
            .as_bytes(),
        );
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let name: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(self.dir.join(format!("{name}.{EXT}")))
    }

    /// Extends the prefix of `tokens` the session holds with the blocks on disk that follow it, leaving at least
    /// one token to feed. Returns the positions now held. A bad entry is deleted and the lookup stops there: it
    /// costs only the recomputation.
    pub fn load_prefix(&self, s: &mut Session, tokens: &[u32]) -> Result<usize> {
        let limit = tokens.len().saturating_sub(1).min(s.n_ctx());
        let mut i = s.n_past() / BLOCK;
        let mut loaded = 0;
        while (i + 1) * BLOCK <= limit {
            let pos = i * BLOCK..(i + 1) * BLOCK;
            let path = self.path_of(s, &tokens[..pos.end])?;
            let bytes = match std::fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) => {
                    tracing::warn!("kv-cache: cannot read {}: {e}", path.display());
                    break;
                }
            };
            if let Err(e) = check_and_apply(s, &bytes, pos.clone(), &tokens[pos.clone()]) {
                tracing::warn!("kv-cache: dropping {} ({e:#}); recomputing", path.display());
                let _ = std::fs::remove_file(&path);
                break;
            }
            touch(&path);
            loaded += pos.len();
            i += 1;
        }
        // What the session holds, not what was counted: a block refused after its rewind leaves less.
        let held = s.n_past();
        if loaded > 0 {
            tracing::info!(
                "kv-cache: hit {held} tokens from {} ({loaded} read from disk)",
                self.dir.display()
            );
        }
        Ok(held)
    }

    /// Queues for writing every whole block of `tokens` that the session holds: those the directory lacks, and
    /// every one past `fresh_from` (positions just computed because the directory had no good entry there, so one
    /// there is damaged or orphaned and is replaced).
    pub fn store_prefix(&self, s: &Session, tokens: &[u32], fresh_from: usize) -> Result<()> {
        let n = s.n_past().min(tokens.len());
        if s.tokens().get(..n) != Some(&tokens[..n]) {
            bail!("the session does not hold these tokens");
        }
        let tx = self.tx.lock().unwrap();
        let Some(tx) = tx.as_ref() else { return Ok(()) };
        let mut queued = 0;
        for i in 0..n / BLOCK {
            let pos = i * BLOCK..(i + 1) * BLOCK;
            let path = self.path_of(s, &tokens[..pos.end])?;
            if pos.end <= fresh_from && path.exists() {
                continue;
            }
            let mut block = KvBlock::from_cache(s.kv(), s.kv().layers.clone(), pos.clone());
            block.tokens = Some(tokens[pos].to_vec());
            let _ = tx.send(Pending {
                path,
                model: s.model().clone(),
                block,
            });
            queued += 1;
        }
        if queued > 0 {
            tracing::info!(
                "kv-cache: writing {queued} blocks ({} tokens) to {}",
                queued * BLOCK,
                self.dir.display()
            );
        }
        Ok(())
    }

    /// Waits until every queued block is written (a process about to exit; tests).
    pub fn flush(&mut self) {
        self.tx.lock().unwrap().take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl Drop for DiskCache {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Decodes an entry (every header field and checksum), checks it holds `pos` of exactly `tokens`, and writes it
/// into the session.
fn check_and_apply(s: &mut Session, bytes: &[u8], pos: std::ops::Range<usize>, tokens: &[u32]) -> Result<()> {
    let (block, dt) = snapshot::decode_for(s, bytes)?;
    if block.pos != pos || dt != DTYPE {
        bail!(
            "entry holds positions {:?} at {}, expected {pos:?} at {}",
            block.pos,
            dt.name(),
            DTYPE.name()
        );
    }
    if block.tokens.as_deref() != Some(tokens) {
        bail!("entry's token ids differ from the prompt's");
    }
    snapshot::apply(s, &block)
}

/// Marks an entry as just used, for the LRU order (best effort: another process may have evicted it).
fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::options().append(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// The writer thread: encodes, writes atomically, and evicts down to `max_bytes` when over it.
fn write_loop(dir: &Path, max_bytes: u64, rx: mpsc::Receiver<Pending>) {
    let mut total = evict(dir, max_bytes);
    for p in rx {
        let written = p
            .model
            .fingerprint()
            .and_then(|fp| snapshot::encode_block(&p.model.hp, fp, &p.block, DTYPE))
            .and_then(|bytes| crate::util::write_atomic(&p.path, &bytes).map(|_| bytes.len() as u64));
        match written {
            Ok(n) => total += n,
            Err(e) => tracing::warn!("kv-cache: cannot write {}: {e:#}", p.path.display()),
        }
        if total > max_bytes {
            total = evict(dir, max_bytes);
        }
    }
}

/// Deletes the least recently used entries until those left take at most `max_bytes`, and temporary files left
/// by dead writers. Returns the bytes left. Entries of other processes count too: the bound is the directory's.
pub fn evict(dir: &Path, max_bytes: u64) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    let now = SystemTime::now();
    let mut entries: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    for e in rd.flatten() {
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        let mtime = meta.modified().unwrap_or(now);
        if path.extension().is_some_and(|x| x == EXT) {
            entries.push((mtime, meta.len(), path));
        } else if e.file_name().to_string_lossy().starts_with(".tmp")
            && now.duration_since(mtime).unwrap_or_default() > STALE_TMP
        {
            let _ = std::fs::remove_file(&path);
        }
    }
    let mut total: u64 = entries.iter().map(|e| e.1).sum();
    entries.sort();
    for (_, len, path) in entries {
        if total <= max_bytes {
            break;
        }
        if std::fs::remove_file(&path).is_ok() {
            total -= len;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_keeps_the_most_recent_entries_under_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = SystemTime::now() - Duration::from_secs(100);
        for i in 0..10u64 {
            let p = dir.path().join(format!("{i}.{EXT}"));
            std::fs::write(&p, vec![0u8; 1000]).unwrap();
            let f = std::fs::File::options().append(true).open(&p).unwrap();
            f.set_modified(t0 + Duration::from_secs(i)).unwrap();
        }
        std::fs::write(dir.path().join("other.txt"), b"not an entry").unwrap();
        assert_eq!(evict(dir.path(), 3500), 3000);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["7.kv", "8.kv", "9.kv", "other.txt"]);
    }

    #[test]
    fn a_size_of_zero_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(DiskCache::open_gib(dir.path(), 0.0).is_err());
        assert!(DiskCache::open_gib(dir.path(), f64::NAN).is_err());
    }
}
