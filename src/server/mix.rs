//! Slots whose generator combines several models: an ensemble (`--ensemble`) or a target with a draft (`--draft`).
//! Every slot gets its own generator (own KV, own connections to remote members or drafts), while the models loaded
//! in this process are loaded once and shared through one [`ModelCache`].

use super::ServeConfig;
use super::queue::{Factory, NodeSpec};
use crate::cluster::PipelineOpts;
use crate::ensemble::{Combine, Ensemble, EnsembleOpts, MemberOpts, RETRY_DROPPED, parse_members};
use crate::generate::Generator;
use crate::kernels::ThreadPool;
use crate::model::ModelCache;
use crate::speculative::{DraftSpec, SpecGenerator, SpecOptions, parse_draft_tokens};
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
/// unless `--ensemble-degrade`; a dropped member is tried again [`RETRY_DROPPED`] later.
pub fn ensemble_slots(
    cfg: &ServeConfig,
    spec: &str,
    pipeline: PipelineOpts,
    cache: Arc<ModelCache>,
) -> Result<(NodeSpec, String)> {
    let opts = EnsembleOpts {
        members: parse_members(spec)?,
        combine: Combine::parse(&cfg.combine)?,
        degrade: cfg.ensemble_degrade,
        member: MemberOpts {
            n_ctx: cfg.ctx_size,
            n_batch: cfg.batch_size.min(512),
            threads: cfg.threads,
            pipeline,
            models: Some(cache),
            ..Default::default()
        },
        verbose: true,
        retry_dropped: RETRY_DROPPED,
    };
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
    path: &Path,
    draft: &str,
    secret: Option<Vec<u8>>,
    cache: Arc<ModelCache>,
) -> Result<(NodeSpec, String)> {
    let spec = DraftSpec::parse(draft)?;
    let target = cache.get(path)?;
    let opts = SpecOptions {
        draft_tokens: parse_draft_tokens(&cfg.draft_tokens)?,
        n_ctx: cfg.ctx_size,
        n_batch: cfg.batch_size,
        secret,
        models: Some(cache.clone()),
        ..Default::default()
    };
    let open = move || -> Result<Box<dyn Generator>> {
        let g = SpecGenerator::open(target.clone(), cache.pool().clone(), &spec, opts.clone())?;
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
    }
}

/// The cache the slots share: one pool of `--threads`.
pub fn cache(cfg: &ServeConfig) -> Arc<ModelCache> {
    Arc::new(ModelCache::new(Arc::new(ThreadPool::new(cfg.threads))))
}
