//! Where a model runs, built in one place for every front end (`baton run`, `serve`, `bench --pipeline`, and
//! `demo` through its `baton run` children), and the generators over nodes. It sits above `cluster` (which its
//! generators drive), `speculative` and `ensemble`, and below the front ends.
//!
//! - [`Builder`]: the topology flags, with the shared secret read once, and one constructor per generator;
//! - [`pipeline`]: [`PipelineGenerator`], layers spread over `baton node`s, or one remote decode node;
//! - [`disagg`]: [`DisaggGenerator`], a model here whose prompts a prefill pool prefills.

pub mod disagg;
pub mod pipeline;

pub use disagg::DisaggGenerator;
pub use pipeline::PipelineGenerator;

use crate::cluster::PipelineOpts;
use crate::cluster::disagg::{Offload, PrefillPool, RemotePrefill};
use crate::cluster::handoff::NodeOpts;
use crate::cluster::handshake::Timeouts;
use crate::engine::memory::{self, Need};
use crate::engine::sampler::SamplerParams;
use crate::engine::snapshot::RowDtype;
use crate::ensemble::{Combine, Ensemble, EnsembleOpts, MemberOpts, Place, RETRY_DROPPED, parse_members};
use crate::generate::{Generator, LocalGenerator};
use crate::kernels::ThreadPool;
use crate::model::{Model, ModelCache};
use crate::speculative::{DraftSpec, SpecGenerator, SpecOptions, parse_draft_tokens};
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The flags that say where a model runs, as `baton run` and `baton serve` take them (serve's cluster file has
/// already overridden its share).
#[derive(Clone, Debug)]
pub struct TopologyArgs {
    /// `smollm2`, `gemma3` or a GGUF path.
    pub model: String,
    pub threads: usize,
    pub n_ctx: usize,
    pub n_batch: usize,
    /// `HOST:PORT=A:B,...,local=C:end`.
    pub pipeline: Option<String>,
    pub wire_bits: String,
    pub secret_file: Option<PathBuf>,
    /// Longest wait on a node's answer (`None`: the pipeline's default).
    pub node_timeout: Option<Duration>,
    /// Prefill nodes, `HOST:PORT,...`.
    pub prefill_node: Option<String>,
    /// A remote whole-model decode node (`baton run --decode-node`).
    pub decode_node: Option<String>,
    pub offload: String,
    /// `--offload-layers`: overrides `offload`.
    pub offload_layers: Option<usize>,
    pub kv_bits: String,
    pub prefill_timeout: Duration,
    pub draft: Option<String>,
    pub draft_tokens: String,
    pub ensemble: Option<String>,
    pub combine: String,
    pub ensemble_degrade: bool,
    /// Sampling a pipeline's last stage starts with (each request sets its own); `None`: the stage's default.
    pub sampling: Option<SamplerParams>,
    /// Replays, reconnects and member failures on standard error.
    pub verbose: bool,
    /// Load a local model even when its weights and KV exceed the memory available (`engine::memory`).
    pub no_mem_check: bool,
}

impl Default for TopologyArgs {
    fn default() -> Self {
        TopologyArgs {
            model: "smollm2".into(),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            n_ctx: 4096,
            n_batch: 256,
            pipeline: None,
            wire_bits: "32".into(),
            secret_file: None,
            node_timeout: None,
            prefill_node: None,
            decode_node: None,
            offload: "auto".into(),
            offload_layers: None,
            kv_bits: "16".into(),
            prefill_timeout: Duration::from_secs(10),
            draft: None,
            draft_tokens: "auto".into(),
            ensemble: None,
            combine: "union".into(),
            ensemble_degrade: false,
            sampling: None,
            verbose: false,
            no_mem_check: false,
        }
    }
}

/// Builds the generators of one topology. The secret file is read on first use and only then, so a local run never
/// needs it, and at most once, however many links and slots use it.
pub struct Builder {
    pub args: TopologyArgs,
    secret: OnceLock<Option<Vec<u8>>>,
}

impl Builder {
    pub fn new(args: TopologyArgs) -> Builder {
        Builder {
            args,
            secret: OnceLock::new(),
        }
    }

    /// The shared secret of `--secret-file`, read once.
    pub fn secret(&self) -> Result<Option<Vec<u8>>> {
        if let Some(s) = self.secret.get() {
            return Ok(s.clone());
        }
        let s = self
            .args
            .secret_file
            .as_deref()
            .map(crate::cluster::auth::load_secret)
            .transpose()?;
        Ok(self.secret.get_or_init(|| s).clone())
    }

    /// How a pipeline reaches its stages: context, chunk, wire precision, secret, threads and node timeout.
    pub fn pipeline_opts(&self) -> Result<PipelineOpts> {
        let a = &self.args;
        let mut opts = PipelineOpts {
            n_ctx: a.n_ctx,
            chunk: a.n_batch.min(512),
            wire: RowDtype::parse(&a.wire_bits)?,
            secret: self.secret()?,
            threads: a.threads,
            verbose: a.verbose,
            ..Default::default()
        };
        if let Some(s) = &a.sampling {
            opts.sampling = *s;
        }
        if let Some(io) = a.node_timeout {
            opts.timeouts.io = io;
        }
        Ok(opts)
    }

    /// `--offload` / `--offload-layers`.
    pub fn offload(&self) -> Result<Offload> {
        Ok(match self.args.offload_layers {
            Some(k) => Offload::Layers(k),
            None => Offload::parse(&self.args.offload)?,
        })
    }

    /// KV precision between prefill and decode side (`--kv-bits`).
    pub fn kv(&self) -> Result<RowDtype> {
        RowDtype::parse(&self.args.kv_bits)
    }

    /// How this process's decode side reaches each prefill node (the address is filled in per member).
    pub fn prefill_link(&self) -> Result<NodeOpts> {
        Ok(NodeOpts {
            addr: String::new(),
            secret: self.secret()?,
            timeouts: Timeouts {
                connect: Timeouts::default().connect,
                io: self.args.prefill_timeout,
            },
            kv: self.kv()?,
        })
    }

    /// Prefills of a remote decode node, pulled from `pool`.
    pub fn remote_prefill(&self, pool: Arc<PrefillPool>) -> Result<RemotePrefill> {
        Ok(RemotePrefill::new(
            pool,
            self.offload()?,
            self.kv()?,
            self.args.prefill_timeout,
        ))
    }

    /// A pipeline over `spec`, its prompts prefilled through `remote` when given.
    pub fn pipeline(&self, spec: &str, path: &Path, remote: Option<RemotePrefill>) -> Result<PipelineGenerator> {
        PipelineGenerator::connect(spec, path, self.pipeline_opts()?, remote)
    }

    /// `model` decoding here, prompts prefilled on `prefill`.
    pub fn disagg(
        &self,
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        prefill: Arc<PrefillPool>,
    ) -> Result<DisaggGenerator> {
        let a = &self.args;
        DisaggGenerator::new(
            model,
            pool,
            a.n_ctx,
            a.n_batch,
            self.prefill_link()?,
            prefill,
            self.offload()?,
        )
    }

    /// Speculative decoding of `target` with `draft` (`MODEL` or `MODEL@HOST:PORT`); `models` shares a local
    /// draft's model with other generators.
    pub fn speculative(
        &self,
        target: Arc<Model>,
        pool: Arc<ThreadPool>,
        draft: &str,
        models: Option<Arc<ModelCache>>,
    ) -> Result<SpecGenerator> {
        let spec = DraftSpec::parse(draft)?;
        SpecGenerator::open(target, pool, &spec, self.spec_options(models)?)
    }

    /// The options [`Self::speculative`] opens a draft with.
    pub fn spec_options(&self, models: Option<Arc<ModelCache>>) -> Result<SpecOptions> {
        Ok(SpecOptions {
            draft_tokens: parse_draft_tokens(&self.args.draft_tokens)?,
            n_ctx: self.args.n_ctx,
            n_batch: self.args.n_batch,
            secret: self.secret()?,
            models,
            ..Default::default()
        })
    }

    /// The options of the ensemble `spec`; `models` shares local members' models with other ensembles.
    pub fn ensemble_opts(&self, spec: &str, models: Option<Arc<ModelCache>>) -> Result<EnsembleOpts> {
        let a = &self.args;
        Ok(EnsembleOpts {
            members: parse_members(spec)?,
            combine: Combine::parse(&a.combine)?,
            degrade: a.ensemble_degrade,
            member: MemberOpts {
                n_ctx: a.n_ctx,
                n_batch: a.n_batch.min(512),
                threads: a.threads,
                pipeline: self.pipeline_opts()?,
                models,
                ..Default::default()
            },
            verbose: true,
            retry_dropped: RETRY_DROPPED,
        })
    }

    /// The memory guard over every model this process loads beside each other: the target at `target` (when it
    /// runs here), a local draft and the ensemble's local members, each with `sessions` sessions of the context.
    pub fn guard_memory(&self, target: Option<&Path>, sessions: usize) -> Result<()> {
        let a = &self.args;
        let draft = a.draft.as_deref().map(DraftSpec::parse).transpose()?;
        let draft = draft.filter(|d| d.addr.is_none()).map(|d| d.model);
        let members: Vec<String> = match &a.ensemble {
            Some(spec) => parse_members(spec)?
                .into_iter()
                .filter(|m| matches!(m.place, Place::Local))
                .map(|m| m.model)
                .collect(),
            None => vec![],
        };
        let mut names: Vec<String> = target.map(|p| p.display().to_string()).into_iter().collect();
        names.extend(draft.iter().map(|d| format!("draft {d}")));
        names.extend(members.iter().map(|m| format!("member {m}")));
        let mut what = names.join(" + ");
        if sessions > 1 {
            what = format!("{what} with {sessions} slots");
        }
        let need = || {
            let mut paths: Vec<PathBuf> = target.map(Path::to_path_buf).into_iter().collect();
            for m in draft.iter().chain(&members) {
                paths.push(crate::fetch::resolve(m)?);
            }
            Need::of_models(&paths, a.n_ctx, sessions)
        };
        memory::guard(&what, need, a.no_mem_check)
    }

    /// The one generator `baton run` asks for: an ensemble, a pipeline (or a remote decode node, with prefill nodes
    /// or not), a speculative pair, a disaggregated pair, or a local model.
    pub fn generator(&self) -> Result<Box<dyn Generator>> {
        let a = &self.args;
        if let Some(spec) = &a.ensemble {
            if a.pipeline.is_some() || a.draft.is_some() {
                bail!("--ensemble cannot be combined with --pipeline or --draft");
            }
            self.guard_memory(None, 1)?;
            return Ok(Box::new(Ensemble::open(&self.ensemble_opts(spec, None)?)?));
        }
        let decode_spec = a.decode_node.as_ref().map(|d| format!("{d}=0:end"));
        if a.pipeline.is_some() && decode_spec.is_some() {
            bail!("give either --pipeline or --decode-node, not both");
        }
        if a.pipeline.is_some() && a.prefill_node.is_some() {
            bail!("--prefill-node pairs with a whole-model decode side: this process, or --decode-node HOST:PORT");
        }
        if let Some(spec) = a.pipeline.as_ref().or(decode_spec.as_ref()) {
            if a.draft.is_some() {
                bail!("--draft runs the target on this machine; it cannot be combined with --pipeline yet");
            }
            let path = crate::fetch::resolve(&a.model)?;
            let opts = self.pipeline_opts()?;
            let remote = match &a.prefill_node {
                Some(list) => Some(self.remote_prefill(PrefillPool::from_list(list)?)?),
                None => None,
            };
            return Ok(Box::new(PipelineGenerator::connect(spec, &path, opts, remote)?));
        }
        let path = crate::fetch::resolve(&a.model)?;
        self.guard_memory(Some(&path), 1)?;
        let pool = Arc::new(ThreadPool::new(a.threads));
        let model = load(&a.model, &pool)?;
        if let Some(d) = &a.draft {
            if a.prefill_node.is_some() {
                bail!("--draft and --prefill-node cannot be combined yet");
            }
            return Ok(Box::new(self.speculative(model, pool, d, None)?));
        }
        if let Some(list) = &a.prefill_node {
            return Ok(Box::new(self.disagg(model, pool, PrefillPool::from_list(list)?)?));
        }
        Ok(Box::new(
            LocalGenerator::new(model, pool, a.n_ctx, a.n_batch)?.with_progress(a.verbose),
        ))
    }
}

/// Loads a whole model (name or path) for `pool`'s threads, saying so on standard error. The tokenizer is built by
/// whoever needs it, once.
pub fn load(model: &str, pool: &ThreadPool) -> Result<Arc<Model>> {
    let path = crate::fetch::resolve(model)?;
    let t0 = Instant::now();
    let model = Arc::new(Model::load(&path)?);
    tracing::info!(
        "loaded {} ({}, {} layers, {} tokens) in {:.2} s, {} threads",
        path.display(),
        model.hp.arch.name(),
        model.hp.n_layer,
        model.hp.n_vocab,
        t0.elapsed().as_secs_f64(),
        pool.n_threads()
    );
    Ok(model)
}
