//! The coordinator: one session whose layers run on several stages (remote nodes and at most one local range).
//!
//! Data flow: the coordinator relays. Each chunk of tokens goes to the first stage; the hidden state it returns goes
//! to the next stage, and so on; the last stage samples (or returns logits when asked) so a vocabulary of logits
//! never crosses the wire per token. Relaying through the coordinator costs one extra hop per stage boundary compared
//! with stages forwarding to each other, but it keeps every timeout, error and retry in one place, lets the
//! coordinator own any range (first, middle, last or none), and needs no node-to-node connections or routes.
//!
//! Prefill is pipelined: with more than one chunk, each stage is driven by its own thread, connected to the next by a
//! channel, so stage 2 computes chunk i while stage 1 computes chunk i+1. Decode is one token per pass, sequential.
//!
//! Consistency: every request carries its position and the hash of the token prefix before it. A stage that does not
//! hold that prefix (restarted, evicted, another session) answers "mismatch"; the coordinator then replays the whole
//! prefix from position 0 through every stage, once, and never uses KV it cannot vouch for.

use super::handshake::{self, Conn, Timeouts};
use super::pipeline_spec::{StageSpec, parse_pipeline};
use super::stage::{Sampled, StageCore, StageOut};
use super::wire::{Body, Forward, Hidden, ModelInfo, Msg, Open, Pull, PullReport, ResultMsg, WantOut};
use super::{PrefixHash, prefix_next, prefix_root};
use crate::engine::sampler::SamplerParams;
use crate::engine::snapshot::RowDtype;
use crate::gguf::GgufFile;
use crate::kernels::ThreadPool;
use crate::model::{Hparams, Model};
use anyhow::{Result, anyhow, bail};
use rand::RngCore;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct PipelineOpts {
    /// Context size of the session on every stage.
    pub n_ctx: usize,
    /// Tokens per prefill chunk (also the batch size every stage allocates for).
    pub chunk: usize,
    /// Hidden-state precision on the wire.
    pub wire: RowDtype,
    /// Shared secret (required by nodes that listen beyond loopback).
    pub secret: Option<Vec<u8>>,
    /// Threads of the local stage.
    pub threads: usize,
    pub timeouts: Timeouts,
    /// The last stage's sampler (greedy by default).
    pub sampling: SamplerParams,
    /// Top log-probabilities returned with each sampled token.
    pub top_k: usize,
    /// Log replays and reconnects to standard error.
    pub verbose: bool,
    /// The request being served (empty: none): OPEN, FORWARD and PULL carry it so the nodes log it.
    pub request_id: String,
}

impl Default for PipelineOpts {
    fn default() -> Self {
        PipelineOpts {
            n_ctx: 4096,
            chunk: 128,
            wire: RowDtype::F32,
            secret: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            timeouts: Timeouts::default(),
            sampling: SamplerParams::greedy(),
            top_k: 0,
            request_id: String::new(),
            verbose: false,
        }
    }
}

/// A prefill the decode node pulls from a prefill node (protocol 3, PULL): which node, how many layers
/// ([`super::wire::OFFLOAD_AUTO`]: the decode node decides), KV precision, the decode node's deadline per wait.
#[derive(Clone, Debug)]
pub struct PullSpec {
    pub addr: String,
    pub offload: u32,
    pub kv: RowDtype,
    pub timeout: Duration,
}

/// What one stage did so far (for `-v` and benchmarks).
#[derive(Clone, Debug, Default)]
pub struct StageStats {
    pub label: String,
    pub layers: Range<usize>,
    pub requests: u64,
    pub tokens: u64,
    /// Time the stage reported computing.
    pub compute: Duration,
    /// Time from sending a request to having its answer (compute + wire + queueing).
    pub wall: Duration,
    pub bytes_sent: u64,
    pub bytes_recv: u64,
    /// Connections opened after the first one (restarts, idle drops).
    pub reconnects: u64,
    /// What a remote stage said in READY of its backend and ISA (protocol 5); `None` before it connected.
    pub backend: Option<String>,
    pub isa: Option<String>,
}

/// Data flowing from one stage to the next.
enum Carry {
    None,
    F32(Vec<f32>),
    Wire(Hidden),
}

/// What the last stage returned.
enum Out {
    Ack,
    Sample(Sampled),
    Logits(Vec<f32>),
}

/// One chunk on its way through the stages.
struct Job {
    req: u64,
    pos: usize,
    prefix: PrefixHash,
    tokens: Vec<u32>,
    /// What the last stage should return.
    want: WantOut,
    carry: Carry,
    out: Option<Out>,
}

enum Fail {
    Mismatch(usize),
    Err(anyhow::Error),
}

impl From<anyhow::Error> for Fail {
    fn from(e: anyhow::Error) -> Self {
        Fail::Err(e)
    }
}

struct Remote {
    addr: String,
    open: Open,
    conn: Option<Conn>,
    connected_once: bool,
    last_used: Instant,
    /// The request id the node has from this connection (OPEN or the last FORWARD that named one).
    sent_request_id: String,
}

enum Kind {
    Local(Box<StageCore>),
    Remote(Box<Remote>),
}

struct Stage {
    spec: StageSpec,
    kind: Kind,
    stats: StageStats,
}

/// Shared read-only parameters of a pass.
#[derive(Clone, Copy)]
struct PassCtx<'a> {
    n_embd: usize,
    n_vocab: usize,
    wire: RowDtype,
    secret: Option<&'a [u8]>,
    timeouts: Timeouts,
    verbose: bool,
    request_id: &'a str,
}

/// A connection idle for longer than this is retried once on failure (the node may have closed it as idle).
const IDLE_RETRY: Duration = Duration::from_secs(5);

impl Remote {
    fn ensure(&mut self, c: &PassCtx, stats: &mut StageStats) -> Result<()> {
        if self.conn.is_none() {
            self.open.request_id = c.request_id.to_string();
            let (conn, ready) = handshake::connect(&self.addr, c.secret, &self.open, c.timeouts)?;
            self.sent_request_id = c.request_id.to_string();
            if self.connected_once {
                stats.reconnects += 1;
                if c.verbose {
                    tracing::info!(
                        "pipeline: reconnected to {} ({} positions held there)",
                        self.addr,
                        ready.n_past
                    );
                }
            }
            stats.bytes_sent += conn.bytes_sent;
            stats.bytes_recv += conn.bytes_recv;
            stats.backend = Some(ready.backend);
            stats.isa = Some(ready.isa);
            self.connected_once = true;
            self.conn = Some(conn);
        }
        Ok(())
    }

    fn roundtrip(&mut self, f: &Forward, c: &PassCtx, stats: &mut StageStats) -> Result<Msg> {
        let idle = self.last_used.elapsed() > IDLE_RETRY;
        let r = self.try_roundtrip(f, c, stats);
        let r = match r {
            Err(e) if idle && self.conn.is_none() => {
                if c.verbose {
                    tracing::warn!("pipeline: {e:#}; retrying once on a new connection");
                }
                self.try_roundtrip(f, c, stats)
            }
            r => r,
        };
        self.last_used = Instant::now();
        r
    }

    fn try_roundtrip(&mut self, f: &Forward, c: &PassCtx, stats: &mut StageStats) -> Result<Msg> {
        self.ensure(c, stats)?;
        let conn = self.conn.as_mut().unwrap();
        let (s0, r0) = (conn.bytes_sent, conn.bytes_recv);
        let what = format!("positions {}..{}", f.pos, f.pos as usize + f.tokens.len());
        let mut f = f.clone();
        if self.sent_request_id != c.request_id {
            f.request_id = c.request_id.to_string();
            self.sent_request_id = f.request_id.clone();
        }
        let r = conn.send(&Msg::Forward(f), &what).and_then(|_| conn.recv(&what));
        stats.bytes_sent += conn.bytes_sent - s0;
        stats.bytes_recv += conn.bytes_recv - r0;
        if r.is_err() {
            // Whatever state the stream is in, it is not trusted again.
            self.conn = None;
        }
        r
    }
}

impl Stage {
    /// LOOKUP (protocol 5): this stage keeps the longest prefix of `tokens` it holds, from its KV or its node's disk
    /// cache; returns the positions it holds now.
    fn lookup(&mut self, req: u64, tokens: &[u32], c: &PassCtx) -> Result<usize> {
        let label = self.spec.label();
        let r = match &mut self.kind {
            Kind::Local(core) => return core.hold_prefix(tokens, None),
            Kind::Remote(r) => r,
        };
        r.ensure(c, &mut self.stats)?;
        let conn = r.conn.as_mut().unwrap();
        let (s0, r0) = (conn.bytes_sent, conn.bytes_recv);
        let what = format!("a lookup of {} tokens", tokens.len());
        let msg = Msg::Lookup {
            req,
            tokens: tokens.to_vec(),
        };
        let reply = conn.send(&msg, &what).and_then(|_| conn.recv(&what));
        self.stats.bytes_sent += conn.bytes_sent - s0;
        self.stats.bytes_recv += conn.bytes_recv - r0;
        r.last_used = Instant::now();
        match reply {
            Ok(Msg::Cached { req: q, n_past }) if q == req && n_past as usize <= tokens.len() => Ok(n_past as usize),
            other => {
                r.conn = None;
                match other {
                    Err(e) => Err(e),
                    Ok(m) => bail!("stage {label} answered LOOKUP with {}", m.name()),
                }
            }
        }
    }

    /// Runs `job` through this stage: consumes its carry, leaves the stage's output in it.
    fn call(&mut self, job: &mut Job, last: bool, c: &PassCtx) -> Result<(), Fail> {
        let t0 = Instant::now();
        let n = job.tokens.len();
        let want = if last { job.want } else { WantOut::Hidden };
        let carry = std::mem::replace(&mut job.carry, Carry::None);
        let label = self.spec.label();
        let compute_us = match &mut self.kind {
            Kind::Local(core) => {
                let hidden = match carry {
                    Carry::None => None,
                    Carry::F32(v) => Some(v),
                    Carry::Wire(h) => Some(h.decode()),
                };
                let (out, us) = core
                    .run(job.pos, &job.prefix, &job.tokens, hidden.as_deref(), want)
                    .map_err(|e| anyhow!("local stage {label}: {e:#}"))?;
                match out {
                    StageOut::Mismatch(n) => return Err(Fail::Mismatch(n)),
                    StageOut::Hidden(h) => job.carry = Carry::F32(h),
                    StageOut::Ack => job.out = Some(Out::Ack),
                    StageOut::Sample(s) => job.out = Some(Out::Sample(s)),
                    StageOut::Logits(l) => job.out = Some(Out::Logits(l)),
                }
                us
            }
            Kind::Remote(r) => {
                let hidden = match carry {
                    Carry::None => None,
                    Carry::F32(v) => Some(Hidden::encode(&v, c.n_embd, c.wire)),
                    Carry::Wire(h) => Some(h),
                };
                let f = Forward {
                    req: job.req,
                    pos: job.pos as u32,
                    prefix: job.prefix,
                    tokens: job.tokens.clone(),
                    hidden,
                    want,
                    request_id: String::new(),
                };
                let reply = r.roundtrip(&f, c, &mut self.stats)?;
                let res = match reply {
                    Msg::Result(res) if res.req == job.req => res,
                    Msg::Result(res) => {
                        r.conn = None;
                        return Err(
                            anyhow!("stage {label} answered request {} with request {}", job.req, res.req).into(),
                        );
                    }
                    Msg::Mismatch { n_past, .. } => {
                        if c.verbose {
                            tracing::info!(
                                "pipeline: stage {label} does not hold the prefix of position {} (it holds {n_past} \
                                 positions of another timeline); replaying",
                                job.pos
                            );
                        }
                        return Err(Fail::Mismatch(n_past as usize));
                    }
                    m => {
                        r.conn = None;
                        return Err(anyhow!("stage {label} answered FORWARD with {}", m.name()).into());
                    }
                };
                let ok = match (res.body, want) {
                    (Body::Hidden(h), WantOut::Hidden) if h.n_rows as usize == n && h.width as usize == c.n_embd => {
                        job.carry = Carry::Wire(h);
                        true
                    }
                    (Body::Ack, WantOut::Ack) => {
                        job.out = Some(Out::Ack);
                        true
                    }
                    (Body::Sample { token, logprob, top }, WantOut::Sample) if (token as usize) < c.n_vocab => {
                        job.out = Some(Out::Sample(Sampled { token, logprob, top }));
                        true
                    }
                    (Body::Logits(l), WantOut::LastLogits) if l.len() == c.n_vocab => {
                        job.out = Some(Out::Logits(l));
                        true
                    }
                    (Body::Logits(l), WantOut::AllLogits) if l.len() == n * c.n_vocab => {
                        job.out = Some(Out::Logits(l));
                        true
                    }
                    _ => false,
                };
                if !ok {
                    r.conn = None;
                    return Err(anyhow!("stage {label} returned a result of the wrong kind or shape").into());
                }
                res.compute_us
            }
        };
        self.stats.requests += 1;
        self.stats.tokens += n as u64;
        self.stats.compute += Duration::from_micros(compute_us);
        self.stats.wall += t0.elapsed();
        Ok(())
    }
}

/// The last stage's sampler settings as the stages get them: a missing seed becomes a fresh random one (the nodes need
/// a concrete one; like a local run, each request without a seed gets a new one), a negative temperature becomes 0
/// (greedy either way).
fn resolved(mut p: SamplerParams) -> SamplerParams {
    p.temp = p.temp.max(0.0);
    p.seed.get_or_insert_with(rand::random);
    p
}

/// A session whose layers run across a pipeline of stages; the same shape as a local session.
pub struct PipelineSession {
    stages: Vec<Stage>,
    hp: Hparams,
    opts: PipelineOpts,
    tokens: Vec<u32>,
    /// `hashes[p]` = hash of `tokens[..p]`.
    hashes: Vec<PrefixHash>,
    session_id: u64,
    next_req: u64,
    replays: u64,
}

impl PipelineSession {
    /// Loads the local range (if any), connects to, authenticates and opens every remote stage.
    ///
    /// `spec` is `ADDR=A:B,...` with `local` for a range computed here; `model_path` is the coordinator's copy of
    /// the model (its fingerprint must match every node's).
    pub fn connect(spec: &str, model_path: &Path, mut opts: PipelineOpts) -> Result<PipelineSession> {
        opts.sampling = resolved(opts.sampling);
        let file = Arc::new(GgufFile::open(model_path)?);
        let hp = Hparams::from_gguf(&file)?;
        let specs = parse_pipeline(spec, hp.n_layer)?;
        if opts.chunk == 0 || opts.n_ctx == 0 {
            bail!("pipeline chunk and context sizes must be positive");
        }
        let fp = crate::fingerprint::fingerprint(model_path)?;
        let info = ModelInfo::of(&hp, &fp);
        let session_id = rand::rngs::OsRng.next_u64();
        let mut stages = Vec::with_capacity(specs.len());
        for s in specs {
            let mut stats = StageStats {
                label: s.label(),
                layers: s.layers.clone(),
                ..Default::default()
            };
            let kind = match &s.addr {
                None => {
                    let model = Arc::new(Model::from_file(file.clone(), Some(s.layers.clone()))?);
                    let pool = Arc::new(ThreadPool::new(opts.threads));
                    Kind::Local(Box::new(StageCore::new(
                        model,
                        pool,
                        opts.n_ctx,
                        opts.chunk,
                        opts.sampling,
                        opts.top_k,
                    )?))
                }
                Some(addr) => {
                    let mut open = Open {
                        model: info.clone(),
                        layers: (s.layers.start as u32, s.layers.end as u32),
                        n_ctx: opts.n_ctx as u32,
                        n_batch: opts.chunk as u32,
                        wire: opts.wire,
                        session: session_id,
                        temperature: 0.0,
                        top_p: 1.0,
                        seed: 0,
                        top_k: opts.top_k.min(1000) as u16,
                        sample_top_k: 0,
                        min_p: 0.0,
                        repeat_penalty: 1.0,
                        repeat_last_n: 0,
                        request_id: String::new(),
                    };
                    open.set_sampler(&opts.sampling, opts.n_ctx);
                    let mut r = Remote {
                        addr: addr.clone(),
                        open,
                        conn: None,
                        connected_once: false,
                        last_used: Instant::now(),
                        sent_request_id: String::new(),
                    };
                    r.ensure(&PassCtx::new(&hp, &opts), &mut stats)?;
                    Kind::Remote(Box::new(r))
                }
            };
            stages.push(Stage { spec: s, kind, stats });
        }
        Ok(PipelineSession {
            stages,
            hp,
            opts,
            tokens: Vec::new(),
            hashes: vec![prefix_root()],
            session_id,
            next_req: 1,
            replays: 0,
        })
    }

    pub fn hparams(&self) -> &Hparams {
        &self.hp
    }
    pub fn n_ctx(&self) -> usize {
        self.opts.n_ctx
    }
    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn session_id(&self) -> u64 {
        self.session_id
    }
    /// Times a stage's KV did not match and the prefix was replayed.
    pub fn replays(&self) -> u64 {
        self.replays
    }
    pub fn stages(&self) -> Vec<StageSpec> {
        self.stages.iter().map(|s| s.spec.clone()).collect()
    }
    pub fn stats(&self) -> Vec<StageStats> {
        self.stages.iter().map(|s| s.stats.clone()).collect()
    }
    pub fn reset_stats(&mut self) {
        for s in &mut self.stages {
            s.stats = StageStats {
                label: s.stats.label.clone(),
                layers: s.stats.layers.clone(),
                backend: s.stats.backend.clone(),
                isa: s.stats.isa.clone(),
                ..Default::default()
            };
        }
    }

    /// Names the request the following calls serve (empty: none); the nodes log it.
    pub fn set_request_id(&mut self, id: &str) {
        self.opts.request_id = id.to_string();
    }

    /// Changes the longest wait for any read or write (and so for a stage's compute) from now on.
    pub fn set_io_timeout(&mut self, t: Duration) {
        self.opts.timeouts.io = t;
        for st in &mut self.stages {
            if let Kind::Remote(r) = &mut st.kind
                && let Some(c) = &mut r.conn
            {
                c.timeouts.io = t;
                let _ = c.stream.set_read_timeout(Some(t));
                let _ = c.stream.set_write_timeout(Some(t));
            }
        }
    }

    /// New sampling settings for the requests that follow, keeping every stage's KV: the last stage's sampler is
    /// replaced (a remote one is reopened on a fresh connection under the same session id, which keeps its cache).
    pub fn set_sampling(&mut self, sampling: SamplerParams, top_k: usize) {
        let sampling = resolved(sampling);
        if self.opts.sampling == sampling && self.opts.top_k == top_k {
            return;
        }
        self.opts.sampling = sampling;
        self.opts.top_k = top_k;
        let n_ctx = self.opts.n_ctx;
        if let Some(last) = self.stages.last_mut() {
            match &mut last.kind {
                Kind::Local(core) => core.set_sampling(sampling, top_k),
                Kind::Remote(r) => {
                    r.open.set_sampler(&sampling, n_ctx);
                    r.open.top_k = top_k.min(1000) as u16;
                    r.conn = None;
                    // A planned reopen, not a fault: not counted as a reconnect.
                    r.connected_once = false;
                }
            }
        }
    }

    /// Forgets every position from `n` on. Nothing crosses the wire: the next request's position and prefix hash
    /// tell each stage to rewind.
    pub fn rewind(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.hashes.truncate(n + 1);
    }

    /// Keeps the longest prefix of the session that `tokens` starts with (leaving at least one token to feed) and
    /// returns its length; the caller then feeds `tokens[kept..]`.
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> usize {
        let mut n = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        if n == tokens.len() && n > 0 {
            n -= 1;
        }
        self.rewind(n);
        n
    }

    /// Asks every stage to hold as much of `tokens` as it can, from its KV or its node's disk cache
    /// (`--kv-cache-dir`), and keeps the prefix all of them hold (at least `held`, the prefix this session already
    /// shares with `tokens`, and leaving one token to feed); returns its length. A stage that fails the lookup costs
    /// only the disk hit: the session keeps `held`.
    pub fn hold_prefix(&mut self, tokens: &[u32], held: usize) -> usize {
        let limit = tokens.len().saturating_sub(1);
        let ctx = PassCtx::new(&self.hp, &self.opts);
        let mut all = limit;
        for st in &mut self.stages {
            let req = self.next_req;
            self.next_req += 1;
            match st.lookup(req, tokens, &ctx) {
                Ok(n) => all = all.min(n),
                Err(e) => {
                    tracing::warn!("pipeline: lookup failed ({e:#}); prefilling from position {held}");
                    return held;
                }
            }
        }
        if all <= held {
            return held;
        }
        self.rewind(held);
        for &t in &tokens[held..all] {
            let h = prefix_next(self.hashes.last().unwrap(), t);
            self.hashes.push(h);
            self.tokens.push(t);
        }
        if self.opts.verbose {
            tracing::info!("pipeline: every stage holds {all} positions of the prompt ({held} before the lookup)");
        }
        all
    }

    /// Appends `tokens` and samples the next one on the last stage.
    pub fn eval(&mut self, tokens: &[u32]) -> Result<Sampled> {
        match self.run(tokens, WantOut::Sample)? {
            Out::Sample(s) => Ok(s),
            _ => unreachable!("checked by the stage"),
        }
    }

    /// One decode step: appends `token`, returns the sampled next token.
    pub fn decode_step(&mut self, token: u32) -> Result<Sampled> {
        self.eval(&[token])
    }

    /// Appends `tokens` and returns the logits of the last one (a vocabulary of f32 crosses the wire).
    pub fn eval_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        match self.run(tokens, WantOut::LastLogits)? {
            Out::Logits(l) => Ok(l),
            _ => unreachable!("checked by the stage"),
        }
    }

    /// Appends `tokens` and returns every token's logits, `[tokens.len(), n_vocab]` (perplexity).
    pub fn eval_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        match self.run(tokens, WantOut::AllLogits)? {
            Out::Logits(l) => Ok(l),
            _ => unreachable!("checked by the stage"),
        }
    }

    /// Appends `new` like [`PipelineSession::eval`], but the single full-model remote stage (a decode node) pulls the
    /// prompt's KV from a prefill node (PULL) instead of computing it alone; it falls back to its own prefill if the
    /// prefill node fails. Returns the first sampled token and the decode node's report.
    pub fn eval_pulled(&mut self, new: &[u32], spec: &PullSpec) -> Result<(Sampled, PullReport)> {
        if self.stages.len() != 1 || self.stages[0].spec.layers != (0..self.hp.n_layer) {
            bail!("a pulled prefill needs a single remote stage holding every layer (the decode node)");
        }
        self.check_new(new)?;
        let ctx = PassCtx::new(&self.hp, &self.opts);
        let stage = &mut self.stages[0];
        let label = stage.spec.label();
        let Kind::Remote(r) = &mut stage.kind else {
            bail!("a pulled prefill needs a remote decode node");
        };
        // The decode node may wait on the prefill node, then prefill alone: allow for both.
        let chunks = (self.tokens.len() + new.len()).div_ceil(self.opts.chunk) as u32;
        let wait = spec.timeout + ctx.timeouts.connect + ctx.timeouts.io * chunks.max(1);
        for attempt in 0..2 {
            let start = if attempt == 0 { self.tokens.len() } else { 0 };
            let mut feed = self.tokens[start..].to_vec();
            feed.extend_from_slice(new);
            let req = self.next_req;
            self.next_req += 1;
            let msg = Msg::Pull(Pull {
                req,
                pos: start as u32,
                prefix: self.hashes[start],
                tokens: feed.clone(),
                prefill: spec.addr.clone(),
                offload: spec.offload,
                kv: spec.kv,
                timeout_ms: spec.timeout.as_millis().min(u32::MAX as u128) as u32,
                request_id: ctx.request_id.to_string(),
            });
            let t0 = Instant::now();
            r.ensure(&ctx, &mut stage.stats)?;
            // PULL names the request: the FORWARDs after it need not.
            r.sent_request_id = ctx.request_id.to_string();
            let conn = r.conn.as_mut().unwrap();
            let (s0, r0) = (conn.bytes_sent, conn.bytes_recv);
            let what = format!("the pulled prefill of positions {start}..{}", start + feed.len());
            let _ = conn.stream.set_read_timeout(Some(wait));
            let res = (|| -> Result<Option<(Sampled, PullReport, u64)>> {
                conn.send(&msg, &what)?;
                let report = match conn.recv(&what)? {
                    Msg::PullReport(rep) if rep.req == req => rep,
                    Msg::Mismatch { req: q, .. } if q == req => return Ok(None),
                    m => bail!("stage {label} answered PULL with {}", m.name()),
                };
                match conn.recv(&what)? {
                    Msg::Result(ResultMsg {
                        req: q,
                        compute_us,
                        body: Body::Sample { token, logprob, top },
                    }) if q == req && (token as usize) < ctx.n_vocab => {
                        Ok(Some((Sampled { token, logprob, top }, report, compute_us)))
                    }
                    m => bail!("stage {label} answered PULL with {} instead of a sample", m.name()),
                }
            })();
            let _ = conn.stream.set_read_timeout(Some(ctx.timeouts.io));
            stage.stats.bytes_sent += conn.bytes_sent - s0;
            stage.stats.bytes_recv += conn.bytes_recv - r0;
            r.last_used = Instant::now();
            match res {
                Ok(Some((sampled, report, compute_us))) => {
                    stage.stats.requests += 1;
                    stage.stats.tokens += feed.len() as u64;
                    stage.stats.compute += Duration::from_micros(compute_us);
                    stage.stats.wall += t0.elapsed();
                    for &t in new {
                        let h = prefix_next(self.hashes.last().unwrap(), t);
                        self.hashes.push(h);
                        self.tokens.push(t);
                    }
                    return Ok((sampled, report));
                }
                Ok(None) if attempt == 0 => self.replays += 1,
                Ok(None) => bail!("the decode node still does not hold the session's prefix after a full replay"),
                Err(e) => {
                    r.conn = None;
                    return Err(e);
                }
            }
        }
        unreachable!()
    }

    fn check_new(&self, new: &[u32]) -> Result<()> {
        if new.is_empty() {
            bail!("nothing to evaluate");
        }
        if self.tokens.len() + new.len() > self.opts.n_ctx {
            bail!(
                "context full: {} positions held + {} new exceed the context size {} (use a larger -c)",
                self.tokens.len(),
                new.len(),
                self.opts.n_ctx
            );
        }
        if let Some(&t) = new.iter().find(|&&t| t as usize >= self.hp.n_vocab) {
            bail!("token id {t} is outside the vocabulary of {}", self.hp.n_vocab);
        }
        Ok(())
    }

    fn run(&mut self, new: &[u32], want: WantOut) -> Result<Out> {
        self.check_new(new)?;
        for attempt in 0..2 {
            let start = if attempt == 0 { self.tokens.len() } else { 0 };
            let mut feed = self.tokens[start..].to_vec();
            feed.extend_from_slice(new);
            match self.pass(start, &feed, want) {
                Ok(mut out) => {
                    if let (Out::Logits(l), WantOut::AllLogits) = (&mut out, want) {
                        // A replay also scored the old prefix: keep the new tokens' rows.
                        let keep = new.len() * self.hp.n_vocab;
                        l.drain(..l.len() - keep);
                    }
                    for &t in new {
                        let h = prefix_next(self.hashes.last().unwrap(), t);
                        self.hashes.push(h);
                        self.tokens.push(t);
                    }
                    return Ok(out);
                }
                Err(Fail::Mismatch(held)) if attempt == 0 => {
                    self.replays += 1;
                    if self.opts.verbose {
                        tracing::info!(
                            "pipeline: a stage holds {held} positions of another timeline; replaying {} positions \
                             through every stage",
                            self.tokens.len()
                        );
                    }
                }
                Err(Fail::Mismatch(_)) => {
                    bail!("a stage still does not hold the session's prefix after a full replay")
                }
                Err(Fail::Err(e)) => return Err(e),
            }
        }
        unreachable!()
    }

    /// Runs `feed` (positions `start..`) through every stage in chunks; the last stage answers `want` for the
    /// last chunk (and for every chunk when all logits are wanted).
    fn pass(&mut self, start: usize, feed: &[u32], want: WantOut) -> Result<Out, Fail> {
        let mut prefix = self.hashes[start];
        let mut jobs = Vec::new();
        let n_chunks = feed.len().div_ceil(self.opts.chunk);
        for (i, chunk) in feed.chunks(self.opts.chunk).enumerate() {
            let w = if i + 1 == n_chunks || want == WantOut::AllLogits {
                want
            } else {
                WantOut::Ack
            };
            jobs.push(Job {
                req: self.next_req,
                pos: start + i * self.opts.chunk,
                prefix,
                tokens: chunk.to_vec(),
                want: w,
                carry: Carry::None,
                out: None,
            });
            self.next_req += 1;
            for &t in chunk {
                prefix = prefix_next(&prefix, t);
            }
        }
        let ctx = PassCtx::new(&self.hp, &self.opts);
        let n_stages = self.stages.len();
        let done: Vec<Job> = if jobs.len() == 1 || n_stages == 1 {
            let mut done = Vec::with_capacity(jobs.len());
            for mut job in jobs {
                for (i, st) in self.stages.iter_mut().enumerate() {
                    st.call(&mut job, i + 1 == n_stages, &ctx)?;
                }
                done.push(job);
            }
            done
        } else {
            pipelined(&mut self.stages, jobs, &ctx)?
        };
        let mut outs = done.into_iter().map(|j| j.out.expect("the last stage always answers"));
        if want == WantOut::AllLogits {
            let mut all = Vec::with_capacity(feed.len() * self.hp.n_vocab);
            for o in outs {
                match o {
                    Out::Logits(l) => all.extend_from_slice(&l),
                    _ => unreachable!(),
                }
            }
            Ok(Out::Logits(all))
        } else {
            Ok(outs.next_back().unwrap())
        }
    }
}

impl<'a> PassCtx<'a> {
    fn new(hp: &Hparams, o: &'a PipelineOpts) -> PassCtx<'a> {
        PassCtx {
            n_embd: hp.n_embd,
            n_vocab: hp.n_vocab,
            wire: o.wire,
            secret: o.secret.as_deref(),
            timeouts: o.timeouts,
            verbose: o.verbose,
            request_id: &o.request_id,
        }
    }
}

/// Every stage on its own thread, chained by channels: stage k works on chunk i while stage k-1 works on chunk i+1.
/// The first failure travels down the chain and stops it; upstream threads stop at their next hand-off.
fn pipelined(stages: &mut [Stage], jobs: Vec<Job>, c: &PassCtx) -> Result<Vec<Job>, Fail> {
    let n_stages = stages.len();
    let n_jobs = jobs.len();
    std::thread::scope(|sc| {
        let (first_tx, mut rx) = mpsc::channel::<Result<Job, Fail>>();
        for (i, stage) in stages.iter_mut().enumerate() {
            let (tx, next_rx) = mpsc::channel();
            let input = std::mem::replace(&mut rx, next_rx);
            sc.spawn(move || {
                for item in input {
                    let item = item.and_then(|mut job| stage.call(&mut job, i + 1 == n_stages, c).map(|_| job));
                    let failed = item.is_err();
                    if tx.send(item).is_err() || failed {
                        break;
                    }
                }
            });
        }
        for j in jobs {
            let _ = first_tx.send(Ok(j));
        }
        drop(first_tx);
        let mut done = Vec::with_capacity(n_jobs);
        for item in rx {
            done.push(item?);
        }
        if done.len() != n_jobs {
            return Err(Fail::Err(anyhow!(
                "pipeline stopped after {} of {n_jobs} chunks",
                done.len()
            )));
        }
        Ok(done)
    })
}
