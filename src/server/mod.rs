//! `baton serve`: an OpenAI-compatible HTTP server over any [`Generator`] topology.
//!
//! - [`openai`]: request parsing and validation, response bodies and stream chunks, error objects;
//! - [`routes`]: axum routes, authentication, SSE;
//! - [`queue`]: slots (one Generator and one thread each), the bounded queue, retries, health checks;
//! - [`router`]: which slot takes a request (longest cached prefix unless overloaded, else least loaded);
//! - [`stop`]: stop strings over a token stream; [`metrics`]: Prometheus text; [`cluster_file`]: `--cluster`.
//!
//! Data flow: HTTP handler → parse → `Scheduler::submit` → a slot's thread runs `Generator::generate` → events on
//! a channel → JSON body or SSE chunks. The async runtime only moves bytes; engine work runs on slot threads.

pub mod cluster_file;
pub mod metrics;
pub mod openai;
pub mod queue;
pub mod router;
pub mod routes;
pub mod stop;

use crate::cluster::{PipelineOpts, WireDtype};
use crate::engine::batcher::Batcher;
use crate::generate::{GenParams, Generator, LocalGenerator, Outcome, Piece, PipelineGenerator, Prompt};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Context, Result, bail};
use cluster_file::{ClusterFile, NodeEntry, Topology};
use metrics::Metrics;
use queue::{Factory, NodeSpec, Scheduler};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Longest a batched decode step waits for decoding sessions that are not ready yet (a lone session never waits):
/// a small fraction of a step, so a session that is late by more goes into the next step instead.
const BATCH_WINDOW: Duration = Duration::from_millis(3);

#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// `smollm2`, `gemma3` or a GGUF path (the coordinator's copy when layers run elsewhere).
    pub model: String,
    /// The id clients name in requests (default: the model argument's file stem).
    pub served_name: Option<String>,
    pub listen: String,
    /// Required when `listen` is not a loopback address.
    pub api_key: Option<String>,
    /// Sessions at once (local, pipeline) or per decode node (default for a node without `slots`).
    pub parallel: usize,
    /// Requests that may wait for a slot; beyond them, 429.
    pub queue: usize,
    /// Local slots decode together in batched steps (else one session per forward, taking turns).
    pub batch_decode: bool,
    pub threads: usize,
    pub ctx_size: usize,
    pub batch_size: usize,
    pub pipeline: Option<String>,
    pub cluster: Option<PathBuf>,
    pub wire_bits: String,
    pub secret_file: Option<PathBuf>,
    /// Longest wait on a node's answer (a node that hangs fails the request after this).
    pub node_timeout: Duration,
    /// Period of the nodes' health checks.
    pub health_every: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            model: "smollm2".into(),
            served_name: None,
            listen: "127.0.0.1:8080".into(),
            api_key: None,
            parallel: 1,
            queue: 16,
            batch_decode: true,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            ctx_size: 4096,
            batch_size: 256,
            pipeline: None,
            cluster: None,
            wire_bits: "32".into(),
            secret_file: None,
            node_timeout: Duration::from_secs(30),
            health_every: Duration::from_secs(1),
        }
    }
}

/// Runs the server until the process is stopped.
pub fn serve(cfg: ServeConfig) -> Result<()> {
    let addr: SocketAddr = cfg
        .listen
        .parse()
        .with_context(|| format!("--listen {:?} must be IP:PORT", cfg.listen))?;
    if !addr.ip().is_loopback() && cfg.api_key.is_none() {
        bail!("listening on {} (not loopback) needs --api-key", addr.ip());
    }
    if cfg.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let file = cfg.cluster.as_deref().map(ClusterFile::load).transpose()?;
    let model_arg = file
        .as_ref()
        .and_then(|f| f.model.clone())
        .unwrap_or_else(|| cfg.model.clone());
    let path = crate::fetch::resolve(&model_arg)?;
    let (model_id, aliases) = model_ids(&cfg, &model_arg, &path);
    let metrics = Arc::new(Metrics::default());
    let (nodes, describe) = build_nodes(&cfg, file.as_ref(), &path, &metrics)?;
    let sched = Scheduler::start(nodes, cfg.queue, metrics.clone());
    sched.clone().health_loop(cfg.health_every);

    let app = Arc::new(routes::App {
        sched,
        metrics,
        model_id,
        aliases,
        api_key: cfg.api_key.clone(),
        describe,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    // Two runtime threads are plenty to move bytes; compute runs on the slots' threads.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        eprintln!(
            "serve: {} ({}) listening on http://{}",
            app.model_id,
            app.describe,
            listener.local_addr()?
        );
        axum::serve(listener, routes::router(app)).await?;
        Ok(())
    })
}

/// The id `/v1/models` lists (`--served-name`, else the known model's short name, else the file stem) and the other
/// names a request may use for the same model (short name, file name, file stem, the --model argument).
fn model_ids(cfg: &ServeConfig, arg: &str, path: &Path) -> (String, Vec<String>) {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = path
        .file_stem()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let known = crate::fetch::known_models()
        .iter()
        .find(|m| m.file_name == file)
        .map(|m| m.name.to_string());
    let id = cfg
        .served_name
        .clone()
        .or(known.clone())
        .unwrap_or_else(|| stem.clone());
    let aliases = [known, Some(file), Some(stem), Some(arg.to_string())]
        .into_iter()
        .flatten()
        .collect();
    (id, aliases)
}

fn pipeline_opts(cfg: &ServeConfig, wire_bits: &str, secret: Option<&Path>) -> Result<PipelineOpts> {
    let mut opts = PipelineOpts {
        n_ctx: cfg.ctx_size,
        chunk: cfg.batch_size.min(512),
        wire: WireDtype::parse(wire_bits)?,
        secret: secret.map(crate::cluster::auth::load_secret).transpose()?,
        threads: cfg.threads,
        ..Default::default()
    };
    opts.timeouts.io = cfg.node_timeout;
    Ok(opts)
}

/// The slots' nodes for the chosen topology, and a one-line description.
fn build_nodes(
    cfg: &ServeConfig,
    file: Option<&ClusterFile>,
    path: &Path,
    metrics: &Arc<Metrics>,
) -> Result<(Vec<NodeSpec>, String)> {
    let topology = match (file, &cfg.pipeline) {
        (Some(_), Some(_)) => bail!("give either --pipeline or --cluster, not both"),
        (Some(f), None) => Some(f.topology()?),
        (None, Some(spec)) => Some(Topology::Pipeline(spec.clone())),
        (None, None) => None,
    };
    let wire_bits = file
        .and_then(|f| f.wire_bits.clone())
        .unwrap_or_else(|| cfg.wire_bits.clone());
    let secret = file
        .and_then(|f| f.secret_file.clone())
        .or_else(|| cfg.secret_file.clone());
    let name = path
        .file_name()
        .map_or(String::new(), |f| f.to_string_lossy().into_owned());
    match topology {
        None => {
            let model = Arc::new(Model::load(path)?);
            // One pool shared by every slot, each slot keeps its own KV. Prefills take turns on the pool op by op;
            // with several slots, decode steps go through one batcher that steps every ready session at once.
            let pool = Arc::new(ThreadPool::new(cfg.threads));
            let (ctx, batch) = (cfg.ctx_size, cfg.batch_size);
            let batcher = (cfg.parallel > 1 && cfg.batch_decode)
                .then(|| {
                    Batcher::start(
                        model.clone(),
                        pool.clone(),
                        cfg.parallel,
                        ctx,
                        BATCH_WINDOW,
                        metrics.batch.clone(),
                    )
                })
                .transpose()?;
            let factory: Factory = Arc::new(move || {
                let g = LocalGenerator::new(model.clone(), pool.clone(), ctx, batch)?;
                let g = match &batcher {
                    Some(b) => g.with_batcher(b),
                    None => g,
                };
                Ok(Box::new(g) as Box<dyn Generator>)
            });
            let node = NodeSpec {
                label: "local".into(),
                addr: None,
                slots: cfg.parallel,
                factory,
            };
            Ok((vec![node], format!("{name}, local, {} slots", cfg.parallel)))
        }
        Some(Topology::Pipeline(spec)) => {
            let opts = pipeline_opts(cfg, &wire_bits, secret.as_deref())?;
            // Fail at start on a bad spec or an unreachable stage.
            PipelineGenerator::connect(&spec, path, opts.clone()).context("cannot open the pipeline")?;
            let factory = metered_pipeline(spec.clone(), path.to_path_buf(), opts, metrics.clone());
            let node = NodeSpec {
                label: "pipeline".into(),
                addr: None,
                slots: cfg.parallel,
                factory,
            };
            Ok((vec![node], format!("{name}, pipeline {spec}, {} slots", cfg.parallel)))
        }
        Some(Topology::Decode { decode, prefill }) => {
            let opts = pipeline_opts(cfg, &wire_bits, secret.as_deref())?;
            let mut nodes = Vec::new();
            for d in &decode {
                let factory = if prefill.is_empty() {
                    metered_pipeline(
                        format!("{}=0:end", d.addr),
                        path.to_path_buf(),
                        opts.clone(),
                        metrics.clone(),
                    )
                } else {
                    disagg_hook(&prefill, d, path, &opts)?
                };
                nodes.push(NodeSpec {
                    label: d.name.clone(),
                    addr: Some(d.addr.clone()),
                    slots: d.slots.unwrap_or(cfg.parallel),
                    factory,
                });
            }
            let desc = format!(
                "{name}, router over {} decode node(s){}",
                decode.len(),
                if prefill.is_empty() {
                    String::new()
                } else {
                    format!(" and {} prefill node(s)", prefill.len())
                }
            );
            Ok((nodes, desc))
        }
    }
}

/// HOOK for disaggregated prefill (issue 5): the generator factory of one decode node's slots when the cluster file
/// names prefill nodes. The factory is called once per slot (and again after a failure). To wire `DisaggGenerator`:
/// build here, once per decode node, a shared picker over `prefill` (busy counters behind an `Arc`, health as for
/// decode nodes; `ClusterFile::links` gives rates) so each request prefills on the least-loaded healthy prefill
/// node, streams the KV to `decode.addr`, and decodes there; return a factory that clones the picker into each
/// slot's generator. A prefill failure before the first token is retried on another decode slot by the scheduler.
fn disagg_hook(prefill: &[NodeEntry], decode: &NodeEntry, _path: &Path, _opts: &PipelineOpts) -> Result<Factory> {
    bail!(
        "prefill nodes ({}) for decode node {} need the disaggregated generator, which this build does not have yet",
        prefill.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", "),
        decode.name
    )
}

/// A pipeline generator whose wire bytes per stage are added to `/metrics`.
fn metered_pipeline(spec: String, path: PathBuf, opts: PipelineOpts, metrics: Arc<Metrics>) -> Factory {
    Arc::new(move || {
        let inner = PipelineGenerator::connect(&spec, &path, opts.clone())?;
        Ok(Box::new(Metered {
            inner,
            metrics: metrics.clone(),
        }) as Box<dyn Generator>)
    })
}

struct Metered {
    inner: PipelineGenerator,
    metrics: Arc<Metrics>,
}

impl Metered {
    fn account(&self) {
        for st in self.inner.session().stats() {
            if st.bytes_sent + st.bytes_recv > 0 && !st.label.starts_with("local") {
                let peer = st.label.split(' ').next().unwrap_or(&st.label);
                self.metrics.wire(peer, st.bytes_sent, st.bytes_recv);
            }
        }
    }
}

impl Generator for Metered {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }
    fn count_prompt(&self, prompt: &Prompt) -> Result<usize> {
        self.inner.count_prompt(prompt)
    }
    fn render(&self, prompt: &Prompt) -> Result<String> {
        self.inner.render(prompt)
    }
    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome> {
        let r = self.inner.generate(prompt, params, sink);
        // Stats are reset at the start of each request, so they hold this request's bytes (also after a failure).
        self.account();
        r
    }
}
