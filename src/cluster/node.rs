//! `baton node`: serves pipeline stages of one model file to coordinators, prefills for decode sides (PREFILL), and
//! decodes with a prefill pulled from another node (PULL).
//!
//! Blocking I/O, one thread per connection, a timeout on every read and write. A connection that sends anything
//! malformed is dropped on its own; the others keep being served. Sessions (the KV of one conversation for one
//! layer range) live in the node, not in the connection, so a coordinator that reconnects finds its KV again, and
//! the prefix hash carried by every request tells whether that KV is the one it needs.

use super::PrefixHash;
use super::auth;
use super::disagg::{Pulled, Speeds, serve_pull};
use super::handoff::{NodeOpts, PrefillNode};
use super::handshake::Timeouts;
use super::stage::{Prepared, StageCore, StageOut};
use super::wire::{self, Body, Hidden, ModelInfo, Msg, Open, Ready, ResultMsg, WantOut, WireError};
use crate::engine::Session;
use crate::engine::batch::Batch;
use crate::engine::snapshot::RowDtype;
use crate::gguf::GgufFile;
use crate::kernels::ThreadPool;
use crate::model::{Hparams, Model};
use anyhow::{Context, Result, anyhow, bail};
use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

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
    /// Decode steps of different sessions that arrive together run as one batched forward (see
    /// `State::decode_step`); off: one session per forward.
    pub batch: bool,
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
        }
    }
}

struct Slot {
    core: StageCore,
    /// Links to the prefill nodes this session pulled from (PULL), by address: each keeps its connection and the
    /// records of what that node holds for this conversation.
    links: HashMap<String, PrefillNode>,
    /// (layers, n_ctx, n_batch) the session was opened with.
    key: (Range<usize>, usize, usize),
    last_used: Instant,
}

type SharedSlot = Arc<Mutex<Slot>>;

struct State {
    cfg: NodeConfig,
    /// The address this node listens on (to recognise a PULL that names this node as its own prefill node).
    listen: SocketAddr,
    file: Arc<GgufFile>,
    hp: Hparams,
    info: ModelInfo,
    pinned: Option<Range<usize>>,
    pool: Arc<ThreadPool>,
    models: Mutex<HashMap<(usize, usize), Arc<Model>>>,
    /// Keyed by (session id, first layer, end layer): one coordinator session may use several ranges of a node.
    sessions: Mutex<HashMap<(u64, usize, usize), SharedSlot>>,
    /// One forward pass at a time: they all share the thread pool and the cores.
    compute: Mutex<()>,
    /// The `auto` planner's measurements per prefill node this node pulled from (shared by its sessions).
    speeds: Mutex<HashMap<String, Speeds>>,
    /// Decode steps waiting for the next forward pass (see [`State::decode_step`]).
    pending: Mutex<Vec<PendingStep>>,
    /// When each session (by slot address) last asked for a decode step: the sessions decoding now.
    decoding: Mutex<HashMap<usize, Instant>>,
    /// Scratch of batched steps, made on first use.
    batch: Mutex<Option<Batch>>,
    /// Batched forward passes run and the rows they carried (rows / steps is the mean batch size).
    batched_steps: AtomicU64,
    batched_rows: AtomicU64,
}

/// One session's single-token decode step, waiting for a forward pass; its connection thread waits on `reply`.
struct PendingStep {
    slot: SharedSlot,
    pos: usize,
    prefix: PrefixHash,
    token: u32,
    want: WantOut,
    reply: mpsc::Sender<Result<(StageOut, u64)>>,
}

/// A session that asked for a decode step this recently counts as decoding (waited for by a batched step).
const DECODING_RECENT: Duration = Duration::from_millis(30);
/// Longest a batched step waits for the decoding sessions' next requests.
const GATHER_WAIT: Duration = Duration::from_millis(2);

/// Prefill nodes a session may keep links to; beyond it the links are dropped (they reconnect on demand).
const MAX_LINKS: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct Node {
    listener: TcpListener,
    state: Arc<State>,
}

impl Node {
    /// Opens the model, checks the configuration and binds the listening socket.
    pub fn bind(cfg: NodeConfig) -> Result<Node> {
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
        let state = Arc::new(State {
            pool: Arc::new(ThreadPool::new(cfg.threads)),
            models: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            compute: Mutex::new(()),
            speeds: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
            decoding: Mutex::new(HashMap::new()),
            batch: Mutex::new(None),
            batched_steps: AtomicU64::new(0),
            batched_rows: AtomicU64::new(0),
            listen: addr,
            cfg,
            file,
            hp,
            info,
            pinned,
        });
        if let Some(r) = state.pinned.clone() {
            state.model(r)?;
        }
        Ok(Node { listener, state })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until the process ends: a thread per connection.
    pub fn serve(self) -> Result<()> {
        for conn in self.listener.incoming() {
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("baton node: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            let state = self.state.clone();
            std::thread::spawn(move || {
                let peer = stream.peer_addr().map_or("?".to_string(), |a| a.to_string());
                if let Err(e) = serve_conn(stream, &state, &peer) {
                    eprintln!("baton node: dropped connection from {peer}: {e:#}");
                }
            });
        }
        Ok(())
    }
}

/// Binds and serves forever (the CLI's `baton node`). Prints `baton node: listening on ADDR` to standard error.
pub fn run(cfg: NodeConfig) -> Result<()> {
    let node = Node::bind(cfg)?;
    let s = &node.state;
    eprintln!(
        "baton node: listening on {} (model {} {}, {} layers, fingerprint {}…, serving {}, auth {})",
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
        }
    );
    node.serve()
}

impl State {
    /// A decode step of a full-model session: queued, then run by whichever waiting thread takes the compute lock
    /// first, together with every step queued by then (one batched forward, `engine::batch`). While a forward runs,
    /// the steps of other sessions gather; a session decoding alone steps exactly as without batching.
    fn decode_step(
        &self,
        slot: &SharedSlot,
        pos: usize,
        prefix: PrefixHash,
        token: u32,
        want: WantOut,
    ) -> Result<(StageOut, u64)> {
        let (reply, rx) = mpsc::channel();
        lock(&self.decoding).insert(Arc::as_ptr(slot) as usize, Instant::now());
        lock(&self.pending).push(PendingStep {
            slot: slot.clone(),
            pos,
            prefix,
            token,
            want,
            reply,
        });
        {
            let _c = lock(&self.compute);
            let mut steps = std::mem::take(&mut *lock(&self.pending));
            if !steps.is_empty() {
                // Sessions that decoded a moment ago will ask again within a round trip: wait for them a little
                // (never for a session in prefill or gone quiet), so their steps share this forward.
                let decoding = {
                    let mut d = lock(&self.decoding);
                    d.retain(|_, t| t.elapsed() < DECODING_RECENT);
                    d.len()
                };
                let t0 = Instant::now();
                while steps.len() < decoding && t0.elapsed() < GATHER_WAIT {
                    std::thread::sleep(Duration::from_micros(100));
                    steps.append(&mut lock(&self.pending));
                }
                self.run_steps(steps);
            }
        }
        rx.recv()
            .unwrap_or_else(|_| Err(anyhow!("the batched decode step was lost")))
    }

    /// Runs queued decode steps (the caller holds the compute lock) and answers each.
    fn run_steps(&self, steps: Vec<PendingStep>) {
        // Two steps of one session (two connections sharing it) cannot share a forward: the later ones run after.
        let (mut now, mut later) = (Vec::<PendingStep>::new(), Vec::new());
        for p in steps {
            let taken = now.iter().any(|q| Arc::ptr_eq(&q.slot, &p.slot));
            if now.len() < self.cfg.max_sessions.max(1) && !taken {
                now.push(p);
            } else {
                later.push(p);
            }
        }
        let slots: Vec<SharedSlot> = now.iter().map(|p| p.slot.clone()).collect();
        let rows: Vec<(PendingStep, MutexGuard<'_, Slot>)> =
            now.into_iter().zip(slots.iter().map(|s| lock(s))).collect();
        // Check each request as a lone forward would; refusals are answered at once.
        let mut ready = Vec::new();
        for (p, mut g) in rows {
            g.last_used = Instant::now();
            match g.core.prepare(p.pos, &p.prefix, &[p.token], None, p.want) {
                Ok(Ok(prep)) => ready.push((p, g, prep)),
                Ok(Err(mismatch)) => {
                    let _ = p.reply.send(Ok((mismatch, 0)));
                }
                Err(e) => {
                    let _ = p.reply.send(Err(e));
                }
            }
        }
        let model = ready.first().map(|(_, g, _)| g.core.session().model().clone());
        let one_model = |m: &Arc<Model>| ready.iter().all(|(_, g, _)| Arc::ptr_eq(g.core.session().model(), m));
        match model {
            Some(m) if ready.len() > 1 && one_model(&m) => self.step_together(m, ready),
            _ => {
                for (p, mut g, prep) in ready {
                    let _ = p.reply.send(g.core.forward_prepared(&prep, &[p.token], None));
                }
            }
        }
        if !later.is_empty() {
            self.run_steps(later);
        }
    }

    /// One forward pass over the next token of several sessions of `model`, each answered with its own output.
    fn step_together(&self, model: Arc<Model>, mut ready: Vec<(PendingStep, MutexGuard<'_, Slot>, Prepared)>) {
        let mut batch = lock(&self.batch);
        if batch.as_ref().is_none_or(|b| !b.serves(&model)) {
            match Batch::new(
                model.clone(),
                self.pool.clone(),
                self.cfg.max_sessions.max(2),
                self.cfg.max_ctx,
            ) {
                Ok(b) => *batch = Some(b),
                Err(e) => {
                    let msg = format!("{e:#}");
                    for (p, _, _) in ready {
                        let _ = p.reply.send(Err(anyhow!("{msg}")));
                    }
                    return;
                }
            }
        }
        let b = batch.as_mut().expect("made above");
        let tokens: Vec<u32> = ready.iter().map(|(p, _, _)| p.token).collect();
        let t0 = Instant::now();
        let logits = {
            let mut sessions: Vec<&mut Session> = ready.iter_mut().map(|(_, g, _)| g.core.session_mut()).collect();
            b.step(&mut sessions, &tokens).map(|l| l.to_vec())
        };
        let us = t0.elapsed().as_micros() as u64;
        self.batched_steps.fetch_add(1, Ordering::Relaxed);
        self.batched_rows.fetch_add(ready.len() as u64, Ordering::Relaxed);
        let nv = model.hp.n_vocab;
        match logits {
            Ok(l) => {
                for (i, (p, mut g, prep)) in ready.into_iter().enumerate() {
                    let out = g.core.finish(&prep, &[p.token], &l[i * nv..(i + 1) * nv]);
                    let _ = p.reply.send(Ok((out, us)));
                }
            }
            Err(e) => {
                // A failed step changes no session.
                let msg = format!("{e:#}");
                for (p, _, _) in ready {
                    let _ = p.reply.send(Err(anyhow!("batched decode step: {msg}")));
                }
            }
        }
    }

    /// `(steps, rows)` of the batched decode so far.
    fn batched(&self) -> (u64, u64) {
        (
            self.batched_steps.load(Ordering::Relaxed),
            self.batched_rows.load(Ordering::Relaxed),
        )
    }

    /// Whether `addr` (`host:port`) reaches this node's own listening socket: same port, and the same IP or, when
    /// listening on every interface, an IP of this machine (binding to it succeeds only if it is local).
    fn names_this_node(&self, addr: &str) -> bool {
        let Ok(resolved) = addr.to_socket_addrs() else {
            return false;
        };
        resolved.into_iter().any(|a| {
            a.port() == self.listen.port()
                && (a.ip() == self.listen.ip()
                    || (self.listen.ip().is_unspecified()
                        && (a.ip().is_loopback() || std::net::UdpSocket::bind((a.ip(), 0)).is_ok())))
        })
    }

    fn model(&self, r: Range<usize>) -> Result<Arc<Model>> {
        let mut models = lock(&self.models);
        if let Some(m) = models.get(&(r.start, r.end)) {
            return Ok(m.clone());
        }
        let m = Arc::new(Model::from_file(self.file.clone(), Some(r.clone()))?);
        models.insert((r.start, r.end), m.clone());
        Ok(m)
    }

    /// The session `id` for `key`, reused when it exists with the same shape, otherwise created (evicting the least
    /// recently used one beyond the limit).
    fn session(&self, id: u64, key: (Range<usize>, usize, usize), open: &Open) -> Result<Arc<Mutex<Slot>>> {
        let mut sessions = lock(&self.sessions);
        let id = (id, key.0.start, key.0.end);
        if let Some(s) = sessions.get(&id) {
            let mut g = lock(s);
            if g.key == key {
                g.last_used = Instant::now();
                g.core.set_sampling(open.sampler(), open.top_k as usize);
                drop(g);
                return Ok(s.clone());
            }
        }
        sessions.remove(&id);
        while sessions.len() >= self.cfg.max_sessions.max(1) {
            let oldest = sessions
                .iter()
                .min_by_key(|(_, s)| lock(s).last_used)
                .map(|(k, _)| *k)
                .unwrap();
            sessions.remove(&oldest);
            eprintln!(
                "baton node: evicted session {:016x} (layers {}:{})",
                oldest.0, oldest.1, oldest.2
            );
        }
        let model = self.model(key.0.clone())?;
        let core = StageCore::new(
            model,
            self.pool.clone(),
            key.1,
            key.2,
            open.sampler(),
            open.top_k as usize,
        )?;
        let slot = Arc::new(Mutex::new(Slot {
            core,
            links: HashMap::new(),
            key,
            last_used: Instant::now(),
        }));
        sessions.insert(id, slot.clone());
        Ok(slot)
    }

    /// Everything that makes an OPEN unacceptable, named.
    fn check_open(&self, o: &Open, peer: &str) -> Vec<String> {
        let peer = &format!("coordinator {peer}");
        let mut d = self.info.differences(&o.model, "this node", peer);
        let (a, b) = (o.layers.0 as usize, o.layers.1 as usize);
        if a >= b || b > self.hp.n_layer {
            d.push(format!(
                "{peer} asks for layers {a}:{b}, the model has {} layers",
                self.hp.n_layer
            ));
        } else if let Some(p) = &self.pinned
            && *p != (a..b)
        {
            d.push(format!(
                "{peer} asks for layers {a}:{b}, this node serves only {}:{}",
                p.start, p.end
            ));
        }
        if o.n_ctx == 0 || o.n_ctx as usize > self.cfg.max_ctx {
            d.push(format!(
                "{peer} asks for a context of {}, this node allows 1..={}",
                o.n_ctx, self.cfg.max_ctx
            ));
        }
        if o.n_batch == 0 || o.n_batch as usize > self.cfg.max_batch {
            d.push(format!(
                "{peer} asks for batches of {}, this node allows 1..={}",
                o.n_batch, self.cfg.max_batch
            ));
        }
        if !(o.temperature.is_finite() && o.top_p.is_finite() && o.min_p.is_finite() && o.repeat_penalty > 0.0)
            || o.repeat_penalty.is_infinite()
        {
            d.push(format!(
                "{peer} asks for sampling settings out of range (temperature {}, top-p {}, min-p {}, repeat penalty {})",
                o.temperature, o.top_p, o.min_p, o.repeat_penalty
            ));
        }
        if o.repeat_last_n > o.n_ctx {
            d.push(format!(
                "{peer} asks for a repetition window of {} tokens, beyond its context {}",
                o.repeat_last_n, o.n_ctx
            ));
        }
        if o.top_k > 1000 {
            d.push(format!(
                "{peer} asks for {} top log-probabilities, at most 1000",
                o.top_k
            ));
        }
        d
    }
}

/// Reads one message: the header may take up to `first` (idle wait), the rest at most the I/O timeout.
fn read_frame(s: &mut TcpStream, first: Duration, io: Duration) -> Result<Msg, WireError> {
    s.set_read_timeout(Some(first))?;
    let mut head = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut head[..1])?;
    s.set_read_timeout(Some(io))?;
    s.read_exact(&mut head[1..])?;
    let (code, len) = wire::check_header(&head)?;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Msg::decode(code, &payload)
}

fn wire_err(e: WireError, what: &str) -> anyhow::Error {
    anyhow!("{what}: {e}")
}

/// Refuses the peer with a message (best effort) and ends the connection with that error.
fn refuse(s: &mut TcpStream, msg: String) -> anyhow::Error {
    let _ = wire::write_msg(s, &Msg::Error { message: msg.clone() });
    anyhow!(msg)
}

fn serve_conn(mut s: TcpStream, st: &State, peer: &str) -> Result<()> {
    let io = st.cfg.io_timeout;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(io))?;
    let send = |s: &mut TcpStream, m: &Msg| wire::write_msg(s, m).map_err(|e| wire_err(e, "sending"));

    // 1. Version and nonces.
    let nonce_c = match read_frame(&mut s, io, io) {
        Ok(Msg::Hello { nonce }) => nonce,
        Ok(m) => return Err(refuse(&mut s, format!("expected HELLO, got {}", m.name()))),
        Err(WireError::Malformed(m)) => return Err(refuse(&mut s, m)),
        // Connected and closed without a word: a health check (`baton serve`'s router), not worth a log line.
        Err(WireError::Closed) => return Ok(()),
        Err(e) => return Err(wire_err(e, "reading HELLO")),
    };
    let nonce_n = auth::nonce();
    send(
        &mut s,
        &Msg::Challenge {
            nonce: nonce_n,
            auth_required: st.cfg.secret.is_some(),
        },
    )?;

    // 2. Authentication.
    let mac = match read_frame(&mut s, io, io) {
        Ok(Msg::Auth { mac }) => mac,
        Ok(m) => return Err(refuse(&mut s, format!("expected AUTH, got {}", m.name()))),
        Err(WireError::Malformed(m)) => return Err(refuse(&mut s, m)),
        Err(e) => return Err(wire_err(e, "reading AUTH")),
    };
    let our_mac = match &st.cfg.secret {
        Some(secret) => {
            if !auth::verify(secret, auth::LABEL_COORDINATOR, &nonce_c, &nonce_n, &mac) {
                return Err(refuse(&mut s, "authentication failed: wrong shared secret".into()));
            }
            auth::proof(secret, auth::LABEL_NODE, &nonce_c, &nonce_n)
        }
        None => [0; 32],
    };
    send(&mut s, &Msg::AuthOk { mac: our_mac })?;

    // 3. Model, layers, context.
    let open = match read_frame(&mut s, io, io) {
        Ok(Msg::Open(o)) => o,
        Ok(m) => return Err(refuse(&mut s, format!("expected OPEN, got {}", m.name()))),
        Err(WireError::Malformed(m)) => return Err(refuse(&mut s, m)),
        Err(e) => return Err(wire_err(e, "reading OPEN")),
    };
    let diffs = st.check_open(&open, peer);
    if !diffs.is_empty() {
        return Err(refuse(&mut s, diffs.join("; ")));
    }
    let range = open.layers.0 as usize..open.layers.1 as usize;
    let key = (range.clone(), open.n_ctx as usize, open.n_batch as usize);
    let slot = match st.session(open.session, key, &open) {
        Ok(s) => s,
        Err(e) => {
            return Err(refuse(
                &mut s,
                format!("cannot open layers {}:{}: {e:#}", range.start, range.end),
            ));
        }
    };
    let n_past = lock(&slot).core.n_past();
    send(
        &mut s,
        &Msg::Ready(Ready {
            model: st.info.clone(),
            layers: open.layers,
            n_ctx: open.n_ctx,
            n_past: n_past as u32,
        }),
    )?;
    eprintln!(
        "baton node: {peer} opened session {:016x} on layers {}:{} ({} positions held)",
        open.session, range.start, range.end, n_past
    );

    // 4. Requests until the peer goes away.
    let e = st.hp.n_embd;
    loop {
        let f = match read_frame(&mut s, st.cfg.idle_timeout, io) {
            Ok(Msg::Forward(f)) => f,
            Ok(Msg::Prefill(p)) => {
                // Disaggregated prefill: the KV streams back while the chunks compute (see handoff.rs).
                let drain = {
                    let t_wait = Instant::now();
                    let _c = lock(&st.compute);
                    let queued = t_wait.elapsed();
                    let mut g = lock(&slot);
                    g.last_used = Instant::now();
                    super::handoff::serve_prefill(&mut s, &mut g.core, &p, queued, open.wire)?
                };
                drain.finish()?;
                continue;
            }
            Ok(Msg::Pull(p)) => {
                // Protocol 3: this node decodes; it pulls the prompt's KV from the prefill node named (disagg.rs).
                let req = p.req;
                let res = {
                    let _c = lock(&st.compute);
                    let mut g = lock(&slot);
                    g.last_used = Instant::now();
                    let g = &mut *g;
                    if st.names_this_node(&p.prefill) {
                        serve_pull(&mut g.core, None, &mut Speeds::default(), &st.pool, &p)
                    } else {
                        if g.links.len() >= MAX_LINKS && !g.links.contains_key(&p.prefill) {
                            g.links.clear();
                        }
                        let link = g.links.entry(p.prefill.clone()).or_insert_with(|| {
                            PrefillNode::new(NodeOpts {
                                addr: p.prefill.clone(),
                                secret: st.cfg.secret.clone(),
                                timeouts: Timeouts::default(),
                                kv: RowDtype::F32,
                            })
                        });
                        let mut speeds = lock(&st.speeds);
                        if speeds.len() >= 64 && !speeds.contains_key(&p.prefill) {
                            speeds.clear();
                        }
                        let sp = speeds
                            .entry(p.prefill.clone())
                            .or_insert_with(|| Speeds::for_model(&st.hp));
                        serve_pull(&mut g.core, Some(link), sp, &st.pool, &p)
                    }
                };
                let replies = match res {
                    Ok(Pulled::Mismatch(n_past)) => vec![Msg::Mismatch {
                        req,
                        n_past: n_past as u32,
                    }],
                    Ok(Pulled::Done {
                        report,
                        sample,
                        compute_us,
                    }) => vec![
                        Msg::PullReport(report),
                        Msg::Result(ResultMsg {
                            req,
                            compute_us,
                            body: Body::Sample {
                                token: sample.token,
                                logprob: sample.logprob,
                                top: sample.top,
                            },
                        }),
                    ],
                    Err(e) => vec![Msg::Error {
                        message: format!("{e:#}"),
                    }],
                };
                for m in &replies {
                    send(&mut s, m)?;
                }
                continue;
            }
            Ok(m) => {
                return Err(refuse(&mut s, format!("expected FORWARD, got {}", m.name())));
            }
            Err(WireError::Closed) => {
                let (steps, rows) = st.batched();
                if steps > 0 {
                    eprintln!("baton node: {peer} closed; batched decode so far: {rows} rows in {steps} steps");
                }
                return Ok(());
            }
            Err(WireError::Timeout) => {
                return Err(anyhow!("idle or stalled for longer than the timeout"));
            }
            Err(WireError::Malformed(m)) => return Err(refuse(&mut s, m)),
            Err(e) => return Err(wire_err(e, "reading a request")),
        };
        let n = f.tokens.len();
        let bad = if n == 0 || n > open.n_batch as usize {
            Some(format!("batch of {n} tokens, the session allows 1..={}", open.n_batch))
        } else if let Some(h) = &f.hidden
            && (h.width as usize != e || h.n_rows as usize != n)
        {
            Some(format!("hidden state of {}x{}, expected {n}x{e}", h.n_rows, h.width))
        } else {
            None
        };
        if let Some(msg) = bad {
            send(&mut s, &Msg::Error { message: msg })?;
            continue;
        }
        let hidden = f.hidden.as_ref().map(Hidden::decode);
        let decode = n == 1 && hidden.is_none() && matches!(f.want, WantOut::Sample | WantOut::LastLogits);
        let res = if st.cfg.batch && decode && range.start == 0 && range.end == st.hp.n_layer {
            st.decode_step(&slot, f.pos as usize, f.prefix, f.tokens[0], f.want)
        } else {
            let _c = lock(&st.compute);
            let mut g = lock(&slot);
            g.last_used = Instant::now();
            g.core
                .run(f.pos as usize, &f.prefix, &f.tokens, hidden.as_deref(), f.want)
        };
        let reply = match res {
            Ok((StageOut::Mismatch(n_past), _)) => Msg::Mismatch {
                req: f.req,
                n_past: n_past as u32,
            },
            Ok((out, us)) => {
                let body = match out {
                    StageOut::Ack => Body::Ack,
                    StageOut::Hidden(h) => Body::Hidden(Hidden::encode(&h, e, open.wire)),
                    StageOut::Sample(sm) => Body::Sample {
                        token: sm.token,
                        logprob: sm.logprob,
                        top: sm.top,
                    },
                    StageOut::Logits(l) => Body::Logits(l),
                    StageOut::Mismatch(_) => unreachable!(),
                };
                Msg::Result(ResultMsg {
                    req: f.req,
                    compute_us: us,
                    body,
                })
            }
            Err(err) => Msg::Error {
                message: format!("{err:#}"),
            },
        };
        send(&mut s, &reply)?;
    }
}
