//! Models loaded once per process and shared by every session that runs them (the server's slots, ensemble members,
//! draft models): the mapping and the weights repacked at load exist once however many sessions use them.

use super::Model;
use crate::kernels::ThreadPool;
use anyhow::Result;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Whole models by file path, and the one thread pool their sessions share.
pub struct ModelCache {
    models: Mutex<HashMap<PathBuf, Arc<Model>>>,
    pool: Arc<ThreadPool>,
}

impl ModelCache {
    pub fn new(pool: Arc<ThreadPool>) -> ModelCache {
        ModelCache {
            models: Mutex::new(HashMap::new()),
            pool,
        }
    }

    /// The model at `path`, loaded on first use. Loading holds the lock: two slots asking at once load it once.
    pub fn get(&self, path: &Path) -> Result<Arc<Model>> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = models.get(&key) {
            return Ok(m.clone());
        }
        let m = Arc::new(Model::load(path)?);
        models.insert(key, m.clone());
        Ok(m)
    }

    pub fn pool(&self) -> &Arc<ThreadPool> {
        &self.pool
    }
}

impl std::fmt::Debug for ModelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.models.lock().map_or(0, |m| m.len());
        write!(f, "ModelCache({n} models, {} threads)", self.pool.n_threads())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_load_per_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let vocab = crate::gguf::GgufFile::open(&crate::fetch::resolve("smollm2").unwrap()).unwrap();
        let spec = crate::model::random::RandomSpec::tiny(crate::model::Arch::Llama);
        crate::model::random::write_random_model(&vocab, &spec, &path).unwrap();
        let cache = ModelCache::new(Arc::new(ThreadPool::new(1)));
        let a = cache.get(&path).unwrap();
        let b = cache.get(&dir.path().join(".").join("tiny.gguf")).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the same file was loaded twice");
        assert!(cache.get(&dir.path().join("missing.gguf")).is_err());
    }
}
