//! What a node's connections share: the layer ranges loaded, the sessions (one [`StageCore`] each, kept across
//! reconnects), the compute lock that lets one forward pass run at a time, and the decode batcher.

use super::NodeConfig;
use crate::cluster::PrefixHash;
use crate::cluster::disagg::{Pulled, Speeds, serve_pull};
use crate::cluster::handoff::{NodeOpts, PrefillNode};
use crate::cluster::handshake::Timeouts;
use crate::cluster::stage::{Prepared, StageCore, StageOut};
use crate::cluster::wire::{Forward, ModelInfo, Open, Pull, WantOut};
use crate::engine::batcher::{BatchStats, Batcher, Liveness, Pending, Policy, Row, Stepper};
use crate::engine::disk_cache::DiskCache;
use crate::engine::snapshot::RowDtype;
use crate::engine::{KvCache, Session};
use crate::gguf::GgufFile;
use crate::kernels::ThreadPool;
use crate::model::{Hparams, Model};
use anyhow::{Result, anyhow};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

pub(super) struct Slot {
    pub(super) core: StageCore,
    /// Links to the prefill nodes this session pulled from (PULL), by address: each keeps its connection and the
    /// records of what that node holds for this conversation.
    links: HashMap<String, PrefillNode>,
    /// (layers, n_ctx, n_batch) the session was opened with.
    key: (Range<usize>, usize, usize),
    pub(super) last_used: Instant,
    /// Its KV's and scratch's share of the node's budget, given back when the last holder (the map or a connection) drops it.
    _kv: KvLease,
}

/// Bytes a session holds under the node's budget ([`NodeConfig::kv_budget`]): the KV of `layers` over `n_ctx`
/// positions and the scratch of batches of `n_batch`, which a hostile OPEN could otherwise make large for free.
pub(super) fn session_bytes(hp: &Hparams, layers: &Range<usize>, n_ctx: usize, n_batch: usize, threads: usize) -> u64 {
    let kv = KvCache::bytes_for(hp, layers.len(), n_ctx);
    let scratch = Session::scratch_bytes(hp, n_ctx, n_batch, threads, layers.end == hp.n_layer);
    kv.saturating_add(scratch) as u64
}

/// Bytes of KV and scratch held under the node's budget ([`NodeConfig::kv_budget`]); subtracted again on drop.
struct KvLease {
    bytes: u64,
    in_use: Arc<AtomicU64>,
}

impl Drop for KvLease {
    fn drop(&mut self) {
        self.in_use.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

pub(super) type SharedSlot = Arc<Mutex<Slot>>;

pub(super) struct State {
    pub(super) cfg: NodeConfig,
    /// The address this node listens on (to recognise a PULL that names this node as its own prefill node).
    listen: SocketAddr,
    file: Arc<GgufFile>,
    pub(super) hp: Hparams,
    pub(super) info: ModelInfo,
    pub(super) pinned: Option<Range<usize>>,
    pool: Arc<ThreadPool>,
    models: Mutex<HashMap<(usize, usize), Arc<Model>>>,
    /// Keyed by (session id, first layer, end layer): one coordinator session may use several ranges of a node.
    sessions: Mutex<HashMap<(u64, usize, usize), SharedSlot>>,
    /// One forward pass at a time: they all share the thread pool and the cores. The batcher's leader holds it too.
    pub(super) compute: Arc<Mutex<()>>,
    /// The `auto` planner's measurements per prefill node this node pulled from (shared by its sessions).
    speeds: Mutex<HashMap<String, Speeds>>,
    /// Decode steps of full-model sessions, batched (made on first use).
    batcher: Mutex<Option<Arc<Batcher<DecodeStep>>>>,
    stats: Arc<BatchStats>,
    /// Most bytes of KV the sessions may hold together, and the bytes they hold now.
    pub(super) kv_budget: u64,
    kv_in_use: Arc<AtomicU64>,
    /// Prefixes' KV on disk (`--kv-cache-dir`), read and written by the prefills this node serves.
    pub(super) disk: Option<DiskCache>,
}

/// A session that asked for a decode step this recently counts as decoding (waited for by a batched step): its
/// next request is a round trip away, and the node cannot see when its coordinator stops.
const DECODING_RECENT: Duration = Duration::from_millis(30);
/// Longest a batched step waits for the decoding sessions' next requests.
const GATHER_WAIT: Duration = Duration::from_millis(2);

/// Prefill nodes a session may keep links to; beyond it the links are dropped (they reconnect on demand).
const MAX_LINKS: usize = 8;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    pub(super) fn new(
        cfg: NodeConfig,
        listen: SocketAddr,
        file: Arc<GgufFile>,
        hp: Hparams,
        info: ModelInfo,
        pinned: Option<Range<usize>>,
        kv_budget: u64,
    ) -> Result<State> {
        let disk = cfg
            .kv_cache_dir
            .as_deref()
            .map(|d| DiskCache::open_gib(d, cfg.kv_cache_gib))
            .transpose()?;
        Ok(State {
            kv_budget,
            kv_in_use: Arc::new(AtomicU64::new(0)),
            pool: Arc::new(ThreadPool::new(cfg.threads)),
            models: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            compute: Arc::new(Mutex::new(())),
            speeds: Mutex::new(HashMap::new()),
            batcher: Mutex::new(None),
            stats: Arc::new(BatchStats::default()),
            listen,
            cfg,
            file,
            hp,
            info,
            pinned,
            disk,
        })
    }

    /// Runs a FORWARD on a session of layers `range` (`hidden`: its hidden state, decoded): a decode step of a
    /// full-model session goes through the batcher (when on), anything else runs alone under the compute lock.
    pub(super) fn forward(
        &self,
        slot: &SharedSlot,
        range: &Range<usize>,
        f: &Forward,
        hidden: Option<&[f32]>,
    ) -> Result<(StageOut, u64)> {
        let (pos, n) = (f.pos as usize, f.tokens.len());
        let decode = n == 1 && hidden.is_none() && matches!(f.want, WantOut::Sample | WantOut::LastLogits);
        if self.cfg.batch && decode && range.start == 0 && range.end == self.hp.n_layer {
            return self.decode_step(slot, pos, f.prefix, f.tokens[0], f.want);
        }
        let _c = lock(&self.compute);
        let mut g = lock(slot);
        g.last_used = Instant::now();
        let out = g.core.run(pos, &f.prefix, &f.tokens, hidden, f.want)?;
        if let Some(d) = &self.disk
            && n > 1
            && !matches!(out.0, StageOut::Mismatch(_))
            && let Err(e) = g.core.store_to_disk(d, pos)
        {
            tracing::warn!("kv-cache: not storing this prefill: {e:#}");
        }
        Ok(out)
    }

    /// LOOKUP: the session keeps the longest prefix of `tokens` it holds, extended from the disk cache when the node
    /// has one; returns the positions held.
    pub(super) fn lookup(&self, slot: &SharedSlot, tokens: &[u32]) -> Result<usize> {
        let _c = lock(&self.compute);
        let mut g = lock(slot);
        g.last_used = Instant::now();
        g.core.hold_prefix(tokens, self.disk.as_ref())
    }

    /// A decode step of a full-model session, stepped together with the other sessions' (`engine::batcher`).
    fn decode_step(
        &self,
        slot: &SharedSlot,
        pos: usize,
        prefix: PrefixHash,
        token: u32,
        want: WantOut,
    ) -> Result<(StageOut, u64)> {
        let (reply, rx) = mpsc::channel();
        self.batcher()?.step(DecodeStep {
            slot: slot.clone(),
            pos,
            prefix,
            token,
            want,
            reply,
        });
        rx.try_recv()
            .unwrap_or_else(|_| Err(anyhow!("the batched decode step was lost")))
    }

    /// The batcher of full-model sessions; its leader holds the compute lock.
    fn batcher(&self) -> Result<Arc<Batcher<DecodeStep>>> {
        let mut b = lock(&self.batcher);
        if let Some(b) = &*b {
            return Ok(b.clone());
        }
        let policy = Policy {
            max_rows: self.cfg.max_sessions.max(1),
            window: GATHER_WAIT,
            liveness: Liveness::Recent(DECODING_RECENT),
        };
        let model = self.model(0..self.hp.n_layer)?;
        let made = Arc::new(Batcher::new(
            model,
            self.pool.clone(),
            self.cfg.max_ctx,
            policy,
            self.stats.clone(),
            self.compute.clone(),
        )?);
        *b = Some(made.clone());
        Ok(made)
    }

    /// `(steps, rows)` of the batched decode so far.
    pub(super) fn batched(&self) -> (u64, u64) {
        (
            self.stats.steps.load(Ordering::Relaxed),
            self.stats.rows.load(Ordering::Relaxed),
        )
    }

    /// Decodes a PULL on `slot`, its prompt's KV pulled from the prefill node it names (or prefilled here when it
    /// names this node), under the compute lock.
    pub(super) fn pull(&self, slot: &SharedSlot, p: &Pull) -> Result<Pulled> {
        let _c = lock(&self.compute);
        let mut g = lock(slot);
        g.last_used = Instant::now();
        let g = &mut *g;
        if self.names_this_node(&p.prefill) {
            return serve_pull(&mut g.core, None, &mut Speeds::default(), &self.pool, p);
        }
        if g.links.len() >= MAX_LINKS && !g.links.contains_key(&p.prefill) {
            g.links.clear();
        }
        let link = g.links.entry(p.prefill.clone()).or_insert_with(|| {
            PrefillNode::new(NodeOpts {
                addr: p.prefill.clone(),
                secret: self.cfg.secret.clone(),
                timeouts: Timeouts::default(),
                kv: RowDtype::F32,
            })
        });
        let mut speeds = lock(&self.speeds);
        if speeds.len() >= 64 && !speeds.contains_key(&p.prefill) {
            speeds.clear();
        }
        let sp = speeds
            .entry(p.prefill.clone())
            .or_insert_with(|| Speeds::for_model(&self.hp));
        serve_pull(&mut g.core, Some(link), sp, &self.pool, p)
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

    pub(super) fn model(&self, r: Range<usize>) -> Result<Arc<Model>> {
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
    pub(super) fn session(&self, id: u64, key: (Range<usize>, usize, usize), open: &Open) -> Result<SharedSlot> {
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
        let bytes = session_bytes(&self.hp, &key.0, key.1, key.2, self.pool.n_threads());
        let kv = self.reserve_kv(&mut sessions, bytes)?;
        while sessions.len() >= self.cfg.max_sessions.max(1) {
            let oldest = sessions
                .iter()
                .min_by_key(|(_, s)| lock(s).last_used)
                .map(|(k, _)| *k)
                .unwrap();
            sessions.remove(&oldest);
            tracing::info!(
                "baton node: evicted session {:016x} (layers {}:{})",
                oldest.0,
                oldest.1,
                oldest.2
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
            _kv: kv,
        }));
        sessions.insert(id, slot.clone());
        Ok(slot)
    }

    /// A lease on `bytes` of the budget (a session's KV and scratch): sessions no connection holds are evicted,
    /// least recently used first, until the new one fits; when the sessions in use leave no room, the OPEN is refused
    /// with the figures.
    fn reserve_kv(&self, sessions: &mut HashMap<(u64, usize, usize), SharedSlot>, bytes: u64) -> Result<KvLease> {
        const MIB: u64 = 1 << 20;
        loop {
            let grabbed = self
                .kv_in_use
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    n.checked_add(bytes).filter(|&t| t <= self.kv_budget)
                })
                .is_ok();
            if grabbed {
                return Ok(KvLease {
                    bytes,
                    in_use: self.kv_in_use.clone(),
                });
            }
            // Only the map holds these: dropping them frees their KV now.
            let idle = sessions
                .iter()
                .filter(|(_, s)| Arc::strong_count(s) == 1)
                .min_by_key(|(_, s)| lock(s).last_used)
                .map(|(k, _)| *k);
            let Some(oldest) = idle else {
                return Err(anyhow!(
                    "node KV budget full: this session needs {} MiB of KV and scratch, {} MiB of the {} MiB budget are \
                     held by sessions in use; try again later or ask for a shorter context or smaller batches",
                    bytes.div_ceil(MIB),
                    self.kv_in_use.load(Ordering::Acquire).div_ceil(MIB),
                    self.kv_budget / MIB
                ));
            };
            sessions.remove(&oldest);
            tracing::info!(
                "baton node: evicted session {:016x} (layers {}:{}) to make room in the KV budget",
                oldest.0,
                oldest.1,
                oldest.2
            );
        }
    }

    /// Everything that makes an OPEN unacceptable, named.
    pub(super) fn check_open(&self, o: &Open, peer: &str) -> Vec<String> {
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
        if let Err((_, e)) = o.sampler().check(crate::engine::sampler::SamplerField::wire) {
            d.push(format!("{peer} asks for a sampling setting out of range: {e}"));
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

/// One session's single-token decode step, queued for the batcher; its connection thread then reads `reply`.
struct DecodeStep {
    slot: SharedSlot,
    pos: usize,
    prefix: PrefixHash,
    token: u32,
    want: WantOut,
    reply: mpsc::Sender<Result<(StageOut, u64)>>,
}

impl Pending for DecodeStep {
    fn session_key(&self) -> usize {
        Arc::as_ptr(&self.slot) as usize
    }

    /// Checks each request as a lone forward would (`StageCore::prepare`: the prefix, the window, the sampler's
    /// history) and answers refusals at once; the rest step together, then `StageCore::finish` samples each.
    fn run(steps: Vec<Self>, stepper: &mut Stepper) {
        let slots: Vec<SharedSlot> = steps.iter().map(|p| p.slot.clone()).collect();
        let mut rows = Vec::with_capacity(steps.len());
        for (step, mut slot) in steps.into_iter().zip(slots.iter().map(|s| lock(s))) {
            slot.last_used = Instant::now();
            match slot
                .core
                .prepare(step.pos, &step.prefix, &[step.token], None, step.want)
            {
                Ok(Ok(prep)) => rows.push(DecodeRow { step, slot, prep }),
                Ok(Err(mismatch)) => {
                    let _ = step.reply.send(Ok((mismatch, 0)));
                }
                Err(e) => {
                    let _ = step.reply.send(Err(e));
                }
            }
        }
        stepper.run(rows);
    }
}

/// A decode step accepted by `StageCore::prepare`, its session locked.
struct DecodeRow<'a> {
    step: DecodeStep,
    slot: MutexGuard<'a, Slot>,
    prep: Prepared,
}

impl Row for DecodeRow<'_> {
    fn token(&self) -> u32 {
        self.step.token
    }

    fn session(&mut self) -> &mut Session {
        self.slot.core.session_mut()
    }

    fn done(mut self, out: Result<Duration>) {
        let res = out.map(|t| {
            let logits = self.slot.core.session().last_logits().to_vec();
            let out = self.slot.core.finish(&self.prep, &[self.step.token], &logits);
            (out, t.as_micros() as u64)
        });
        let _ = self.step.reply.send(res);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session counts its KV and its scratch: more for bigger batches, the logits only where it ends the model.
    #[test]
    fn a_session_counts_its_kv_and_its_scratch() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/llama3.gguf");
        let hp = Hparams::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let all = 0..hp.n_layer;
        let kv = KvCache::bytes_for(&hp, hp.n_layer, 256) as u64;
        let small = session_bytes(&hp, &all, 256, 16, 1);
        assert_eq!(small, kv + Session::scratch_bytes(&hp, 256, 16, 1, true) as u64);
        assert!(session_bytes(&hp, &all, 256, 64, 1) > small + 48 * hp.n_embd as u64 * 4);
        let first = 0..1;
        let logits = hp.n_vocab as u64 * 4;
        let kv1 = KvCache::bytes_for(&hp, 1, 256) as u64;
        assert_eq!(session_bytes(&hp, &first, 256, 16, 1) + logits, small - kv + kv1);
        assert_eq!(session_bytes(&hp, &all, usize::MAX, 16, 1), u64::MAX);
    }
}
