//! Slots whose generator combines several models: an ensemble (`--ensemble`) or a target with a draft (`--draft`).
//! Every slot gets its own generator (own KV, own connections to remote members or drafts), while the models loaded
//! in this process are loaded once and shared through one [`ModelCache`].

use super::ServeConfig;
use super::queue::{Factory, NodeSpec};
use crate::ensemble::{Ensemble, parse_members};
use crate::generate::Generator;
use crate::kernels::ThreadPool;
use crate::model::ModelCache;
use crate::speculative::DraftSpec;
use crate::topology::Builder;
use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;

/// The id `/v1/models` lists for an ensemble: its members' models joined by `+` (e.g. `smollm2+gemma3`).
pub fn ensemble_id(spec: &str) -> Result<String> {
    Ok(parse_members(spec)?
        .iter()
        .map(|m| m.model.as_str())
        .collect::<Vec<_>>()
        .join("+"))
}

/// One ensemble per slot, its local members' models shared by all slots. A member that fails ends the request,
/// unless `--ensemble-degrade`; a dropped member is tried again [`crate::ensemble::RETRY_DROPPED`] later.
pub fn ensemble_slots(
    cfg: &ServeConfig,
    builder: &Builder,
    spec: &str,
    cache: Arc<ModelCache>,
) -> Result<(NodeSpec, String)> {
    let opts = builder.ensemble_opts(spec, Some(cache))?;
    // Open one now: a bad spec, a missing model or an unreachable member fails the start, not the first request.
    let first = Ensemble::open(&opts).context("cannot open the ensemble")?;
    let describe = format!("{}, {} slots", first.describe(), cfg.parallel);
    let factory: Factory = Arc::new(move || Ok(Box::new(Ensemble::open(&opts)?) as Box<dyn Generator>));
    Ok((slots(cfg, factory), describe))
}

/// One speculative generator per slot: the target (`path`) and a local draft loaded once, or a remote draft that
/// each slot connects to on its own.
pub fn draft_slots(
    cfg: &ServeConfig,
    builder: &Arc<Builder>,
    path: &Path,
    draft: &str,
    cache: Arc<ModelCache>,
) -> Result<(NodeSpec, String)> {
    // A bad draft spec, --draft-tokens or secret fails here, before the target is loaded.
    DraftSpec::parse(draft)?;
    builder.spec_options(None)?;
    let target = cache.get(path)?;
    let (builder, draft) = (builder.clone(), draft.to_string());
    let open = move || -> Result<Box<dyn Generator>> {
        let g = builder.speculative(target.clone(), cache.pool().clone(), &draft, Some(cache.clone()))?;
        Ok(Box::new(g))
    };
    let first = open().context("cannot open the draft")?;
    let describe = format!("{}, {} slots", first.describe(), cfg.parallel);
    Ok((slots(cfg, Arc::new(open)), describe))
}

fn slots(cfg: &ServeConfig, factory: Factory) -> NodeSpec {
    NodeSpec {
        label: "local".into(),
        addr: None,
        slots: cfg.parallel,
        factory,
        disk_cache: false,
    }
}

/// The cache the slots share: one pool of `--threads`.
pub fn cache(cfg: &ServeConfig) -> Arc<ModelCache> {
    Arc::new(ModelCache::new(Arc::new(ThreadPool::new(cfg.threads))))
}
