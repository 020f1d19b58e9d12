//! Issue 19's soak and fault suite: 16 clients send completions to `baton serve` for a bounded time, over a pipeline
//! of two nodes and over a disaggregated pair (a prefill node), while the nodes are killed and restarted and frozen
//! (SIGSTOP: a peer that holds its connections and answers nothing) and thawed, and the link to them is cut
//! (`ip link set DEV down`, then up) and shaped with `tc` (delay and loss). Every request ends in one of four ways:
//! answered, a clear error (an HTTP error with a plain message), lost (a connection reset, a malformed answer, an
//! error with Rust internals) or hung (no answer within `HUNG`). Lost and hung must be zero, the server must answer
//! again once the faults stop, and its RSS is sampled throughout.
//!
//! The nodes live in a network namespace joined to the host, where the server runs, by a veth pair
//! (tests/cluster_util/netns.rs). Without root or `ip` the link faults are SKIPPED (printed, with why) and the nodes
//! run on loopback with the other faults.
//!
//! CI runs the short form (`BATON_SOAK_SECS`, default 6 s per topology); the long form is `scripts/soak` (60 s per
//! topology), whose figures are in docs/reliability.md.

mod cluster_util;

use cluster_util::netns::{Link, netns_exists, secret_file};
use cluster_util::*;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CLIENTS: usize = 16;
/// A request not answered within this is hung: every wait in the server is bounded well below it.
const HUNG: Duration = Duration::from_secs(60);

fn soak_secs() -> u64 {
    std::env::var("BATON_SOAK_SECS").map_or(6, |s| s.parse().expect("BATON_SOAK_SECS: whole seconds"))
}

#[derive(Default)]
struct Tally {
    answered: AtomicU64,
    clear: AtomicU64,
    lost: AtomicU64,
    hung: AtomicU64,
    /// The first few lost requests and clear errors, to show.
    lost_seen: Mutex<Vec<String>>,
    clear_seen: Mutex<Vec<String>>,
}

impl Tally {
    fn note(list: &Mutex<Vec<String>>, what: String) {
        let mut l = list.lock().unwrap();
        if l.len() < 5 && !l.contains(&what) {
            l.push(what);
        }
    }
}

/// One completion request, classified.
fn request(srv: &ServeProc, client: usize, tally: &Tally) {
    let body = json!({"prompt": format!("client {client} says"), "max_tokens": 8, "temperature": 0});
    match srv.try_exchange("POST", "/v1/completions", &body.to_string(), "", HUNG) {
        Err(e) if e.starts_with("timed out") => {
            tally.hung.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            tally.lost.fetch_add(1, Ordering::Relaxed);
            Tally::note(&tally.lost_seen, e);
        }
        Ok((code, _, text)) => {
            let v: Option<Value> = serde_json::from_str(&text).ok();
            let answered = code == 200 && v.as_ref().is_some_and(|v| v["choices"][0]["text"].is_string());
            let message = v.as_ref().and_then(|v| v["error"]["message"].as_str()).unwrap_or("");
            let plain = !message.is_empty()
                && !["panicked", "src/", "::", "RUST_BACKTRACE"]
                    .iter()
                    .any(|w| message.contains(w));
            if answered {
                tally.answered.fetch_add(1, Ordering::Relaxed);
            } else if code >= 400 && plain {
                tally.clear.fetch_add(1, Ordering::Relaxed);
                Tally::note(&tally.clear_seen, format!("{code} {message}"));
            } else {
                tally.lost.fetch_add(1, Ordering::Relaxed);
                Tally::note(&tally.lost_seen, format!("{code} {text}"));
            }
        }
    }
}

/// Where the nodes run: in a namespace behind a veth pair to the host, or (without root or `ip`) on loopback.
struct Place {
    link: Option<Link>,
    /// The secret nodes and server share (a node off loopback requires one).
    secret: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Place {
    /// In a namespace where one can be built; else on loopback, after printing SKIPPED and why.
    fn new() -> Place {
        let link = Link::to_host()
            .map_err(|why| eprintln!("SKIPPED: link cuts and tc shaping ({why}); soaking on loopback without them"))
            .ok();
        Self::with(link)
    }

    fn loopback() -> Place {
        Self::with(None)
    }

    fn with(link: Option<Link>) -> Place {
        let dir = tempfile::tempdir().unwrap();
        Place {
            link,
            secret: secret_file(&dir),
            _dir: dir,
        }
    }

    /// `--secret-file PATH`, for the server and each node.
    fn secret_args(&self) -> [&str; 2] {
        ["--secret-file", self.secret.to_str().unwrap()]
    }

    /// A node the faults act on, started with `--secret-file` and `args`.
    fn node(&self, args: &[&str]) -> Faulty {
        let mut all: Vec<String> = self.secret_args().iter().map(|s| s.to_string()).collect();
        all.extend(args.iter().map(|s| s.to_string()));
        let prefix: Vec<String> = self.link.iter().flat_map(|l| l.in_b()).map(|s| s.to_string()).collect();
        let host = self.link.as_ref().map_or("127.0.0.1", |l| l.b_ip.as_str());
        let node = spawn_node(&prefix, &all, &format!("{host}:0")).unwrap_or_else(|log| panic!("node: {log}"));
        Faulty {
            node: Mutex::new(node),
            prefix,
            args: all,
        }
    }
}

/// A llama3 test node listening on `listen`, run through `prefix` (`ip netns exec NAME` or nothing).
fn spawn_node(prefix: &[String], args: &[String], listen: &str) -> Result<NodeProc, String> {
    let prefix: Vec<&str> = prefix.iter().map(|s| s.as_str()).collect();
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    NodeProc::try_spawn_in(&prefix, &model("llama3"), listen, &args)
}

/// A node the faults act on: restarted on the same address after a kill.
struct Faulty {
    node: Mutex<NodeProc>,
    prefix: Vec<String>,
    args: Vec<String>,
}

impl Faulty {
    fn addr(&self) -> String {
        self.node.lock().unwrap().addr.clone()
    }

    /// SIGKILL, then a new node on the same address (retried while the port is still held).
    fn kill_and_restart(&self) {
        let mut n = self.node.lock().unwrap();
        let addr = n.addr.clone();
        n.kill();
        std::thread::sleep(Duration::from_millis(500));
        let t0 = Instant::now();
        *n = loop {
            match spawn_node(&self.prefix, &self.args, &addr) {
                Ok(node) => break node,
                Err(log) => assert!(t0.elapsed() < Duration::from_secs(20), "node restart failed:\n{log}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        };
    }

    /// Frozen for `d`: connections stay open, nothing is answered.
    fn freeze(&self, d: Duration) {
        self.node.lock().unwrap().signal(libc::SIGSTOP);
        std::thread::sleep(d);
        self.node.lock().unwrap().signal(libc::SIGCONT);
    }
}

/// The figures of one run.
struct Figures {
    answered: u64,
    clear: u64,
    lost: u64,
    hung: u64,
    rss_mib: (f64, f64, f64),
}

/// 16 clients for `secs` against `srv` while the faults act in turn, spread over the run: each node killed and
/// restarted, then frozen; then the link to the nodes (where they are in a namespace) cut and restored, then shaped
/// and restored. Then the server must answer again within 30 s.
fn soak(name: &str, srv: &ServeProc, place: &Place, nodes: &[&Faulty]) -> Figures {
    let secs = soak_secs();
    let pid = srv.child.id();
    let tally = Tally::default();
    let done = AtomicBool::new(false);
    let rss = Mutex::new(Vec::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for c in 0..CLIENTS {
            let (tally, done) = (&tally, &done);
            s.spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    request(srv, c, tally);
                }
            });
        }
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                rss.lock().unwrap().push(rss_kib(pid) as f64 / 1024.0);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let faults = 2 * nodes.len() + if place.link.is_some() { 2 } else { 0 };
        let step = Duration::from_secs_f64(secs as f64 / (faults + 1) as f64);
        // A fault lasts 3 s, or less in a short run, but at least 1 s.
        let lasting = Duration::from_secs(3).min(step).max(Duration::from_secs(1));
        for n in nodes {
            std::thread::sleep(step);
            n.kill_and_restart();
            std::thread::sleep(step);
            n.freeze(lasting);
        }
        if let Some(link) = &place.link {
            std::thread::sleep(step);
            link.set_up(false);
            let probe = nodes[0].addr().parse().unwrap();
            let reach = |d| std::net::TcpStream::connect_timeout(&probe, d).is_ok();
            assert!(
                !reach(Duration::from_millis(300)),
                "{name}: link down, yet {probe} answers"
            );
            std::thread::sleep(lasting);
            link.set_up(true);
            assert!(
                reach(Duration::from_secs(5)),
                "{name}: link up again, yet {probe} does not answer"
            );
            std::thread::sleep(step);
            let how = link.impair();
            eprintln!("soak {name}: link shaped with tc {how} for {lasting:?}");
            std::thread::sleep(lasting);
            link.restore();
        }
        while t0.elapsed() < Duration::from_secs(secs) {
            std::thread::sleep(Duration::from_millis(100));
        }
        done.store(true, Ordering::Relaxed);
    });
    // Recovery: with the faults over, a request is answered again.
    let t1 = Instant::now();
    let after = Tally::default();
    while after.answered.load(Ordering::Relaxed) == 0 {
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "{name}: not answering 30 s after the faults\n{}",
            srv.log()
        );
        request(srv, 0, &after);
        std::thread::sleep(Duration::from_millis(200));
    }
    let samples = rss.into_inner().unwrap();
    let peak = samples.iter().copied().fold(0.0, f64::max);
    let f = Figures {
        answered: tally.answered.into_inner(),
        clear: tally.clear.into_inner(),
        lost: tally.lost.into_inner() + after.lost.into_inner(),
        hung: tally.hung.into_inner() + after.hung.into_inner(),
        rss_mib: (samples[0], peak, *samples.last().unwrap()),
    };
    let line = format!(
        "soak {name}: {secs} s, {CLIENTS} clients: answered {}, clear errors {}, lost {}, hung {}; serve RSS MiB \
         start {:.0} peak {:.0} end {:.0}",
        f.answered, f.clear, f.lost, f.hung, f.rss_mib.0, f.rss_mib.1, f.rss_mib.2
    );
    eprintln!("{line}");
    eprintln!("  clear errors seen: {:?}", tally.clear_seen.lock().unwrap());
    if let Ok(out) = std::env::var("BATON_SOAK_OUT") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(out).unwrap();
        writeln!(f, "{line}").unwrap();
    }
    assert_eq!(
        (f.lost, f.hung),
        (0, 0),
        "{name}: lost {:?}\nserver log:\n{}",
        tally.lost_seen.lock().unwrap(),
        srv.log()
    );
    assert!(f.answered > 0, "{name}: nothing answered\n{}", srv.log());
    f
}

/// Flags every server here runs with: small context, short node timeout so a frozen node fails requests early.
const SERVE: [&str; 14] = [
    "-m",
    "", // the model, filled in
    "-t",
    "1",
    "-c",
    "256",
    "-b",
    "32",
    "--parallel",
    "4",
    "--queue",
    "64",
    "--node-timeout",
    "5",
];

fn serve_args(extra: &[&str]) -> Vec<String> {
    let m = model("llama3");
    let mut a: Vec<String> = SERVE.iter().map(|s| s.to_string()).collect();
    a[1] = m.to_str().unwrap().to_string();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// The server's flags for nodes at `place`: the shared secret, then `extra`.
fn serve_at(place: &Place, extra: &[&str]) -> ServeProc {
    let mut args = serve_args(&place.secret_args());
    args.extend(extra.iter().map(|s| s.to_string()));
    ServeProc::start(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>())
}

/// After a soak: the namespace of `place` is deleted with it.
fn drop_and_check(place: Place) {
    let name = place.link.as_ref().map(|l| l.b.0.clone());
    drop(place);
    if let Some(name) = name {
        assert!(!netns_exists(&name), "namespace {name} left behind");
    }
}

#[test]
fn soak_a_pipeline_with_nodes_killed_and_frozen_and_links_cut() {
    let place = Place::new();
    {
        let node_args = ["--max-sessions", "16", "--timeout", "5"];
        let (a, b) = (place.node(&node_args), place.node(&node_args));
        let spec = format!("{}=0:1,{}=1:end", a.addr(), b.addr());
        let srv = serve_at(&place, &["--pipeline", &spec]);
        soak("pipeline", &srv, &place, &[&a, &b]);
    }
    drop_and_check(place);
}

#[test]
fn soak_a_disaggregated_server_with_its_prefill_node_killed_and_frozen_and_links_cut() {
    let place = Place::new();
    {
        let p = place.node(&["--max-sessions", "16", "--timeout", "5"]);
        let addr = p.addr();
        let srv = serve_at(&place, &["--prefill-node", &addr, "--prefill-timeout", "3"]);
        soak("disaggregated", &srv, &place, &[&p]);
    }
    drop_and_check(place);
}

/// A pipeline node whose death is permanent: the server keeps answering every request with a clear error, at once
/// or after the node timeout, and never hangs (a short check, run with the soak).
#[test]
fn a_pipeline_without_its_node_answers_clear_errors() {
    let place = Place::loopback();
    let a = place.node(&["--timeout", "5"]);
    let spec = format!("{}=0:end", a.addr());
    let srv = serve_at(&place, &["--pipeline", &spec]);
    a.node.lock().unwrap().kill();
    let tally = Arc::new(Tally::default());
    for c in 0..4 {
        request(&srv, c, &tally);
    }
    assert_eq!(
        tally.clear.load(Ordering::Relaxed),
        4,
        "{:?}",
        tally.lost_seen.lock().unwrap()
    );
}
