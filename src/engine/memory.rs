//! The memory check before loading: a model's weights plus the KV it will hold (context × sessions) against the
//! memory the machine has available, as llama.cpp's fit check does. An absurd `-c` or `--parallel` is then refused
//! at start with the figures, instead of ending in the OOM killer halfway through an allocation or, worse, a
//! machine that swaps. `--no-mem-check` loads anyway.

use super::KvCache;
use super::placement::Placement;
use crate::gguf::GgufFile;
use crate::model::Hparams;
use anyhow::{Result, bail};
use std::ops::Range;
use std::path::{Path, PathBuf};

const GIB: f64 = (1u64 << 30) as f64;

/// What a process is about to hold, in bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Need {
    pub weights: u64,
    pub kv: u64,
}

impl Need {
    /// Weights of `layers` of the model at `path` (its file's bytes in proportion to the layers: the embeddings and
    /// output are counted whole once; experts left on disk not at all) and the KV of `sessions` sessions of `n_ctx` positions over those layers.
    pub fn of(path: &Path, layers: Option<Range<usize>>, n_ctx: usize, sessions: usize) -> Result<Need> {
        let file = GgufFile::open(path)?;
        let hp = Hparams::from_gguf(&file)?;
        let file_bytes = std::fs::metadata(path)?.len();
        let layers = layers.unwrap_or(0..hp.n_layer);
        let share = layers.len() as f64 / hp.n_layer.max(1) as f64;
        // Experts left in the mapped file are the page cache's to keep or drop, not an allocation.
        let on_disk: u64 = if crate::model::moe::experts_on_disk() {
            file.tensors
                .values()
                .filter(|t| t.name.ends_with("_exps.weight"))
                .map(|t| t.size as u64)
                .sum()
        } else {
            0
        };
        Ok(Need {
            weights: (file_bytes.saturating_sub(on_disk) as f64 * share) as u64,
            kv: KvCache::bytes_for(&hp, layers.len(), n_ctx).saturating_mul(sessions) as u64,
        })
    }

    /// Several models loaded beside each other (a target and its draft, an ensemble's members), each whole with
    /// `sessions` sessions of `n_ctx` positions: the sum of their [`Need::of`].
    pub fn of_models(paths: &[PathBuf], n_ctx: usize, sessions: usize) -> Result<Need> {
        paths.iter().try_fold(Need { weights: 0, kv: 0 }, |sum, p| {
            Ok(sum.plus(Need::of(p, None, n_ctx, sessions)?))
        })
    }

    pub fn plus(self, o: Need) -> Need {
        Need {
            weights: self.weights.saturating_add(o.weights),
            kv: self.kv.saturating_add(o.kv),
        }
    }

    pub fn total(&self) -> u64 {
        self.weights.saturating_add(self.kv)
    }

    /// Refused when more than `available` bytes, with the figures and what to change.
    pub fn check(&self, what: &str, available: u64) -> Result<()> {
        if self.total() > available {
            bail!(
                "{what} needs {:.1} GiB of weights + {:.1} GiB of KV = {:.1} GiB, more than the {:.1} GiB of memory \
                 available: lower the context (-c) or the sessions, or give --no-mem-check to load anyway",
                self.weights as f64 / GIB,
                self.kv as f64 / GIB,
                self.total() as f64 / GIB,
                available as f64 / GIB
            );
        }
        Ok(())
    }
}

/// Bytes of memory available to a new allocation: `MemAvailable` of `/proc/meminfo`; `None` where it cannot be
/// read (other operating systems).
pub fn available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_available(&s)
}

fn meminfo_available(meminfo: &str) -> Option<u64> {
    let kb = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb.saturating_mul(1024))
}

/// The guard every command that loads a model runs first: `need` (see [`Need::of`]) against [`available`].
/// Skipped with a debug line when `force` is set, where the available memory is unknown, and where layers go to a
/// GPU (its memory is not the host's).
pub fn guard(what: &str, need: impl FnOnce() -> Result<Need>, force: bool) -> Result<()> {
    if force {
        tracing::debug!("memory check: skipped (--no-mem-check)");
        return Ok(());
    }
    if Placement::process().is_ok_and(|p| p.gpu().is_some()) {
        tracing::debug!("memory check: skipped (layers on a GPU)");
        return Ok(());
    }
    let Some(avail) = available() else {
        tracing::debug!("memory check: skipped (no /proc/meminfo on this system)");
        return Ok(());
    };
    let need = need()?;
    tracing::debug!(
        "memory check: {:.2} GiB of weights + {:.2} GiB of KV, {:.2} GiB available",
        need.weights as f64 / GIB,
        need.kv as f64 / GIB,
        avail as f64 / GIB
    );
    need.check(what, avail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_than_available_is_refused_with_the_figures() {
        let need = Need {
            weights: 3 << 30,
            kv: 5 << 30,
        };
        assert!(need.check("x", 8 << 30).is_ok());
        let e = need.check("model m", (15 << 30) / 2).unwrap_err().to_string();
        for part in [
            "model m",
            "3.0 GiB of weights",
            "5.0 GiB of KV",
            "8.0 GiB",
            "7.5 GiB",
            "--no-mem-check",
        ] {
            assert!(e.contains(part), "{part:?} missing: {e}");
        }
    }

    /// A target with its draft, or an ensemble, needs the sum of its models, and is refused with the sum's figures.
    #[test]
    fn models_loaded_together_are_summed() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models");
        let (a, b) = (dir.join("llama3.gguf"), dir.join("qwen2.gguf"));
        let (na, nb) = (Need::of(&a, None, 512, 3).unwrap(), Need::of(&b, None, 512, 3).unwrap());
        let both = Need::of_models(&[a.clone(), b], 512, 3).unwrap();
        assert_eq!(both.weights, na.weights + nb.weights);
        assert_eq!(both.kv, na.kv + nb.kv);
        assert!(na.weights > 0 && na.kv > 0 && nb.weights > 0 && nb.kv > 0);
        assert_eq!(Need::of_models(std::slice::from_ref(&a), 512, 3).unwrap(), na);
        // Room for each alone is not room for both.
        let room = na.total().max(nb.total());
        assert!(na.check("a", room).is_ok() && nb.check("b", room).is_ok());
        let e = both.check("a + draft b", room).unwrap_err().to_string();
        assert!(e.contains("a + draft b needs"), "{e}");
        let twice = Need::of_models(&[a.clone(), a], 512, 3).unwrap();
        assert_eq!(twice, na.plus(na));
    }

    #[test]
    fn meminfo_is_read() {
        let s = "MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:    8000000 kB\n";
        assert_eq!(meminfo_available(s), Some(8_000_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 5 kB\n"), None);
        if cfg!(target_os = "linux") {
            assert!(available().is_some_and(|a| a > 0));
        }
    }

    #[test]
    fn an_absurd_need_saturates_and_is_refused() {
        let need = Need {
            weights: 1,
            kv: u64::MAX,
        };
        assert_eq!(need.total(), u64::MAX);
        assert!(need.check("m", u64::MAX - 1).is_err());
    }
}
