//! The scheduler: slots (each one Generator with its own KV, driven by its own thread), the nodes they belong to,
//! and a bounded queue of requests waiting for a slot. The HTTP side only submits jobs and reads events from a
//! channel; engine work never runs on the async runtime.

use super::metrics::{Gauges, Metrics};
use super::openai::ApiError;
use super::router::{self, NodeView, SlotView};
use super::status::{Finished, Status};
use super::stop::StopFilter;
use crate::chat::ThinkTags;
use crate::generate::GenParams;
use crate::generate::{Finish, Generator, Outcome, Piece, Prompt};
use anyhow::Result;
use axum::http::StatusCode;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a running job tells the HTTP side.
pub enum Event {
    /// Text safe to show (stop strings already filtered).
    Piece(Piece),
    Done {
        outcome: Outcome,
        stop_matched: bool,
    },
    /// Before the first piece: the HTTP status to answer with. After it: the stream ends with an error event.
    Error(ApiError),
    /// Before the first piece of a job that splits reasoning off: the model's think tags, and whether the rendered
    /// prompt leaves a think block open (the reply then starts inside it).
    Thinking {
        tags: ThinkTags,
        prompt_opens: bool,
    },
}

/// Builds (or rebuilds after a failure) the generator of one slot.
pub type Factory = Arc<dyn Fn() -> Result<Box<dyn Generator>> + Send + Sync>;

/// Where slots run: the local process, a pipeline, or one remote decode node (health-checked when `addr` is set).
pub struct NodeSpec {
    pub label: String,
    pub addr: Option<String>,
    pub slots: usize,
    pub factory: Factory,
    /// Its slots share a prefix cache on disk (`--kv-cache-dir`): the router counts the prefixes sent to it.
    pub disk_cache: bool,
}

pub struct Job {
    pub prompt: Prompt,
    /// `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub params: GenParams,
    pub stops: Vec<String>,
    /// Split the reply's think block off (a chat request whose reasoning format is not `none`): the slot tells the
    /// HTTP side the model's tags and whether the prompt opens the block ([`Event::Thinking`]).
    pub reasoning: bool,
    pub key: String,
    pub tx: UnboundedSender<Event>,
    pub arrived: Instant,
    /// Nodes this job already failed on.
    pub tried: Vec<usize>,
    pub last_error: Option<String>,
}

/// A slot's session saved to or restored from a file (`POST /slots/{id}?action=save|restore`).
pub enum SlotOp {
    Save(PathBuf),
    Restore(PathBuf),
}

/// What a slot's thread is handed: a request, or a session operation with where to answer (positions moved).
enum Work {
    /// Boxed: a job is large beside a session operation.
    Generate(Box<Job>),
    Session(SlotOp, mpsc::Sender<Result<usize>>),
}

struct SlotState {
    node: usize,
    busy: bool,
    key: String,
    last_used: u64,
    tx: mpsc::Sender<Work>,
    /// Why the slot serves no more (its generator crashed and could not be rebuilt). A dead slot stays `busy`, so
    /// the router never picks it, and `/health` reports it.
    dead: Option<String>,
}

struct NodeState {
    label: String,
    addr: Option<String>,
    up: bool,
    slots: usize,
    /// The keys sent to it, when it has a disk cache.
    disk: Option<router::DiskKeys>,
}

struct State {
    slots: Vec<SlotState>,
    nodes: Vec<NodeState>,
    queue: VecDeque<Job>,
    clock: u64,
}

/// When a slot whose generator could not be rebuilt is tried again: after `first`, then after twice as long each
/// time, at most `max` apart, for as long as the server runs (the cause, a file being replaced or memory short, is
/// often passing).
#[derive(Clone, Copy, Debug)]
pub struct Revive {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Revive {
    fn default() -> Self {
        Revive {
            first: Duration::from_secs(5),
            max: Duration::from_secs(300),
        }
    }
}

pub struct Scheduler {
    state: Mutex<State>,
    max_queue: usize,
    revive: Revive,
    pub metrics: Arc<Metrics>,
    /// Per-node rates and the last requests, for `/v1/cluster`.
    pub status: Arc<Status>,
}

/// How a job ended, for the worker's bookkeeping.
enum Ran {
    /// The text the slot's KV now holds (affinity key), and the closing event. The worker sends that event only
    /// after releasing the slot, so a client's next turn finds the slot free and holding its prefix.
    Done(String, Event),
    /// Failed before any piece reached the client: may be retried elsewhere.
    FailedEarly(anyhow::Error),
    /// Failed after pieces were sent (the error event is already out) or was refused.
    Over,
}

impl Scheduler {
    /// Starts one thread per slot. `max_queue` requests may wait beyond the busy slots.
    pub fn start(
        nodes: Vec<NodeSpec>,
        max_queue: usize,
        revive: Revive,
        metrics: Arc<Metrics>,
        status: Arc<Status>,
    ) -> Arc<Scheduler> {
        let sched = Arc::new(Scheduler {
            revive,
            state: Mutex::new(State {
                slots: Vec::new(),
                nodes: Vec::new(),
                queue: VecDeque::new(),
                clock: 0,
            }),
            max_queue,
            metrics,
            status,
        });
        let mut st = sched.state.lock().unwrap();
        for (ni, n) in nodes.into_iter().enumerate() {
            for k in 0..n.slots {
                let (tx, rx) = mpsc::channel::<Work>();
                let idx = st.slots.len();
                st.slots.push(SlotState {
                    node: ni,
                    busy: false,
                    key: String::new(),
                    last_used: 0,
                    tx,
                    dead: None,
                });
                let s = sched.clone();
                let factory = n.factory.clone();
                let remote = n.addr.is_some();
                let label = n.label.clone();
                std::thread::Builder::new()
                    .name(format!("slot-{}-{k}", n.label))
                    .spawn(move || worker(s, idx, ni, label, remote, factory, rx))
                    .expect("spawn slot thread");
            }
            st.nodes.push(NodeState {
                label: n.label,
                addr: n.addr,
                up: true,
                slots: n.slots,
                disk: n.disk_cache.then(router::DiskKeys::default),
            });
        }
        drop(st);
        sched
    }

    /// Queues a job, or refuses it: 429 when the queue is full, 503 when no node is up.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let mut st = self.state.lock().unwrap();
        if !st.nodes.iter().any(|n| n.up) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no node is up to serve the request",
            ));
        }
        if !(0..st.nodes.len()).any(|ni| usable(&st, ni)) {
            return Err(no_live_slot());
        }
        let free = st.slots.iter().any(|s| !s.busy && st.nodes[s.node].up);
        if !free && st.queue.len() >= self.max_queue {
            self.metrics.rejected.inc();
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the server is busy ({} requests queued); retry later", st.queue.len()),
            )
            .code("queue_full"));
        }
        st.queue.push_back(job);
        self.dispatch(&mut st);
        Ok(())
    }

    /// Hands queued jobs to free slots (router policy), drops jobs whose client left, fails jobs no node can take.
    fn dispatch(&self, st: &mut State) {
        let mut i = 0;
        while i < st.queue.len() {
            let job = &st.queue[i];
            if job.tx.is_closed() {
                st.queue.remove(i);
                self.metrics.cancelled.inc();
                continue;
            }
            if !(0..st.nodes.len()).any(|ni| usable(st, ni) && !job.tried.contains(&ni)) {
                let job = st.queue.remove(i).unwrap();
                if !(0..st.nodes.len()).any(|ni| usable(st, ni)) && st.nodes.iter().any(|n| n.up) {
                    let _ = job.tx.send(Event::Error(no_live_slot()));
                    continue;
                }
                let why = job.last_error.as_deref().unwrap_or("every node is down");
                let _ = job.tx.send(Event::Error(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("no node could serve the request: {why}"),
                )));
                continue;
            }
            let views: Vec<SlotView> = st
                .slots
                .iter()
                .map(|s| SlotView {
                    node: s.node,
                    busy: s.busy,
                    key: &s.key,
                    last_used: s.last_used,
                })
                .collect();
            let nodes = node_views(st, &job.key);
            let Some((si, why, _)) = router::pick(&views, &nodes, &job.key, &job.tried) else {
                i += 1;
                continue;
            };
            let job = st.queue.remove(i).unwrap();
            st.clock += 1;
            let clock = st.clock;
            let ni = st.slots[si].node;
            if let Some(d) = &mut st.nodes[ni].disk {
                d.add(&job.key);
            }
            let slot = &mut st.slots[si];
            slot.busy = true;
            slot.last_used = clock;
            self.metrics.route(&st.nodes[slot.node].label, why.name());
            if let Err(mpsc::SendError(Work::Generate(job))) = slot.tx.send(Work::Generate(Box::new(job))) {
                // The slot's thread is gone (panics are caught in it, so this should not happen): never use it
                // again, and give the job back to the queue for the other slots.
                tracing::error!("serve: slot {si} is out of service: its thread has exited");
                slot.dead = Some(format!("slot {si}: its thread has exited"));
                st.queue.insert(i, *job);
            }
        }
    }

    /// Runs `op` on slot `slot` once it is free of requests (409 while it serves one); the receiver gets the
    /// outcome. The slot takes no request meanwhile.
    pub fn slot_op(&self, slot: usize, op: SlotOp) -> Result<mpsc::Receiver<Result<usize>>, ApiError> {
        let mut st = self.state.lock().unwrap();
        let n = st.slots.len();
        let Some(s) = st.slots.get_mut(slot) else {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no slot {slot}: this server has slots 0 to {}", n - 1),
            ));
        };
        if let Some(why) = &s.dead {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("slot {slot} is out of service: {why}"),
            ));
        }
        if s.busy {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("slot {slot} is serving a request; retry when it ends"),
            ));
        }
        let (tx, rx) = mpsc::channel();
        if s.tx.send(Work::Session(op, tx)).is_err() {
            return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "slot thread died"));
        }
        s.busy = true;
        Ok(rx)
    }

    /// A slot finished its job; `key` is the text its KV now holds.
    fn release(&self, slot: usize, key: String, retry: Option<Job>) {
        let mut st = self.state.lock().unwrap();
        st.slots[slot].busy = false;
        st.slots[slot].key = key;
        if let Some(job) = retry {
            self.metrics.retries.inc();
            st.queue.push_front(job);
        }
        self.dispatch(&mut st);
    }

    /// Takes a slot whose generator could not be rebuilt out of service until a later rebuild succeeds
    /// ([`Revive`]), and hands the queue to the others (or refuses it when none is left).
    fn retire(&self, slot: usize, why: String) {
        let mut st = self.state.lock().unwrap();
        tracing::error!("serve: slot {slot} is out of service: {why}");
        let s = &mut st.slots[slot];
        s.busy = true;
        s.key.clear();
        s.dead = Some(why);
        self.dispatch(&mut st);
    }

    /// A retired slot whose generator was rebuilt serves again.
    fn revived(&self, slot: usize) {
        let mut st = self.state.lock().unwrap();
        tracing::info!("serve: slot {slot} is back in service: its generator was rebuilt");
        let s = &mut st.slots[slot];
        s.dead = None;
        s.busy = false;
        self.dispatch(&mut st);
    }

    fn slot_key(&self, slot: usize) -> String {
        self.state.lock().unwrap().slots[slot].key.clone()
    }

    fn set_up(&self, node: usize, up: bool, why: &str) {
        let mut st = self.state.lock().unwrap();
        if st.nodes[node].up != up {
            let label = &st.nodes[node].label;
            if up {
                tracing::info!("serve: node {label} is back up");
            } else {
                tracing::warn!("serve: node {label} is down: {why}");
            }
            st.nodes[node].up = up;
            if !up {
                // Its sessions' KV may be gone: forget what the slots held.
                for s in st.slots.iter_mut().filter(|s| s.node == node) {
                    s.key.clear();
                }
            }
        }
        self.dispatch(&mut st);
    }

    /// Checks every remote node once per `every`: a TCP connect within a second means it answers.
    pub fn health_loop(self: Arc<Self>, every: Duration) {
        let addrs: Vec<(usize, String)> = {
            let st = self.state.lock().unwrap();
            st.nodes
                .iter()
                .enumerate()
                .filter_map(|(i, n)| n.addr.clone().map(|a| (i, a)))
                .collect()
        };
        if addrs.is_empty() {
            return;
        }
        let res = crate::cluster::health::spawn_loop("health", addrs, every, move |i, r| {
            match r {
                Ok(()) => self.set_up(i, true, ""),
                Err(e) => self.set_up(i, false, &format!("{e:#}")),
            }
            true
        });
        if let Err(e) = res {
            tracing::error!("cannot start the node health checks: {e:#}");
        }
    }

    pub fn gauges(&self) -> Gauges {
        let st = self.state.lock().unwrap();
        let nodes = node_views(&st, "");
        Gauges {
            queue_depth: st.queue.len(),
            slots: st.slots.len(),
            busy: st.slots.iter().filter(|s| s.busy && s.dead.is_none()).count(),
            dead: st.slots.iter().filter_map(|s| s.dead.clone()).collect(),
            nodes: st
                .nodes
                .iter()
                .zip(nodes)
                .map(|(n, v)| (n.label.clone(), n.up, v.busy, n.slots))
                .collect(),
        }
    }
}

/// Whether node `ni` can take work: up, with a slot still in service.
fn usable(st: &State, ni: usize) -> bool {
    st.nodes[ni].up && st.slots.iter().any(|s| s.node == ni && s.dead.is_none())
}

fn no_live_slot() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "no slot can serve the request: every slot crashed and could not be restarted (see /health)",
    )
}

/// What the request that hit a crash is told: no panic text or Rust internals (the server's log has those).
const CRASHED: &str = "the generator crashed while serving this request (an internal error, logged on the server)";

/// The nodes as the router sees them for a request of `key`.
fn node_views(st: &State, key: &str) -> Vec<NodeView> {
    let mut v: Vec<NodeView> = st
        .nodes
        .iter()
        .map(|n| NodeView {
            up: n.up,
            busy: 0,
            slots: n.slots,
            disk_prefix: n.disk.as_ref().map_or(0, |d| d.prefix(key)),
        })
        .collect();
    for s in st.slots.iter().filter(|s| s.busy) {
        v[s.node].busy += 1;
    }
    v
}

/// One slot's thread: runs its jobs one after another on its own generator.
fn worker(
    sched: Arc<Scheduler>,
    slot: usize,
    node: usize,
    label: String,
    remote: bool,
    factory: Factory,
    rx: mpsc::Receiver<Work>,
) {
    let mut generator: Option<Box<dyn Generator>> = None;
    // A panic in the generator is caught per job so the slot (and the requests queued for it) survive it.
    for work in rx {
        let mut job = match work {
            Work::Generate(job) => *job,
            Work::Session(op, reply) => {
                match catch_unwind(AssertUnwindSafe(|| session_op(&mut generator, &factory, &op))) {
                    Ok((res, keep_key)) => {
                        let key = if keep_key { sched.slot_key(slot) } else { String::new() };
                        // Free the slot before answering, so a client's next call never finds it still busy (409).
                        sched.release(slot, key, None);
                        let _ = reply.send(res);
                    }
                    Err(_) => {
                        let restarted = restart(&sched, &mut generator, &factory, slot, node, &label, remote);
                        let _ = reply.send(Err(anyhow::anyhow!("{CRASHED}")));
                        if !restarted {
                            revive(&sched, &mut generator, &factory, slot);
                        }
                    }
                }
                continue;
            }
        };
        let _span = crate::logging::request_span(&job.params.request_id).entered();
        let ran = match catch_unwind(AssertUnwindSafe(|| {
            run_job(&mut generator, &factory, &job, &sched, (node, &label))
        })) {
            Ok(ran) => ran,
            Err(_) => {
                // Restart (or retire) the slot before answering, so a client that retries at once finds it ready.
                let restarted = restart(&sched, &mut generator, &factory, slot, node, &label, remote);
                let _ = job
                    .tx
                    .send(Event::Error(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, CRASHED)));
                if !restarted {
                    revive(&sched, &mut generator, &factory, slot);
                }
                continue;
            }
        };
        match ran {
            Ran::Done(key, last) => {
                if let Event::Done { outcome: o, .. } = &last {
                    tracing::info!(
                        "serve: slot {slot} on {label}: {} prompt tokens ({} cached), {} generated, first token in \
                         {:.0} ms",
                        o.prompt_tokens,
                        o.cached_tokens,
                        o.completion_tokens,
                        o.t_prompt.as_secs_f64() * 1e3
                    );
                    sched.metrics.node_speed(&label, o.completion_tokens, o.t_gen);
                }
                sched.release(slot, key, None);
                let _ = job.tx.send(last);
            }
            Ran::Over => sched.release(slot, String::new(), None),
            Ran::FailedEarly(e) => {
                generator = None;
                let msg = format!("{label}: {e:#}");
                tracing::warn!("serve: request failed before its first token on {msg}");
                if remote {
                    // Take the node out until the health check sees it again, and retry elsewhere.
                    sched.set_up(node, false, &msg);
                    job.tried.push(node);
                    job.last_error = Some(msg);
                    sched.release(slot, String::new(), Some(job));
                } else {
                    let _ = job
                        .tx
                        .send(Event::Error(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg)));
                    sched.release(slot, String::new(), None);
                }
            }
        }
    }
}

/// After a panic the slot's generator is poisoned: it may have stopped halfway through updating its KV, positions
/// or a batch, so it is dropped and a fresh one built from the factory. Then the slot is free again (`true`). When
/// the rebuild fails, a local slot is retired (`/health` fails and names it) and `false` tells the worker to
/// [`revive`] it; a remote slot's node is marked down instead, to be rebuilt when its health check passes again.
fn restart(
    sched: &Scheduler,
    generator: &mut Option<Box<dyn Generator>>,
    factory: &Factory,
    slot: usize,
    node: usize,
    label: &str,
    remote: bool,
) -> bool {
    tracing::error!("serve: the generator of slot {slot} on {label} crashed; rebuilding it");
    let old = generator.take();
    // Its destructor runs on the same broken state and may panic too.
    if catch_unwind(AssertUnwindSafe(move || drop(old))).is_err() {
        tracing::error!("serve: dropping the crashed generator of slot {slot} panicked as well");
    }
    let why = match catch_unwind(AssertUnwindSafe(|| factory())) {
        Ok(Ok(g)) => {
            *generator = Some(g);
            sched.release(slot, String::new(), None);
            return true;
        }
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => "building its generator panicked".to_string(),
    };
    let why = format!(
        "slot {slot} on {label} crashed and could not be restarted: {why} (tried again in {:.0} s, then at growing \
         intervals)",
        sched.revive.first.as_secs_f64()
    );
    if remote {
        sched.set_up(node, false, &why);
        sched.release(slot, String::new(), None);
        return true;
    }
    sched.retire(slot, why);
    false
}

/// Rebuilds a retired slot's generator after the [`Revive`] delays, doubling, until it succeeds; then the slot
/// serves again. Its thread takes no work meanwhile (the router sends a dead slot none).
fn revive(sched: &Scheduler, generator: &mut Option<Box<dyn Generator>>, factory: &Factory, slot: usize) {
    let mut wait = sched.revive.first;
    for attempt in 1u64.. {
        std::thread::sleep(wait);
        match catch_unwind(AssertUnwindSafe(|| factory())) {
            Ok(Ok(g)) => {
                *generator = Some(g);
                sched.revived(slot);
                return;
            }
            Ok(Err(e)) => tracing::warn!("serve: slot {slot}: rebuild {attempt} failed: {e:#}"),
            Err(_) => tracing::warn!("serve: slot {slot}: rebuild {attempt} panicked"),
        }
        wait = (wait * 2).min(sched.revive.max);
    }
}

/// Saves or restores the slot's session; also says whether the slot still holds what its affinity key names.
fn session_op(generator: &mut Option<Box<dyn Generator>>, factory: &Factory, op: &SlotOp) -> (Result<usize>, bool) {
    let g = match built(generator, factory) {
        Ok(g) => g,
        Err(e) => return (Err(e), false),
    };
    match op {
        SlotOp::Save(path) => (g.save_session(path), true),
        SlotOp::Restore(path) => (g.load_session(path), false),
    }
}

/// The slot's generator, built by `factory` when it has none (first use, or rebuilt after a failure).
fn built<'a>(generator: &'a mut Option<Box<dyn Generator>>, factory: &Factory) -> Result<&'a mut Box<dyn Generator>> {
    if generator.is_none() {
        *generator = Some(factory()?);
    }
    Ok(generator.as_mut().unwrap())
}

/// Runs one job on the slot's generator; `at` is the scheduler node (index, label) the slot belongs to.
fn run_job(
    generator: &mut Option<Box<dyn Generator>>,
    factory: &Factory,
    job: &Job,
    sched: &Scheduler,
    at: (usize, &str),
) -> Ran {
    let (m, status) = (&*sched.metrics, &*sched.status);
    let started = Instant::now();
    super::status::job_starts(at.1);
    let g = match built(generator, factory) {
        Ok(g) => g,
        Err(e) => return Ran::FailedEarly(e),
    };
    // Validation that needs the tokenizer: the prompt and max_tokens against the context.
    let n_ctx = g.n_ctx();
    let param = match job.prompt {
        Prompt::Text(_) => "prompt",
        _ => "messages",
    };
    if job.params.constraint.is_some() && !g.constrains() {
        let _ = job.tx.send(Event::Error(ApiError::bad(
            "response_format",
            format!(
                "constrained output (response_format, or tool_choice \"required\" or a named function) needs every \
                 token sampled here with one vocabulary; this server runs {}, which cannot apply it",
                g.describe()
            ),
        )));
        return Ran::Over;
    }
    let n_prompt = match g.count_prompt(&job.prompt) {
        Ok(n) => n,
        Err(e) => {
            let _ = job.tx.send(Event::Error(ApiError::bad(param, format!("{e:#}"))));
            return Ran::Over;
        }
    };
    if n_prompt >= n_ctx {
        let _ = job.tx.send(Event::Error(
            ApiError::bad(
                param,
                format!("the prompt is {n_prompt} tokens; this model's context is {n_ctx} tokens"),
            )
            .code("context_length_exceeded"),
        ));
        return Ran::Over;
    }
    let room = n_ctx - n_prompt;
    let max_tokens = match job.max_tokens {
        Some(m) if m > room => {
            let _ = job.tx.send(Event::Error(
                ApiError::bad(
                    "max_tokens",
                    format!(
                        "this model's context is {n_ctx} tokens; the prompt takes {n_prompt} and max_tokens asks \
                         for {m} more"
                    ),
                )
                .code("context_length_exceeded"),
            ));
            return Ran::Over;
        }
        Some(m) => m,
        None => room,
    };
    let mut params = job.params.clone();
    params.max_tokens = max_tokens;
    if job.reasoning {
        let text = g.text();
        match text.prompt_opens_think(&job.prompt) {
            Ok(prompt_opens) => {
                let tags = text.think.clone();
                let _ = job.tx.send(Event::Thinking { tags, prompt_opens });
            }
            Err(e) => {
                let _ = job.tx.send(Event::Error(ApiError::bad(param, format!("{e:#}"))));
                return Ran::Over;
            }
        }
    }

    let mut filter = StopFilter::new(job.stops.clone());
    let mut generated = String::new();
    let mut sent = 0usize;
    let mut last = None::<Instant>;
    let mut first = None::<Instant>;
    let mut gone = false;
    let tx = &job.tx;
    let emit = |p: Piece, sent: &mut usize, last: &mut Option<Instant>, first: &mut Option<Instant>| -> bool {
        let now = Instant::now();
        match last {
            None => {
                m.ttft(now - job.arrived);
                *first = Some(now);
            }
            Some(t) => m.inter_token(now - *t),
        }
        *last = Some(now);
        status.tokens(at.0, 1);
        *sent += 1;
        tx.send(Event::Piece(p)).is_ok()
    };
    let r = g.generate(&job.prompt, &params, &mut |p: &Piece| {
        generated.push_str(&p.text);
        if tx.is_closed() {
            gone = true;
            return false;
        }
        for out in filter.push(p.clone()) {
            if !emit(out, &mut sent, &mut last, &mut first) {
                gone = true;
                return false;
            }
        }
        !filter.matched()
    });
    // The request as the cluster view keeps it: its first and last tokens' times, [prompt, cached, completion]
    // tokens, prefill time, how it ended.
    let record = |(first, last), [prompt_tokens, cached_tokens, completion_tokens]: [usize; 3], t_prompt, finish| {
        let f = Finished {
            arrived: job.arrived,
            started,
            first,
            last,
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            t_prompt,
            finish,
        };
        status.finished(at.0, at.1, f)
    };
    match r {
        Ok(outcome) => {
            if gone {
                m.cancelled.inc();
            }
            for out in filter.finish() {
                emit(out, &mut sent, &mut last, &mut first);
            }
            m.prompt_tokens.inc_by(outcome.prompt_tokens as u64);
            m.cached_tokens.inc_by(outcome.cached_tokens as u64);
            m.completion_tokens.inc_by(outcome.completion_tokens as u64);
            let stop_matched = filter.matched();
            let cancelled = gone || (outcome.finish == Finish::Stopped && !stop_matched);
            let finish = match outcome.finish {
                _ if cancelled => "cancelled",
                Finish::Eog | Finish::Stopped => "stop",
                Finish::Length | Finish::ContextFull => "length",
            };
            record(
                (first, last),
                [outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens],
                Some(outcome.t_prompt),
                finish,
            );
            let last = Event::Done { outcome, stop_matched };
            if cancelled {
                // The KV holds the prompt and part of a reply nobody saw: keep the prompt as the key.
                Ran::Done(job.key.clone(), last)
            } else {
                Ran::Done(format!("{}{generated}", job.key), last)
            }
        }
        Err(e) if sent == 0 => Ran::FailedEarly(e),
        Err(e) => {
            *generator = None;
            record((first, last), [n_prompt, 0, sent], None, "error");
            let _ = tx.send(Event::Error(ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("generation failed after {sent} pieces: {e:#}"),
            )));
            Ran::Over
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::generate::TextModel;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

    /// Every wait in these tests ends within this.
    const WAIT: Duration = Duration::from_secs(10);

    /// The generated tiny llama's tokenizer and template (tests/models, committed), for what the queue reads of a
    /// generator's text model; the fake itself counts every prompt as one token.
    fn fake_text() -> &'static TextModel {
        static TEXT: std::sync::OnceLock<TextModel> = std::sync::OnceLock::new();
        TEXT.get_or_init(|| {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/llama3.gguf");
            TextModel::open(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()))
        })
    }

    /// A stand-in generator: panics on the prompt "boom"; on "break" it also makes the factory's next build fail
    /// (so exactly the crashed slot's restart fails); otherwise answers "ok". Holds the count of builds to fail.
    struct Fake(Arc<AtomicUsize>);

    impl Generator for Fake {
        fn describe(&self) -> String {
            "fake".into()
        }
        fn n_ctx(&self) -> usize {
            64
        }
        fn text(&self) -> &TextModel {
            fake_text()
        }
        fn count_prompt(&self, _prompt: &Prompt) -> Result<usize> {
            Ok(1)
        }
        fn generate(
            &mut self,
            prompt: &Prompt,
            _: &GenParams,
            sink: &mut dyn FnMut(&Piece) -> bool,
        ) -> Result<Outcome> {
            if let Prompt::Text(t) = prompt {
                if t == "break" {
                    self.0.store(1, Ordering::SeqCst);
                }
                if t == "boom" || t == "break" {
                    panic!("fake generator crash");
                }
            }
            sink(&Piece {
                text: "ok".into(),
                token: None,
                logprob: None,
                top: Vec::new(),
            });
            Ok(Outcome {
                prompt_tokens: 1,
                cached_tokens: 0,
                completion_tokens: 1,
                finish: Finish::Length,
                t_prompt: Duration::ZERO,
                t_gen: Duration::ZERO,
                detail: Vec::new(),
            })
        }
    }

    /// A scheduler with one local node of `slots` fake slots; a dead slot is not tried again within a test.
    pub(crate) fn fake_scheduler(slots: usize) -> Arc<Scheduler> {
        let hour = Duration::from_secs(3600);
        fake_scheduler_with(slots, Arc::new(AtomicUsize::new(0)), Revive { first: hour, max: hour })
    }

    /// A scheduler with one local node of `slots` fake slots whose next `fails` builds fail.
    fn fake_scheduler_with(slots: usize, fails: Arc<AtomicUsize>, revive: Revive) -> Arc<Scheduler> {
        let factory: Factory = Arc::new(move || {
            if fails
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                anyhow::bail!("the model file is gone");
            }
            Ok(Box::new(Fake(fails.clone())) as Box<dyn Generator>)
        });
        let node = NodeSpec {
            label: "local".into(),
            addr: None,
            slots,
            factory,
            disk_cache: false,
        };
        Scheduler::start(
            vec![node],
            8,
            revive,
            Arc::new(Metrics::default()),
            Arc::new(Status::new()),
        )
    }

    pub(crate) fn submit(s: &Scheduler, prompt: &str) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (tx, rx) = unbounded_channel();
        s.submit(Job {
            prompt: Prompt::Text(prompt.into()),
            max_tokens: Some(4),
            params: GenParams::default(),
            stops: Vec::new(),
            reasoning: false,
            key: prompt.into(),
            tx,
            arrived: Instant::now(),
            tried: Vec::new(),
            last_error: None,
        })?;
        Ok(rx)
    }

    /// The first event, or a panic naming what hung.
    pub(crate) async fn first(rx: &mut UnboundedReceiver<Event>, what: &str) -> Option<Event> {
        tokio::time::timeout(WAIT, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer within {WAIT:?}"))
    }

    pub(crate) async fn answered(rx: &mut UnboundedReceiver<Event>, what: &str) {
        match first(rx, what).await {
            Some(Event::Piece(p)) => assert_eq!(p.text, "ok", "{what}"),
            Some(Event::Error(e)) => panic!("{what}: error {} {}", e.status, e.message),
            Some(Event::Done { .. }) => panic!("{what}: done without text"),
            Some(Event::Thinking { .. }) => panic!("{what}: think tags for a text prompt"),
            None => panic!("{what}: channel closed without an answer"),
        }
        assert!(
            matches!(first(rx, what).await, Some(Event::Done { .. })),
            "{what}: no Done after the text"
        );
    }

    /// The request that hit a panic gets a 500 that says what happened without Rust internals.
    pub(crate) async fn crashed(rx: &mut UnboundedReceiver<Event>) {
        match first(rx, "the panicking request").await {
            Some(Event::Error(e)) => {
                assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
                assert!(e.message.contains("crashed"), "{}", e.message);
                assert!(!e.message.contains("panick"), "{}", e.message);
                assert!(!e.message.contains("fake generator crash"), "{}", e.message);
            }
            Some(_) => panic!("the panicking request got an answer"),
            None => panic!("the panicking request's channel closed without an error"),
        }
    }

    #[tokio::test]
    async fn a_panicking_slot_is_restarted_and_serves_the_queue() {
        let s = fake_scheduler(1);
        let mut boom = submit(&s, "boom").unwrap();
        // Queued behind the crash on the only slot.
        let mut a = submit(&s, "a").unwrap();
        let mut b = submit(&s, "b").unwrap();
        // The queued requests are checked first so that a slot left dead shows as the hang it would be.
        answered(&mut a, "first request queued behind the panic").await;
        answered(&mut b, "second request queued behind the panic").await;
        crashed(&mut boom).await;
        // The slot keeps working, and crashes again cleanly.
        let mut boom = submit(&s, "boom").unwrap();
        crashed(&mut boom).await;
        answered(&mut submit(&s, "c").unwrap(), "a later request").await;
        let g = s.gauges();
        assert!(g.dead.is_empty(), "{:?}", g.dead);
        assert_eq!(g.busy, 0);
    }

    #[tokio::test]
    async fn a_slot_that_cannot_restart_is_taken_out_and_others_serve() {
        let s = fake_scheduler(2);
        let mut boom = submit(&s, "break").unwrap();
        crashed(&mut boom).await;
        for i in 0..3 {
            answered(
                &mut submit(&s, "z").unwrap(),
                &format!("request {i} after the slot died"),
            )
            .await;
        }
        let g = s.gauges();
        assert_eq!(g.dead.len(), 1, "{:?}", g.dead);
        assert!(g.dead[0].contains("the model file is gone"), "{:?}", g.dead);
    }

    #[tokio::test]
    async fn a_dead_slot_is_rebuilt_later_and_serves_again() {
        // The restart after the crash and the next two rebuilds fail; the third, 50 + 100 + 200 ms later, works.
        let fails = Arc::new(AtomicUsize::new(0));
        let revive = Revive {
            first: Duration::from_millis(50),
            max: Duration::from_millis(200),
        };
        let s = fake_scheduler_with(1, fails.clone(), revive);
        answered(&mut submit(&s, "a").unwrap(), "a request before the crash").await;
        fails.store(3, Ordering::SeqCst);
        crashed(&mut submit(&s, "boom").unwrap()).await;
        let dead = s.gauges().dead;
        assert_eq!(dead.len(), 1, "{dead:?}");
        assert!(dead[0].contains("tried again"), "{dead:?}");
        let t0 = Instant::now();
        while !s.gauges().dead.is_empty() {
            assert!(t0.elapsed() < WAIT, "the slot was not rebuilt: {:?}", s.gauges().dead);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(t0.elapsed() >= Duration::from_millis(300), "rebuilt without waiting");
        assert_eq!(fails.load(Ordering::SeqCst), 0, "not every failed rebuild was tried");
        answered(&mut submit(&s, "b").unwrap(), "a request after the slot came back").await;
        assert_eq!(s.gauges().busy, 0);
    }

    #[tokio::test]
    async fn no_live_slot_refuses_instead_of_queueing() {
        let s = fake_scheduler(1);
        let mut boom = submit(&s, "break").unwrap();
        crashed(&mut boom).await;
        // Either refused at once or answered with an error: never left waiting.
        match submit(&s, "a") {
            Err(e) => assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE, "{}", e.message),
            Ok(mut rx) => match first(&mut rx, "a request with no live slot").await {
                Some(Event::Error(e)) => assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE, "{}", e.message),
                _ => panic!("a request with no live slot got no 503"),
            },
        }
    }
}
