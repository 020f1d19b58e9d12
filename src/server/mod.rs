//! `baton serve`: an OpenAI-compatible HTTP server over any [`Generator`] topology.
//!
//! - [`openai`]: request parsing and validation, response bodies and stream chunks, error objects;
//! - [`routes`]: axum routes, authentication, SSE;
//! - [`queue`]: slots (one Generator and one thread each), the bounded queue, retries, health checks;
//! - [`router`]: which slot takes a request (longest cached prefix unless overloaded, else least loaded);
//! - [`slots`]: `/slots/{id}?action=save|restore`, a slot's session to and from a file;
//! - [`embeddings`]: `/v1/embeddings` (mean pooling on its own session), `/tokenize`, `/detokenize`;
//! - [`reasoning`]: a thinking model's reply split into `reasoning_content` and `content`;
//! - [`stop`]: stop strings over a token stream; [`metrics`]: Prometheus text; [`cluster_file`]: `--cluster`;
//! - [`status`]: nodes, links and recent requests for `/v1/cluster`; [`web`]: the page at `/`.
//!
//! Data flow: HTTP handler → parse → `Scheduler::submit` → a slot's thread runs `Generator::generate` → events on
//! a channel → JSON body or SSE chunks. The async runtime only moves bytes; engine work runs on slot threads.

pub mod cluster_file;
pub mod embeddings;
pub mod metrics;
pub mod multi_model;
pub mod openai;
pub mod queue;
pub mod reasoning;
pub mod router;
pub mod routes;
pub mod slots;
pub mod status;
pub mod stop;
pub mod tools;
pub mod web;

use crate::cluster::disagg::{PoolMember, PrefillPool, RemotePrefill};
use crate::engine::batcher::Batcher;
use crate::engine::disk_cache::DiskCache;
use crate::generate::{GenParams, Generator, LocalGenerator, Outcome, Piece, Prompt, TextModel};
use crate::kernels::ThreadPool;
use crate::model::Model;
use crate::topology::{Builder, PipelineGenerator, TopologyArgs};
use anyhow::{Context, Result, bail};
use cluster_file::{ClusterFile, NodeEntry, Topology};
use embeddings::Embedder;
use metrics::Metrics;
use queue::{Factory, NodeSpec, Revive, Scheduler};
use status::{Role, Status};
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
    /// An ensemble served as one model (`smollm2@local,gemma3@HOST:PORT`), combined by `combine`.
    pub ensemble: Option<String>,
    pub combine: String,
    pub ensemble_degrade: bool,
    /// A draft model for speculative decoding of the local model (`MODEL` or `MODEL@HOST:PORT`).
    pub draft: Option<String>,
    pub draft_tokens: String,
    /// Prefill nodes (`HOST:PORT,...`) for the local model: this server decodes, they prefill.
    pub prefill_node: Option<String>,
    /// With prefill nodes: auto, never, always or a share of the layers (`60%`).
    pub offload: String,
    /// With prefill nodes: KV precision between prefill and decode side (32, 16, bf16, 8).
    pub kv_bits: String,
    /// With prefill nodes: a silent prefill node is given up after this (the decode side then prefills).
    pub prefill_timeout: Duration,
    /// Prompt prefixes on disk (`--kv-cache-dir`), shared by the local slots.
    pub kv_cache: Option<Arc<DiskCache>>,
    /// Where `/slots/{id}?action=save|restore` keep sessions; `None`: those endpoints are off.
    pub slot_save_path: Option<PathBuf>,
    /// A request's headers must arrive within this; also how long an idle keep-alive connection is kept.
    pub header_timeout: Duration,
    /// A request's whole body must arrive within this.
    pub body_timeout: Duration,
    /// HTTP connections open at once (more are answered 503 and closed); 0: from the file-descriptor limit
    /// ([`auto_max_connections`]).
    pub max_connections: usize,
    /// Load the local model even when its weights and the slots' KV exceed the memory available.
    pub no_mem_check: bool,
    /// Chat template variables of requests that do not set them (`--chat-template-kwargs`).
    pub chat_kwargs: crate::chat::TemplateKwargs,
    /// Where a thinking model's reasoning goes when a request does not say (`--reasoning-format`).
    pub reasoning_format: reasoning::ReasoningFormat,
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
            ensemble: None,
            combine: "union".into(),
            ensemble_degrade: false,
            draft: None,
            draft_tokens: "auto".into(),
            prefill_node: None,
            offload: "auto".into(),
            kv_bits: "16".into(),
            prefill_timeout: Duration::from_secs(10),
            kv_cache: None,
            slot_save_path: None,
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            max_connections: 0,
            no_mem_check: false,
            chat_kwargs: Default::default(),
            reasoning_format: Default::default(),
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
    if let Some(d) = &cfg.slot_save_path {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create --slot-save-path {}", d.display()))?;
    }
    if cfg.kv_cache.is_some() && cfg.ensemble.is_some() {
        bail!(
            "--kv-cache-dir holds one model's KV; an ensemble mixes several models per step, so it is not supported \
             with --ensemble"
        );
    }
    let file = cfg.cluster.as_deref().map(ClusterFile::load).transpose()?;
    let metrics = Arc::new(Metrics::default());
    let status = Arc::new(Status::new());
    let (model_id, aliases, nodes, describe, text, embedder) = if let Some(spec) = &cfg.ensemble {
        if file.is_some() || cfg.pipeline.is_some() || cfg.draft.is_some() || cfg.prefill_node.is_some() {
            bail!("--ensemble cannot be combined with --cluster, --pipeline, --draft or --prefill-node");
        }
        let builder = Builder::new(topology_args(&cfg, None)?);
        builder.guard_memory(None, cfg.parallel)?;
        let (node, describe) = multi_model::ensemble_slots(&cfg, &builder, spec, multi_model::cache(&cfg))?;
        let id = cfg.served_name.clone().unwrap_or(multi_model::ensemble_id(spec)?);
        for m in crate::ensemble::parse_members(spec)? {
            let addr = match &m.place {
                crate::ensemble::Place::Local => None,
                crate::ensemble::Place::Remote(a) => Some(a.as_str()),
            };
            status.add_node(&m.name, Role::Member, addr, None, Some(0), true);
        }
        let aliases = vec!["ensemble".to_string(), spec.clone()];
        (id, aliases, vec![node], describe, None, None)
    } else {
        let model_arg = file
            .as_ref()
            .and_then(|f| f.model.clone())
            .unwrap_or_else(|| cfg.model.clone());
        let path = crate::fetch::resolve(&model_arg)?;
        let (model_id, aliases) = model_ids(&cfg, &model_arg, &path);
        let (nodes, describe, embedder) = build_nodes(&cfg, file.as_ref(), &path, &metrics, &status)?;
        // The tokenizer `/tokenize` and `/detokenize` use (this process reads no weights for it).
        let text = Arc::new(TextModel::open(&path)?);
        (model_id, aliases, nodes, describe, Some(text), embedder)
    };
    let sched = Scheduler::start(nodes, cfg.queue, Revive::default(), metrics.clone(), status.clone());
    sched.clone().health_loop(cfg.health_every);
    status.health_loop(cfg.health_every);

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
        slot_save_path: cfg.slot_save_path.clone(),
        body_timeout: cfg.body_timeout,
        text,
        embedder,
        chat_defaults: openai::ChatDefaults {
            kwargs: cfg.chat_kwargs.clone(),
            reasoning: cfg.reasoning_format,
        },
    });
    // Two runtime threads are plenty to move bytes; compute runs on the slots' threads.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let http = HttpLimits {
        header_timeout: cfg.header_timeout,
        max_connections: match cfg.max_connections {
            0 => auto_max_connections(),
            n => n,
        },
    };
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        tracing::info!(
            "serve: at most {} connections; headers within {:.1} s, bodies within {:.1} s",
            http.max_connections,
            http.header_timeout.as_secs_f64(),
            app.body_timeout.as_secs_f64()
        );
        tracing::info!(
            "serve: {} ({}) listening on http://{}",
            app.model_id,
            app.describe,
            listener.local_addr()?
        );
        accept_loop(listener, routes::router(app), &http).await
    })
}

/// HTTP connections at once when `--max-connections` is not given: half the file descriptors this process may
/// open, less a reserve for the model, nodes and logs, so idle clients can never exhaust them.
pub fn auto_max_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur as usize
    } else {
        1024
    };
    (soft.saturating_sub(64) / 2).clamp(8, 4096)
}

/// The HTTP limits the accept loop applies.
struct HttpLimits {
    header_timeout: Duration,
    max_connections: usize,
}

/// Serves HTTP/1 connections: at most `max_connections` at once, each with hyper's header-read timeout, which also
/// closes idle keep-alive connections. A connection over the cap is answered 503 at once (one non-blocking write)
/// and closed, so it holds no descriptor and the clients that were there first, or /health a moment later, still
/// get through. An accept error (e.g. out of descriptors) is logged and retried after a pause, never fatal.
async fn accept_loop(listener: tokio::net::TcpListener, router: axum::Router, lim: &HttpLimits) -> Result<()> {
    let permits = Arc::new(tokio::sync::Semaphore::new(lim.max_connections));
    let timer = hyper_util::rt::TokioTimer::new();
    let mut refused = 0u64;
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("serve: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    "serve: {} connections open, refusing more ({refused} refused so far)",
                    lim.max_connections
                );
            }
            let _ = stream.try_write(BUSY);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(timer.clone()).header_read_timeout(lim.header_timeout);
        let svc = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _ = b.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
        });
    }
}

/// The whole answer to a connection over the cap.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n\
content-length: 82\r\n\r\n{\"error\":{\"message\":\"too many open connections, try again\",\"type\":\"server_error\"}}";

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

/// The topology flags with the cluster file's settings over them, for the library's one builder.
fn topology_args(cfg: &ServeConfig, file: Option<&ClusterFile>) -> Result<TopologyArgs> {
    let pick = |f: Option<String>, c: &String| f.unwrap_or_else(|| c.clone());
    let prefill_timeout = file
        .and_then(|f| f.prefill_timeout)
        .map_or(Ok(cfg.prefill_timeout), |s| {
            crate::util::timeout_secs(s).map_err(|e| anyhow::anyhow!("cluster file prefill_timeout: {e}"))
        })?;
    Ok(TopologyArgs {
        model: cfg.model.clone(),
        threads: cfg.threads,
        n_ctx: cfg.ctx_size,
        n_batch: cfg.batch_size,
        pipeline: cfg.pipeline.clone(),
        wire_bits: pick(file.and_then(|f| f.wire_bits.clone()), &cfg.wire_bits),
        secret_file: file
            .and_then(|f| f.secret_file.clone())
            .or_else(|| cfg.secret_file.clone()),
        node_timeout: Some(cfg.node_timeout),
        prefill_node: cfg.prefill_node.clone(),
        decode_node: None,
        offload: pick(file.and_then(|f| f.offload.clone()), &cfg.offload),
        offload_layers: None,
        kv_bits: pick(file.and_then(|f| f.kv_bits.clone()), &cfg.kv_bits),
        prefill_timeout,
        draft: cfg.draft.clone(),
        draft_tokens: cfg.draft_tokens.clone(),
        ensemble: cfg.ensemble.clone(),
        combine: cfg.combine.clone(),
        ensemble_degrade: cfg.ensemble_degrade,
        sampling: None,
        verbose: false,
        no_mem_check: cfg.no_mem_check,
    })
}

/// The slots' nodes for the chosen topology, and a one-line description; the nodes and links are registered with
/// `status` as configured here.
fn build_nodes(
    cfg: &ServeConfig,
    file: Option<&ClusterFile>,
    path: &Path,
    metrics: &Arc<Metrics>,
    status: &Arc<Status>,
) -> Result<(Vec<NodeSpec>, String, Option<Arc<Embedder>>)> {
    let topology = match (file, &cfg.pipeline, &cfg.prefill_node) {
        (Some(_), Some(_), _) => bail!("give either --pipeline or --cluster, not both"),
        (Some(_), _, Some(_)) => bail!("with --cluster, name prefill nodes in the cluster file (role = \"prefill\")"),
        (None, Some(_), Some(_)) => bail!("--prefill-node pairs with a whole-model decode side, not a pipeline"),
        (Some(f), None, None) => Some(f.topology()?),
        (None, Some(spec), None) => Some(Topology::Pipeline(spec.clone())),
        (None, None, Some(list)) => Some(cluster_file::local_decode(list)?),
        (None, None, None) => None,
    };
    // One builder for every slot: the secret is read once, on the first link that needs it.
    if cfg.kv_cache.is_some() && (topology.is_some() || cfg.draft.is_some()) {
        bail!("{}", crate::generate::KV_CACHE_ON_NODES);
    }
    let builder = Arc::new(Builder::new(topology_args(cfg, file)?));
    let name = path
        .file_name()
        .map_or(String::new(), |f| f.to_string_lossy().into_owned());
    if let Some(draft) = &cfg.draft {
        if topology.is_some() {
            bail!(
                "--draft runs the target in this process; it cannot be combined with --cluster, --pipeline or --prefill-node"
            );
        }
        builder.guard_memory(Some(path), cfg.parallel)?;
        let (node, describe) = multi_model::draft_slots(cfg, &builder, path, draft, multi_model::cache(cfg))?;
        status.add_node("local", Role::Target, None, None, Some(0), false);
        let d = crate::speculative::DraftSpec::parse(draft)?;
        status.add_node(draft, Role::Draft, d.addr.as_deref(), None, None, true);
        return Ok((vec![node], format!("{name}, {describe}"), None));
    }
    match topology {
        None => {
            builder.guard_memory(Some(path), cfg.parallel)?;
            let model = Arc::new(Model::load(path)?);
            // One pool shared by every slot, each slot keeps its own KV. Prefills take turns on the pool op by op;
            // with several slots, decode steps go through one batcher that steps every ready session at once.
            let pool = Arc::new(ThreadPool::new(cfg.threads));
            let (ctx, batch) = (cfg.ctx_size, cfg.batch_size);
            let batcher = (cfg.parallel > 1 && cfg.batch_decode)
                .then(|| {
                    Batcher::local(
                        model.clone(),
                        pool.clone(),
                        cfg.parallel,
                        ctx,
                        BATCH_WINDOW,
                        metrics.batch.clone(),
                    )
                })
                .transpose()?;
            let disk = cfg.kv_cache.clone();
            let embedder = Some(Arc::new(Embedder::new(
                model.clone(),
                pool.clone(),
                ctx,
                batch,
                cfg.queue,
            )));
            let factory: Factory = Arc::new(move || {
                let g = LocalGenerator::new(model.clone(), pool.clone(), ctx, batch)?;
                let mut g = match &batcher {
                    Some(b) => g.with_batcher(b),
                    None => g,
                };
                if let Some(d) = &disk {
                    g.set_disk_cache(d.clone())?;
                }
                Ok(Box::new(g) as Box<dyn Generator>)
            });
            let node = NodeSpec {
                label: "local".into(),
                addr: None,
                slots: cfg.parallel,
                factory,
                disk_cache: cfg.kv_cache.is_some(),
            };
            status.add_node("local", Role::Local, None, None, Some(0), false);
            Ok((vec![node], format!("{name}, local, {} slots", cfg.parallel), embedder))
        }
        Some(Topology::Pipeline(spec)) => {
            // Fail at start on bad flags, a bad spec or an unreachable stage.
            builder.pipeline_opts()?;
            let opened = builder
                .pipeline(&spec, path, None)
                .context("cannot open the pipeline")?;
            for st in opened.session().stages() {
                let layers = Some(format!("{}:{}", st.layers.start, st.layers.end));
                let name = st.addr.clone().unwrap_or_else(|| "local".into());
                status.add_node(&name, Role::Stage, st.addr.as_deref(), layers, Some(0), true);
                if let Some(a) = &st.addr {
                    status.add_link("local", a, a);
                }
            }
            drop(opened);
            let factory = metered_pipeline(
                &builder,
                spec.clone(),
                path.to_path_buf(),
                metrics.clone(),
                status.clone(),
                None,
            );
            let node = NodeSpec {
                label: "pipeline".into(),
                addr: None,
                slots: cfg.parallel,
                factory,
                disk_cache: false,
            };
            Ok((
                vec![node],
                format!("{name}, pipeline {spec}, {} slots", cfg.parallel),
                None,
            ))
        }
        Some(Topology::Decode { decode, prefill }) => {
            builder.pipeline_opts()?;
            let pool = (!prefill.is_empty())
                .then(|| prefill_pool(&prefill, metrics, status, cfg.health_every))
                .transpose()?;
            let dis = DisaggSettings::of(&builder, file)?;
            let mut nodes = Vec::new();
            for p in &prefill {
                status.add_node(&p.name, Role::Prefill, Some(&p.addr), None, None, true);
            }
            if decode.iter().any(|d| d.addr != "local") {
                ask_builds(&builder, path, &prefill)?;
            }
            for d in &decode {
                let remote = d.addr != "local";
                status.add_node(
                    &d.name,
                    Role::Decode,
                    remote.then_some(d.addr.as_str()),
                    None,
                    Some(nodes.len()),
                    false,
                );
                if remote {
                    status.add_link("local", &d.name, &d.addr);
                }
                // KV from each prefill node: pulled by this server, or by a remote decode node that tells the bytes
                // in its PULL_REPORT.
                for p in &prefill {
                    status.add_link(&p.name, &d.name, &p.name);
                }
                let factory = match &pool {
                    None => metered_pipeline(
                        &builder,
                        format!("{}=0:end", d.addr),
                        path.to_path_buf(),
                        metrics.clone(),
                        status.clone(),
                        None,
                    ),
                    Some(pool) => disagg_hook(&builder, pool, d, path, &dis, metrics, status)?,
                };
                nodes.push(NodeSpec {
                    label: d.name.clone(),
                    addr: (d.addr != "local").then(|| d.addr.clone()),
                    slots: d.slots.unwrap_or(cfg.parallel),
                    factory,
                    disk_cache: false,
                });
            }
            let desc = format!(
                "{name}, router over {} decode node(s){}",
                decode.len(),
                if prefill.is_empty() {
                    String::new()
                } else {
                    format!(" and {} prefill node(s), offload {}", prefill.len(), dis.offload_text)
                }
            );
            Ok((nodes, desc, None))
        }
    }
}

/// What the server adds to the builder's prefill settings: the cluster file's links and the offload as written.
struct DisaggSettings {
    offload_text: String,
    /// The cluster file's `[[link]]` entries (their `gbps` seed the planner's link rate).
    links: Vec<cluster_file::Link>,
}

impl DisaggSettings {
    /// The configured rate between nodes `a` and `b` in bytes/s, if the cluster file gives one.
    fn link_rate(&self, a: &str, b: &str) -> Option<f64> {
        self.links
            .iter()
            .find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a))
            .and_then(|l| l.gbps)
            .map(|g| g * 1e9 / 8.0)
    }

    /// Checks the offload and KV settings now, so a bad one fails the start rather than every slot.
    fn of(builder: &Builder, file: Option<&ClusterFile>) -> Result<DisaggSettings> {
        builder.offload()?;
        builder.kv()?;
        Ok(DisaggSettings {
            offload_text: builder.args.offload.clone(),
            links: file.map(|f| f.links.clone()).unwrap_or_default(),
        })
    }
}

/// Asks each prefill node in the background where it computes, for the cluster view: only remote decode nodes open
/// sessions on them, so this server hears no READY of theirs otherwise. A node that does not answer stays unknown.
fn ask_builds(builder: &Builder, path: &Path, prefill: &[NodeEntry]) -> Result<()> {
    use crate::cluster::{handshake, wire::ModelInfo};
    let link = builder.prefill_link()?;
    let hp = crate::model::Hparams::from_gguf(&crate::gguf::GgufFile::open(path)?)?;
    let info = ModelInfo::of(&hp, &crate::fingerprint::fingerprint(path)?);
    let addrs: Vec<String> = prefill.iter().map(|p| p.addr.clone()).collect();
    std::thread::Builder::new().name("ask-builds".into()).spawn(move || {
        for a in &addrs {
            let timeouts = handshake::Timeouts::default();
            if let Err(e) = handshake::ask_build(a, link.secret.as_deref(), info.clone(), timeouts) {
                tracing::debug!("cannot ask prefill node {a} where it computes: {e:#}");
            }
        }
    })?;
    Ok(())
}

/// The prefill nodes every decode slot shares, health-checked; each prefill's outcome, tokens and KV bytes go to
/// `/metrics` under the node's name.
fn prefill_pool(
    prefill: &[NodeEntry],
    metrics: &Arc<Metrics>,
    status: &Arc<Status>,
    every: Duration,
) -> Result<Arc<PrefillPool>> {
    let members = prefill
        .iter()
        .map(|p| PoolMember {
            name: p.name.clone(),
            addr: p.addr.clone(),
        })
        .collect();
    let (m, st) = (metrics.clone(), status.clone());
    let pool = PrefillPool::new(
        members,
        Some(Box::new(move |member, rep| {
            if rep.fallback.is_none() {
                status::prefilled_on(&member.name);
                st.prefilled(&member.name, rep.sent as u64);
                // The stream's own measured rate: bytes over the time between its first and last frame.
                let streamed = (rep.link_rate > 0.0).then(|| Duration::from_secs_f64(rep.bytes as f64 / rep.link_rate));
                st.kv_pulled(&member.name, rep.bytes, streamed);
            }
            m.prefill(
                &member.name,
                rep.fallback.is_some(),
                [rep.sent, rep.held, rep.catch_up],
                rep.bytes,
                rep.link_rate,
            )
        })),
    );
    pool.health_loop(every);
    Ok(pool)
}

/// The generator factory of one decode node's slots when there are prefill nodes. Per request each slot leases the
/// least-loaded healthy prefill node of `pool`. A local decode node (`addr = "local"`, or `--prefill-node` without a
/// cluster file) is a [`crate::topology::DisaggGenerator`] per slot over one model loaded once; a remote one is a
/// pipeline with a single full-model stage whose prompts the node prefills by pulling the KV from the prefill node
/// (protocol 3, PULL; it authenticates to the prefill node with its own secret). A prefill node that fails costs the request
/// nothing but the offload (the decode side prefills itself) and is taken out until it answers again; a decode node
/// that fails before the first token is retried on another one by the scheduler.
fn disagg_hook(
    builder: &Arc<Builder>,
    pool: &Arc<PrefillPool>,
    decode: &NodeEntry,
    path: &Path,
    dis: &DisaggSettings,
    metrics: &Arc<Metrics>,
    status: &Arc<Status>,
) -> Result<Factory> {
    let remote = builder.remote_prefill(pool.clone())?;
    if decode.addr != "local" {
        return Ok(metered_pipeline(
            builder,
            format!("{}=0:end", decode.addr),
            path.to_path_buf(),
            metrics.clone(),
            status.clone(),
            Some(remote),
        ));
    }
    let model = Arc::new(Model::load(path)?);
    let threads = Arc::new(ThreadPool::new(builder.args.threads));
    let (builder, pool) = (builder.clone(), pool.clone());
    // A remote decode node measures its links itself; this server's own links may be given in the cluster file.
    let rates: Vec<Option<f64>> = pool
        .members
        .iter()
        .map(|m| dis.link_rate(&m.name, &decode.name))
        .collect();
    Ok(Arc::new(move || {
        let mut g = builder.disagg(model.clone(), threads.clone(), pool.clone())?;
        g.seed_link_rates(&rates);
        Ok(Box::new(g) as Box<dyn Generator>)
    }))
}

/// A pipeline generator whose wire bytes per stage are added to `/metrics` (with `remote`: its single full-model
/// stage is a decode node that pulls prefills from prefill nodes).
fn metered_pipeline(
    builder: &Arc<Builder>,
    spec: String,
    path: PathBuf,
    metrics: Arc<Metrics>,
    status: Arc<Status>,
    remote: Option<RemotePrefill>,
) -> Factory {
    let builder = builder.clone();
    Arc::new(move || {
        let inner = builder.pipeline(&spec, &path, remote.clone())?;
        Ok(Box::new(Metered {
            inner,
            metrics: metrics.clone(),
            status: status.clone(),
        }) as Box<dyn Generator>)
    })
}

struct Metered {
    inner: PipelineGenerator,
    metrics: Arc<Metrics>,
    status: Arc<Status>,
}

impl Metered {
    fn account(&self) {
        for st in self.inner.session().stats() {
            if st.bytes_sent + st.bytes_recv > 0 && !st.label.starts_with("local") {
                let peer = st.label.split(' ').next().unwrap_or(&st.label);
                self.metrics.wire(peer, st.bytes_sent, st.bytes_recv);
                let waited = st.wall.saturating_sub(st.compute);
                self.status.wire(peer, st.bytes_sent, st.bytes_recv, Some(waited));
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
    fn text(&self) -> &TextModel {
        self.inner.text()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_file_link_rates_reach_the_planner_in_bytes_per_second() {
        let file: ClusterFile = toml::from_str(
            "[[node]]\nname='me'\naddr='local'\nrole='decode'\n[[node]]\nname='p1'\naddr='h:1'\nrole='prefill'\n\
             [[node]]\nname='p2'\naddr='h:2'\nrole='prefill'\n[[link]]\na='me'\nb='p1'\ngbps=2.5\n",
        )
        .unwrap();
        let builder = Builder::new(topology_args(&ServeConfig::default(), Some(&file)).unwrap());
        let dis = DisaggSettings::of(&builder, Some(&file)).unwrap();
        assert_eq!(dis.link_rate("p1", "me"), Some(312.5e6), "either order");
        assert_eq!(dis.link_rate("me", "p1"), Some(312.5e6));
        assert_eq!(dis.link_rate("p2", "me"), None, "no link given");
    }
}
