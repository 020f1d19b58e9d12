//! `baton node`: serves pipeline stages of one model file to coordinators, prefills for decode sides (PREFILL), and
//! decodes with a prefill pulled from another node (PULL).
//!
//! Blocking I/O, one thread per connection, a timeout on every read and write. A connection that sends anything
//! malformed is dropped on its own; the others keep being served. Sessions (the KV of one conversation for one
//! layer range) live in the node, not in the connection, so a coordinator that reconnects finds its KV again, and
//! the prefix hash carried by every request tells whether that KV is the one it needs.
//!
//! - this file: [`NodeConfig`], [`Node`] (bind, then a thread per connection) and [`run`];
//! - `state.rs`: what the connections share: loaded layer ranges, sessions, the compute lock, the decode batcher;
//! - `conn.rs`: one connection: the handshake, then one handler per request (FORWARD, PREFILL, PULL).

mod conn;
mod state;

use super::wire::ModelInfo;
use crate::engine::memory::{self, Need};
use crate::gguf::GgufFile;
use crate::model::Hparams;
use anyhow::{Context, Result, bail};
use state::State;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Default of [`NodeConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Default of [`NodeConfig::max_handshakes`].
pub const DEFAULT_MAX_HANDSHAKES: usize = 16;

#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub model: PathBuf,
    /// `host:port`; port 0 picks a free one (printed on start).
    pub listen: String,
    /// Serve only this range (`A:B`, B exclusive or `end`), loaded at start; otherwise any range asked for.
    pub layers: Option<String>,
    /// Required from every peer when set; required to listen on anything but loopback.
    pub secret: Option<Vec<u8>>,
    pub threads: usize,
    /// Largest context a session may ask for.
    pub max_ctx: usize,
    /// Largest batch a session may ask for.
    pub max_batch: usize,
    /// Sessions kept at once; the least recently used is evicted (its coordinator then replays).
    pub max_sessions: usize,
    /// Longest wait for the rest of a frame once it has started, and for any write.
    pub io_timeout: Duration,
    /// A connection silent for this long is closed.
    pub idle_timeout: Duration,
    /// Decode steps of different sessions that arrive together run as one batched forward (`engine::batcher`);
    /// off: one session per forward.
    pub batch: bool,
    /// Connections open at once (each holds a thread); one more is refused with ERROR and closed.
    pub max_connections: usize,
    /// Of those, connections that have not yet authenticated: a flood of strangers cannot lock out the peers that
    /// know the secret, since each stranger is gone within two I/O timeouts.
    pub max_handshakes: usize,
    /// Most bytes of KV and scratch the sessions hold together (`--kv-budget`, in GiB on the command line): an OPEN
    /// beyond it, once idle sessions are evicted, is refused. A session counts its KV (context × its layers) and its
    /// scratch (proportional to its batch size). `None`: `max_sessions` sessions at `max_ctx` and `max_batch`, as
    /// many as the memory available after the weights holds (at least one).
    pub kv_budget: Option<u64>,
    /// Start even when the weights plus one session's KV (or the budget given) exceed the memory available.
    pub no_mem_check: bool,
    /// Keep the KV of prefilled prompts in this directory (`--kv-cache-dir`), so a prefix prefilled before, even by
    /// an earlier process, is read back instead of computed (docs/kv-cache.md).
    pub kv_cache_dir: Option<PathBuf>,
    /// Most GiB the entries of `kv_cache_dir` take.
    pub kv_cache_gib: f64,
}

impl NodeConfig {
    pub fn new(model: PathBuf, listen: &str) -> NodeConfig {
        NodeConfig {
            model,
            listen: listen.to_string(),
            layers: None,
            secret: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_ctx: 4096,
            max_batch: 512,
            max_sessions: 4,
            batch: true,
            io_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            kv_budget: None,
            no_mem_check: false,
            kv_cache_dir: None,
            kv_cache_gib: 8.0,
        }
    }

    /// Refuses counts out of range (naming the flag: `baton node` and `baton-node` share them) and limits that
    /// would make the node refuse or drop every connection.
    pub fn check(&self) -> Result<()> {
        use crate::util::{count_in, limits::*};
        for (flag, v, max) in [
            ("-t", self.threads, MAX_THREADS),
            ("-c", self.max_ctx, MAX_CTX),
            ("-b", self.max_batch, MAX_BATCH),
            ("--max-sessions", self.max_sessions, MAX_NODE_COUNT),
            ("--max-connections", self.max_connections, MAX_NODE_COUNT),
            ("--max-handshakes", self.max_handshakes, MAX_NODE_COUNT),
        ] {
            count_in(flag, v as u64, 1..=max)?;
        }
        if self.kv_budget == Some(0) {
            bail!("--kv-budget must be above zero");
        }
        if self.io_timeout.is_zero() || self.idle_timeout.is_zero() {
            bail!("node timeouts must be above zero");
        }
        Ok(())
    }
}

pub struct Node {
    listener: TcpListener,
    state: Arc<State>,
}

impl Node {
    /// Opens the model, checks the configuration and binds the listening socket.
    pub fn bind(cfg: NodeConfig) -> Result<Node> {
        cfg.check()?;
        let file = Arc::new(GgufFile::open(&cfg.model)?);
        let hp = Hparams::from_gguf(&file)?;
        let fp = crate::fingerprint::fingerprint(&cfg.model)
            .with_context(|| format!("cannot fingerprint {}", cfg.model.display()))?;
        let info = ModelInfo::of(&hp, &fp);
        let pinned = match &cfg.layers {
            Some(s) => Some(crate::model::parse_layer_range(s, hp.n_layer)?),
            None => None,
        };
        let listener = TcpListener::bind(&cfg.listen).with_context(|| format!("cannot listen on {}", cfg.listen))?;
        let addr = listener.local_addr()?;
        if cfg.secret.is_none() && !addr.ip().is_loopback() {
            bail!(
                "refusing to listen on {addr} without a shared secret: give --secret-file (only loopback addresses \
                 may go without)"
            );
        }
        let kv_budget = kv_budget(&cfg, &hp, pinned.clone())?;
        let state = Arc::new(State::new(cfg, addr, file, hp, info, pinned, kv_budget)?);
        if let Some(r) = state.pinned.clone() {
            state.model(r)?;
        }
        Ok(Node { listener, state })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until the process ends: a thread per connection, at most `max_connections` of them and at most
    /// `max_handshakes` not yet authenticated. A connection over either cap, or whose thread cannot be started, is
    /// refused on its own; the node goes on.
    pub fn serve(self) -> Result<()> {
        let open = Arc::new(AtomicUsize::new(0));
        let pending = Arc::new(AtomicUsize::new(0));
        let cfg = &self.state.cfg;
        let mut refused = 0u64;
        for conn in self.listener.incoming() {
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("baton node: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            let peer = stream.peer_addr().map_or("?".to_string(), |a| a.to_string());
            let Some(conn_slot) = Slot::take(&open, cfg.max_connections) else {
                refuse_busy(
                    stream,
                    &peer,
                    &format!("{} connections open", cfg.max_connections),
                    &mut refused,
                );
                continue;
            };
            let Some(hs_slot) = Slot::take(&pending, cfg.max_handshakes) else {
                refuse_busy(
                    stream,
                    &peer,
                    &format!("{} handshakes pending", cfg.max_handshakes),
                    &mut refused,
                );
                continue;
            };
            let state = self.state.clone();
            let spawned = std::thread::Builder::new()
                .name("baton-node-conn".into())
                .spawn(move || {
                    let _conn_slot = conn_slot;
                    let mut hs_slot = Some(hs_slot);
                    if let Err(e) = conn::serve(stream, &state, &peer, || drop(hs_slot.take())) {
                        // The error may quote the peer (a model name, a message): one escaped, bounded line.
                        let why = crate::util::printable(&format!("{e:#}"), 2000);
                        tracing::warn!("baton node: dropped connection from {peer}: {why}");
                    }
                });
            if let Err(e) = spawned {
                // The closure (stream and slots) is dropped with the error: that connection closes, nothing else.
                tracing::error!("baton node: cannot start a thread for a connection: {e}");
            }
        }
        Ok(())
    }
}

/// The node's budget ([`NodeConfig::kv_budget`]), after the memory guard: the weights of the layers served plus
/// one session at `max_ctx` and `max_batch` (or the whole budget when given) must fit the memory available.
fn kv_budget(cfg: &NodeConfig, hp: &Hparams, layers: Option<std::ops::Range<usize>>) -> Result<u64> {
    let weights = Need::of(&cfg.model, layers.clone(), cfg.max_ctx, 1)?.weights;
    let range = layers.unwrap_or(0..hp.n_layer);
    let one = state::session_bytes(hp, &range, cfg.max_ctx, cfg.max_batch, cfg.threads);
    let all = one.saturating_mul(cfg.max_sessions as u64);
    let budget = match (cfg.kv_budget, memory::available()) {
        (Some(b), _) => b,
        (None, Some(avail)) if !cfg.no_mem_check => all.min(avail.saturating_sub(weights)).max(one),
        (None, _) => all,
    };
    let need = Need {
        weights,
        kv: if cfg.kv_budget.is_some() { budget } else { one },
    };
    memory::guard(
        &format!("baton node ({})", cfg.model.display()),
        || Ok(need),
        cfg.no_mem_check,
    )?;
    Ok(budget)
}

/// One place under a cap; given back on drop.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(count: &Arc<AtomicUsize>, cap: usize) -> Option<Slot> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1))
            .ok()
            .map(|_| Slot(count.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers a connection over a cap with ERROR (without blocking the accept loop) and closes it. Logged at the 1st,
/// 2nd, 4th, 8th… refusal, so a flood cannot fill the log.
fn refuse_busy(stream: std::net::TcpStream, peer: &str, why: &str, refused: &mut u64) {
    *refused += 1;
    if refused.is_power_of_two() {
        tracing::warn!("baton node: refused a connection from {peer}: busy ({why}; {refused} refused so far)");
    }
    let mut s = stream;
    if s.set_nonblocking(true).is_ok() {
        let message = format!("node busy: {why}; try again later");
        let _ = super::wire::write_msg(&mut s, &super::wire::Msg::Error { message });
    }
}

/// Binds and serves forever (the CLI's `baton node`). Prints `baton node: listening on ADDR` to standard error.
pub fn run(cfg: NodeConfig) -> Result<()> {
    let node = Node::bind(cfg)?;
    let s = &node.state;
    tracing::info!(
        "baton node: listening on {} (model {} {}, {} layers, fingerprint {}…, serving {}, auth {}, KV budget {} \
         MiB, kv cache {})",
        node.local_addr()?,
        s.cfg.model.display(),
        s.hp.arch.name(),
        s.hp.n_layer,
        &s.info.fingerprint[..12.min(s.info.fingerprint.len())],
        s.pinned.as_ref().map_or("any layer range".to_string(), |r| format!(
            "layers {}:{}",
            r.start, r.end
        )),
        if s.cfg.secret.is_some() {
            "required"
        } else {
            "off (loopback only)"
        },
        s.kv_budget >> 20,
        s.disk
            .as_ref()
            .map_or("off".to_string(), |d| d.dir().display().to_string())
    );
    node.serve()
}
