//! What the cluster looks like and what it is doing, for `GET /v1/cluster`, the web page and `baton cluster status`:
//! every node with its role, the links between them, and the last requests with where they ran.
//!
//! Nodes and links are registered once while the server builds its topology, from its own configuration, so no
//! client input ever names one. The hot path (a token, a request's end) touches atomics and one short lock per
//! request; the request list is a bounded ring.

use super::metrics::Gauges;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

/// Requests kept for the view; older ones fall off.
pub const RECENT: usize = 32;
/// Seconds over which live rates are averaged.
const WINDOW: u64 = 5;
/// Per-second buckets kept (the window plus the second being filled and slack for late readers).
const BUCKETS: usize = WINDOW as usize + 3;

/// Events per second over the last [`WINDOW`] seconds, counted in per-second atomic buckets (no lock per token).
pub struct Rate {
    start: Instant,
    /// (second since `start`, count in that second).
    buckets: [(AtomicU64, AtomicU64); BUCKETS],
}

impl Default for Rate {
    fn default() -> Self {
        Rate {
            start: Instant::now(),
            buckets: std::array::from_fn(|_| (AtomicU64::new(u64::MAX), AtomicU64::new(0))),
        }
    }
}

impl Rate {
    pub fn add(&self, n: u64) {
        let s = self.start.elapsed().as_secs();
        let b = &self.buckets[s as usize % BUCKETS];
        // A racing reset may lose a few counts of one second: a display figure, not an account.
        if b.0.swap(s, Ordering::Relaxed) != s {
            b.1.store(0, Ordering::Relaxed);
        }
        b.1.fetch_add(n, Ordering::Relaxed);
    }

    /// Average per second over the last whole seconds of the window (the current, partial one left out).
    pub fn per_sec(&self) -> f64 {
        let now = self.start.elapsed().as_secs();
        let lo = now.saturating_sub(WINDOW);
        let n: u64 = self
            .buckets
            .iter()
            .filter(|b| {
                let s = b.0.load(Ordering::Relaxed);
                (lo..now).contains(&s)
            })
            .map(|b| b.1.load(Ordering::Relaxed))
            .sum();
        n as f64 / (now - lo).max(1) as f64
    }
}

/// What a node does in the topology (labels from a fixed set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The whole model in the server process.
    Local,
    /// A pipeline stage (its layer range in `layers`).
    Stage,
    Prefill,
    Decode,
    /// The target model of a speculative pair (the server).
    Target,
    Draft,
    /// A member of an ensemble served as one model.
    Member,
}

/// One node as the server registers it.
struct Node {
    name: String,
    role: Role,
    addr: Option<String>,
    layers: Option<String>,
    /// Scheduler node whose slots run on it (busy/slots/health and generated tokens come from there).
    sched: Option<usize>,
    /// Health probed by [`Status::health_loop`] (nodes no scheduler or pool checks).
    probed: Option<AtomicBool>,
    tokens: Rate,
    tokens_total: AtomicU64,
}

/// One link as the server registers it: traffic between `a` and `b`, metered under `peer`.
struct Link {
    a: String,
    b: String,
    /// Bytes reported with this key (a stage's or prefill node's address or name) count on this link.
    key: String,
    sent: AtomicU64,
    recv: AtomicU64,
    rate: Rate,
    /// Time spent waiting on the link (wall time of its calls less the peer's compute), for its throughput.
    wire_ns: AtomicU64,
}

#[derive(Default)]
struct Layout {
    nodes: Vec<Node>,
    links: Vec<Link>,
}

/// The server's view of its cluster; one per `baton serve`.
pub struct Status {
    started: Instant,
    layout: RwLock<Layout>,
    recent: Mutex<VecDeque<RequestView>>,
    next_id: AtomicU64,
}

// --- The JSON of `GET /v1/cluster` (also what `baton cluster status` reads). ---

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterView {
    pub model: String,
    /// What runs where, in one line.
    pub generator: String,
    pub uptime_s: f64,
    /// Requests waiting for a free slot.
    pub queued: usize,
    pub nodes: Vec<NodeView>,
    pub links: Vec<LinkView>,
    /// The last requests, newest first (at most [`RECENT`]).
    pub requests: Vec<RequestView>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    pub role: Role,
    /// `HOST:PORT`, or `None` for the server's own process.
    pub addr: Option<String>,
    /// Layer range `A:B` (B exclusive) of a pipeline stage.
    pub layers: Option<String>,
    /// `cpu` or `gpu: NAME`: the server's own process, or what a remote node (stage, decode or prefill node, draft,
    /// ensemble member) said in READY once this server opened a session on it (`None` before; see `ask_builds` for
    /// prefill nodes that only remote decode nodes use).
    pub backend: Option<String>,
    pub isa: Option<String>,
    /// `None` when nothing checks it.
    pub up: Option<bool>,
    /// Requests in flight on the node's slots, and how many slots it has.
    pub busy: usize,
    pub slots: usize,
    /// Tokens per second over the last seconds (generated; prompt tokens for a prefill node).
    pub tok_s: f64,
    pub tokens: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LinkView {
    pub a: String,
    pub b: String,
    /// Bytes from `a` to `b` and back, since the start.
    pub bytes_ab: u64,
    pub bytes_ba: u64,
    /// Both directions, per second over the last seconds.
    pub bytes_per_s: f64,
    /// Bytes moved per second of waiting on the link (where the server times it).
    pub throughput: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RequestView {
    /// Numbered by this server from 1.
    pub id: u64,
    /// Unix time of arrival, seconds.
    pub at: f64,
    pub prefill: String,
    pub decode: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Time to first token, split: waiting for a slot, prompt processing, the rest (setup, first sample, send).
    pub ttft_ms: Option<f64>,
    pub queue_ms: f64,
    pub prefill_ms: Option<f64>,
    pub first_token_ms: Option<f64>,
    /// Generated tokens per second after the first one.
    pub tok_s: Option<f64>,
    /// `stop`, `length`, `cancelled` or `error`.
    pub finish: String,
}

thread_local! {
    /// The prefill node a slot thread's current request used (set by the prefill pool's observer, which runs on the
    /// slot's thread), read when the request ends.
    static PREFILLED_ON: RefCell<Option<String>> = const { RefCell::new(None) };
    /// The node whose slot this thread is (its label), for the KV a prefill node sends it ([`Status::kv_pulled`]).
    static DECODES_ON: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Notes that this thread's current request was prefilled on `node` (a configured name).
pub fn prefilled_on(node: &str) {
    PREFILLED_ON.with(|p| *p.borrow_mut() = Some(node.to_string()));
}

/// Called as a slot of the node labelled `node` starts a job: forgets a prefill note left by a request that ended
/// before it was recorded, and notes where this thread decodes.
pub fn job_starts(node: &str) {
    PREFILLED_ON.with(|p| p.borrow_mut().take());
    DECODES_ON.with(|d| *d.borrow_mut() = Some(node.to_string()));
}

/// What a slot's worker knows of a request when it ends.
pub struct Finished {
    pub arrived: Instant,
    pub started: Instant,
    pub first: Option<Instant>,
    pub last: Option<Instant>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub t_prompt: Option<Duration>,
    pub finish: &'static str,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Default for Status {
    fn default() -> Self {
        Status::new()
    }
}

impl Status {
    pub fn new() -> Status {
        Status {
            started: Instant::now(),
            layout: RwLock::new(Layout::default()),
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
            next_id: AtomicU64::new(1),
        }
    }

    /// Registers a node. `sched`: the scheduler node whose slots run on it; `probe`: health-check its address here.
    pub fn add_node(
        &self,
        name: &str,
        role: Role,
        addr: Option<&str>,
        layers: Option<String>,
        sched: Option<usize>,
        probe: bool,
    ) {
        self.layout.write().unwrap().nodes.push(Node {
            name: name.to_string(),
            role,
            addr: addr.map(str::to_string),
            layers,
            sched,
            probed: (probe && addr.is_some()).then(|| AtomicBool::new(true)),
            tokens: Rate::default(),
            tokens_total: AtomicU64::new(0),
        });
    }

    /// Registers the link between nodes `a` and `b`; traffic reported under `key` counts on it (`a` sends).
    pub fn add_link(&self, a: &str, b: &str, key: &str) {
        let mut l = self.layout.write().unwrap();
        if l.links.iter().any(|x| x.key == key && x.a == a && x.b == b) {
            return;
        }
        l.links.push(Link {
            a: a.to_string(),
            b: b.to_string(),
            key: key.to_string(),
            sent: AtomicU64::new(0),
            recv: AtomicU64::new(0),
            rate: Rate::default(),
            wire_ns: AtomicU64::new(0),
        });
    }

    /// `n` tokens generated by a slot of scheduler node `sched`: they count on every node that computes for it.
    pub fn tokens(&self, sched: usize, n: u64) {
        for node in self
            .layout
            .read()
            .unwrap()
            .nodes
            .iter()
            .filter(|x| x.sched == Some(sched))
        {
            node.tokens.add(n);
            node.tokens_total.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// `n` prompt tokens prefilled on the node named `name`.
    pub fn prefilled(&self, name: &str, n: u64) {
        for node in self.layout.read().unwrap().nodes.iter().filter(|x| x.name == name) {
            node.tokens.add(n);
            node.tokens_total.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Bytes sent to and received from the peer metered as `key`, and the time spent waiting on it.
    pub fn wire(&self, key: &str, sent: u64, recv: u64, waited: Option<Duration>) {
        for l in self.layout.read().unwrap().links.iter().filter(|l| l.key == key) {
            l.sent.fetch_add(sent, Ordering::Relaxed);
            l.recv.fetch_add(recv, Ordering::Relaxed);
            l.rate.add(sent + recv);
            if let Some(w) = waited {
                l.wire_ns.fetch_add(w.as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }

    /// `bytes` of KV (and hidden rows) the prefill node named `prefill` streamed to the decode node this thread's
    /// slot belongs to ([`job_starts`]), over `streamed`: counted on the link between the two, whether the decode
    /// side is this server or a remote node (which tells its bytes in PULL_REPORT).
    pub fn kv_pulled(&self, prefill: &str, bytes: u64, streamed: Option<Duration>) {
        let Some(decode) = DECODES_ON.with(|d| d.borrow().clone()) else {
            return;
        };
        for l in self
            .layout
            .read()
            .unwrap()
            .links
            .iter()
            .filter(|l| l.a == prefill && l.b == decode)
        {
            l.sent.fetch_add(bytes, Ordering::Relaxed);
            l.rate.add(bytes);
            if let Some(w) = streamed {
                l.wire_ns.fetch_add(w.as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }

    /// Records a finished request (run on scheduler node `sched` labelled `node_label`).
    pub fn finished(&self, sched: usize, node_label: &str, f: Finished) {
        let prefill = PREFILLED_ON
            .with(|p| p.borrow_mut().take())
            .unwrap_or_else(|| self.runs_on(sched, node_label));
        let decode = self.runs_on(sched, node_label);
        let queue = f.started.saturating_duration_since(f.arrived);
        let ttft = f.first.map(|t| t.saturating_duration_since(f.arrived));
        let prefill_ms = f.t_prompt.map(ms);
        let first_token_ms = match (ttft, f.t_prompt) {
            (Some(t), Some(p)) => Some(ms(t.saturating_sub(queue).saturating_sub(p))),
            _ => None,
        };
        let tok_s = match (f.first, f.last) {
            (Some(a), Some(b)) if f.completion_tokens > 1 && b > a => {
                Some((f.completion_tokens - 1) as f64 / (b - a).as_secs_f64())
            }
            _ => None,
        };
        let at = std::time::SystemTime::now()
            .checked_sub(f.arrived.elapsed())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        let view = RequestView {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            at,
            prefill,
            decode,
            prompt_tokens: f.prompt_tokens,
            cached_tokens: f.cached_tokens,
            completion_tokens: f.completion_tokens,
            ttft_ms: ttft.map(ms),
            queue_ms: ms(queue),
            prefill_ms,
            first_token_ms,
            tok_s,
            finish: f.finish.to_string(),
        };
        let mut r = self.recent.lock().unwrap();
        if r.len() == RECENT {
            r.pop_back();
        }
        r.push_front(view);
    }

    /// The nodes computing for scheduler node `sched`, joined by `+` (a pipeline's stages), else its label.
    fn runs_on(&self, sched: usize, label: &str) -> String {
        let l = self.layout.read().unwrap();
        let names: Vec<&str> = l
            .nodes
            .iter()
            .filter(|n| n.sched == Some(sched) && n.role != Role::Draft && n.role != Role::Prefill)
            .map(|n| n.name.as_str())
            .collect();
        if names.is_empty() {
            label.to_string()
        } else {
            names.join("+")
        }
    }

    /// Probes the registered nodes that nothing else checks, once per `every`.
    pub fn health_loop(self: &std::sync::Arc<Self>, every: Duration) {
        let targets: Vec<(usize, String)> = {
            let l = self.layout.read().unwrap();
            l.nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.probed.is_some())
                .filter_map(|(i, n)| n.addr.clone().map(|a| (i, a)))
                .collect()
        };
        if targets.is_empty() {
            return;
        }
        let weak = std::sync::Arc::downgrade(self);
        let res = crate::cluster::health::spawn_loop("cluster-health", targets, every, move |i, r| {
            let Some(s) = weak.upgrade() else { return false };
            if let Some(up) = &s.layout.read().unwrap().nodes[i].probed {
                up.store(r.is_ok(), Ordering::Relaxed);
            }
            true
        });
        if let Err(e) = res {
            tracing::warn!("cannot start the cluster view's health checks: {e:#}");
        }
    }

    /// The view now, with the scheduler's gauges, the model id and the one-line description of the generator.
    pub fn view(&self, g: &Gauges, model: &str, generator: &str) -> ClusterView {
        let l = self.layout.read().unwrap();
        let here_backend = crate::engine::placement::Placement::process_label();
        let nodes = l
            .nodes
            .iter()
            .map(|n| {
                let sched = n.sched.and_then(|i| g.nodes.get(i));
                let in_process = n.addr.is_none();
                let up = if let Some(p) = &n.probed {
                    Some(p.load(Ordering::Relaxed))
                } else if in_process {
                    Some(true)
                } else {
                    sched.map(|s| s.1)
                };
                let (busy, slots) = match (n.role, sched) {
                    (Role::Prefill, _) | (Role::Draft, _) | (_, None) => (0, 0),
                    (_, Some(s)) => (s.2, s.3),
                };
                // A remote node's word (READY) once this process connected to it; escaped and bounded again here,
                // as any peer text.
                let clean = |s: &str| crate::util::printable(s, crate::cluster::wire::MAX_LABEL);
                let (backend, isa) = match n.addr.as_deref().map(crate::cluster::handshake::built) {
                    None => (here_backend.clone(), Some(crate::kernels::isa_label())),
                    Some(Some((b, i))) => (Some(clean(&b)), Some(clean(&i))),
                    Some(None) => (None, None),
                };
                NodeView {
                    name: n.name.clone(),
                    role: n.role,
                    addr: n.addr.clone(),
                    layers: n.layers.clone(),
                    backend,
                    isa,
                    up,
                    busy,
                    slots,
                    tok_s: n.tokens.per_sec(),
                    tokens: n.tokens_total.load(Ordering::Relaxed),
                }
            })
            .collect();
        let links = l
            .links
            .iter()
            .map(|k| {
                let (sent, recv) = (k.sent.load(Ordering::Relaxed), k.recv.load(Ordering::Relaxed));
                let wire = k.wire_ns.load(Ordering::Relaxed);
                LinkView {
                    a: k.a.clone(),
                    b: k.b.clone(),
                    bytes_ab: sent,
                    bytes_ba: recv,
                    bytes_per_s: k.rate.per_sec(),
                    throughput: (wire > 0).then(|| (sent + recv) as f64 / (wire as f64 * 1e-9)),
                }
            })
            .collect();
        ClusterView {
            model: model.to_string(),
            generator: generator.to_string(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            queued: g.queue_depth,
            nodes,
            links,
            requests: self.recent.lock().unwrap().iter().cloned().collect(),
        }
    }
}

/// `baton cluster status ADDR`: fetches `/v1/cluster` from a server (`HOST:PORT` or `http://HOST:PORT`), with the
/// API key as a Bearer token when given. Plain HTTP/1.1 on one connection: the CLI needs no HTTP client crate.
pub fn fetch(addr: &str, api_key: Option<&str>, timeout: Duration) -> anyhow::Result<ClusterView> {
    use anyhow::{Context, bail};
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let host = addr.strip_prefix("http://").unwrap_or(addr).trim_end_matches('/');
    if host.starts_with("https://") || host.contains('/') {
        bail!("{addr:?}: give HOST:PORT or http://HOST:PORT (no https, no path)");
    }
    let sa = host
        .to_socket_addrs()
        .with_context(|| format!("{host:?} is not HOST:PORT"))?
        .next()
        .with_context(|| format!("{host} resolves to no address"))?;
    let mut s =
        std::net::TcpStream::connect_timeout(&sa, timeout).with_context(|| format!("cannot connect to {host}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let auth = api_key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "GET /v1/cluster HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{auth}\r\n"
    )?;
    let mut raw = Vec::new();
    s.take(64 << 20).read_to_end(&mut raw).context("reading the answer")?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("not an HTTP answer")?;
    let code: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("not an HTTP answer")?;
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(body) } else { body.to_string() };
    if code != 200 {
        let why = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| body.chars().take(200).collect());
        bail!("{host} answered {code}: {why}");
    }
    serde_json::from_str(&body).with_context(|| format!("{host} sent no cluster view"))
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(len.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The view as text tables, for the terminal.
pub fn table(v: &ClusterView) -> String {
    use std::fmt::Write;
    let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    let num = |o: Option<f64>, unit: &str| o.map_or("-".into(), |x| format!("{x:.0}{unit}"));
    let mut o = String::new();
    let _ = writeln!(o, "model {}: {}", v.model, v.generator);
    let _ = writeln!(o, "up {:.0} s, {} queued\n", v.uptime_s, v.queued);
    let rows: Vec<Vec<String>> = v
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.name.clone(),
                format!("{:?}", n.role).to_lowercase(),
                opt(&n.layers),
                n.addr.clone().unwrap_or_else(|| "this server".into()),
                opt(&n.backend),
                opt(&n.isa),
                match n.up {
                    Some(true) => "up".into(),
                    Some(false) => "DOWN".into(),
                    None => "-".into(),
                },
                if n.slots > 0 {
                    format!("{}/{}", n.busy, n.slots)
                } else {
                    "-".into()
                },
                format!("{:.1}", n.tok_s),
                n.tokens.to_string(),
            ]
        })
        .collect();
    grid(
        &mut o,
        &[
            "NODE", "ROLE", "LAYERS", "ADDRESS", "BACKEND", "ISA", "HEALTH", "BUSY", "TOK/S", "TOKENS",
        ],
        &rows,
    );
    let rows: Vec<Vec<String>> = v
        .links
        .iter()
        .map(|l| {
            vec![
                format!("{} -> {}", l.a, l.b),
                l.bytes_ab.to_string(),
                l.bytes_ba.to_string(),
                format!("{:.0}", l.bytes_per_s),
                num(l.throughput, ""),
            ]
        })
        .collect();
    o.push('\n');
    grid(
        &mut o,
        &["LINK", "BYTES A->B", "BYTES B->A", "BYTES/S NOW", "MEASURED BYTES/S"],
        &rows,
    );
    let rows: Vec<Vec<String>> = v
        .requests
        .iter()
        .map(|r| {
            vec![
                r.id.to_string(),
                r.prefill.clone(),
                r.decode.clone(),
                r.prompt_tokens.to_string(),
                r.completion_tokens.to_string(),
                num(r.ttft_ms, " ms"),
                format!(
                    "{} / {} / {}",
                    num(Some(r.queue_ms), ""),
                    num(r.prefill_ms, ""),
                    num(r.first_token_ms, "")
                ),
                r.tok_s.map_or("-".into(), |t| format!("{t:.1}")),
                r.finish.clone(),
            ]
        })
        .collect();
    o.push('\n');
    grid(
        &mut o,
        &[
            "REQ",
            "PREFILL",
            "DECODE",
            "PROMPT",
            "REPLY",
            "TTFT",
            "QUEUE/PREFILL/FIRST MS",
            "TOK/S",
            "END",
        ],
        &rows,
    );
    o
}

/// Left-aligned columns as wide as their widest cell.
fn grid(o: &mut String, head: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let s: Vec<String> = cells.iter().zip(&w).map(|(c, w)| format!("{c:<w$}")).collect();
        s.join("  ").trim_end().to_string() + "\n"
    };
    o.push_str(&line(head.to_vec()));
    for r in rows {
        o.push_str(&line(r.iter().map(String::as_str).collect()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauges() -> Gauges {
        Gauges {
            queue_depth: 2,
            slots: 1,
            busy: 1,
            dead: Vec::new(),
            nodes: vec![("pipeline".into(), true, 1, 1)],
        }
    }

    fn done(at: Instant) -> Finished {
        Finished {
            arrived: at,
            started: at + Duration::from_millis(10),
            first: Some(at + Duration::from_millis(110)),
            last: Some(at + Duration::from_millis(1110)),
            prompt_tokens: 5,
            cached_tokens: 0,
            completion_tokens: 11,
            t_prompt: Some(Duration::from_millis(80)),
            finish: "stop",
        }
    }

    #[test]
    fn ttft_is_split_and_the_ring_is_bounded() {
        let s = Status::new();
        s.add_node(
            "127.0.0.1:1",
            Role::Stage,
            Some("127.0.0.1:1"),
            Some("0:15".into()),
            Some(0),
            true,
        );
        s.add_node("local", Role::Stage, None, Some("15:30".into()), Some(0), false);
        let t = Instant::now();
        for _ in 0..RECENT + 5 {
            s.finished(0, "pipeline", done(t));
        }
        let v = s.view(&gauges(), "m", "g");
        assert_eq!(v.requests.len(), RECENT);
        assert_eq!(v.requests[0].id, (RECENT + 5) as u64, "newest first");
        let r = &v.requests[0];
        assert_eq!(r.decode, "127.0.0.1:1+local");
        assert_eq!(r.prefill, "127.0.0.1:1+local");
        assert!((r.queue_ms - 10.0).abs() < 1e-6 && (r.ttft_ms.unwrap() - 110.0).abs() < 1e-6);
        assert!((r.prefill_ms.unwrap() - 80.0).abs() < 1e-6);
        assert!((r.first_token_ms.unwrap() - 20.0).abs() < 1e-6);
        assert!((r.tok_s.unwrap() - 10.0).abs() < 1e-6);
        assert_eq!(v.queued, 2);
        assert_eq!((v.nodes[1].busy, v.nodes[1].slots, v.nodes[1].up), (1, 1, Some(true)));
        assert!(
            v.nodes[1].isa.is_some() && v.nodes[0].isa.is_none(),
            "only this process's ISA is known"
        );
    }

    #[test]
    fn prefill_node_is_taken_from_the_thread_and_traffic_counts_on_its_link() {
        let s = Status::new();
        s.add_node("local", Role::Decode, None, None, Some(0), false);
        s.add_node("p1", Role::Prefill, Some("127.0.0.1:2"), None, None, true);
        s.add_node("d2", Role::Decode, Some("127.0.0.1:3"), None, Some(1), false);
        s.add_link("p1", "local", "p1");
        s.add_link("p1", "d2", "p1");
        job_starts("local");
        prefilled_on("p1");
        s.finished(0, "local", done(Instant::now()));
        s.finished(0, "local", done(Instant::now()));
        s.kv_pulled("p1", 1000, None);
        // Another slot thread, of the remote decode node: its pulls count on its own link.
        std::thread::scope(|t| {
            t.spawn(|| {
                job_starts("d2");
                s.kv_pulled("p1", 300, Some(Duration::from_millis(3)));
            });
        });
        s.wire("unknown", 5, 5, None);
        let v = s.view(&gauges(), "m", "g");
        assert_eq!(v.requests[1].prefill, "p1");
        assert_eq!(v.requests[0].prefill, "local", "the note is for one request only");
        assert_eq!((v.links[0].bytes_ab, v.links[0].bytes_ba), (1000, 0));
        assert_eq!((v.links[1].b.as_str(), v.links[1].bytes_ab), ("d2", 300));
        assert_eq!(v.links[1].throughput, Some(100_000.0));
        assert_eq!(v.nodes[1].up, Some(true), "up until a probe fails");
        assert_eq!(
            (v.nodes[1].busy, v.nodes[1].slots),
            (0, 0),
            "a prefill node has no slots of ours"
        );
    }

    #[test]
    fn rate_counts_whole_recent_seconds() {
        let r = Rate::default();
        r.add(50);
        // Still in the first second: nothing complete yet.
        assert_eq!(r.per_sec(), 0.0);
    }
}
