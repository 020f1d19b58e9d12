//! Issue 19's soak and fault suite: 16 clients send completions to `baton serve` for a bounded time, over a pipeline
//! of two nodes and over a disaggregated pair (a prefill node), while the nodes are killed and restarted and frozen
//! (SIGSTOP: a peer that holds its connections and answers nothing, as a cut link does) and thawed. Every request
//! ends in one of four ways: answered, a clear error (an HTTP error with a plain message), lost (a connection
//! reset, a malformed answer, an error with Rust internals) or hung (no answer within `HUNG`). Lost and hung must
//! be zero, the server must answer again once the faults stop, and its RSS is sampled throughout.
//!
//! CI runs the short form (`BATON_SOAK_SECS`, default 6 s per topology); the long form is `scripts/soak` (60 s per
//! topology), whose figures are in docs/reliability.md. Link cuts in network namespaces are not part of it yet.

mod cluster_util;

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

/// A node the faults act on: restarted on the same address after a kill.
struct Faulty {
    node: Mutex<NodeProc>,
    args: Vec<String>,
}

impl Faulty {
    fn start(args: &[&str]) -> Faulty {
        let node = NodeProc::spawn(&model("llama3"), "127.0.0.1:0", args);
        Faulty {
            node: Mutex::new(node),
            args: args.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn addr(&self) -> String {
        self.node.lock().unwrap().addr.clone()
    }

    /// SIGKILL, then a new node on the same port (retried while the port is still held).
    fn kill_and_restart(&self) {
        let mut n = self.node.lock().unwrap();
        let addr = n.addr.clone();
        n.kill();
        std::thread::sleep(Duration::from_millis(500));
        let args: Vec<&str> = self.args.iter().map(|s| s.as_str()).collect();
        let t0 = Instant::now();
        *n = loop {
            match NodeProc::try_spawn(&model("llama3"), &addr, &args) {
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

/// 16 clients for `secs` against `srv` while `faults` act on `nodes` in turn (one fault a quarter of the run);
/// then the server must answer again within 30 s.
fn soak(name: &str, srv: &ServeProc, nodes: &[&Faulty]) -> Figures {
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
        // The faults, spread over the run: each node killed and restarted, then frozen for 3 s and thawed.
        let step = Duration::from_secs_f64(secs as f64 / (2 * nodes.len() + 1) as f64);
        for n in nodes {
            std::thread::sleep(step);
            n.kill_and_restart();
            std::thread::sleep(step);
            n.freeze(Duration::from_secs(3).min(step));
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

#[test]
fn soak_a_pipeline_with_nodes_killed_and_frozen() {
    let node_args = ["--max-sessions", "16", "--timeout", "5"];
    let (a, b) = (Faulty::start(&node_args), Faulty::start(&node_args));
    let spec = format!("{}=0:1,{}=1:end", a.addr(), b.addr());
    let args = serve_args(&["--pipeline", &spec]);
    let srv = ServeProc::start(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    soak("pipeline", &srv, &[&a, &b]);
}

#[test]
fn soak_a_disaggregated_server_with_its_prefill_node_killed_and_frozen() {
    let p = Faulty::start(&["--max-sessions", "16", "--timeout", "5"]);
    let addr = p.addr();
    let args = serve_args(&["--prefill-node", &addr, "--prefill-timeout", "3"]);
    let srv = ServeProc::start(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    soak("disaggregated", &srv, &[&p]);
}

/// A pipeline node whose death is permanent: the server keeps answering every request with a clear error, at once
/// or after the node timeout, and never hangs (a short check, run with the soak).
#[test]
fn a_pipeline_without_its_node_answers_clear_errors() {
    let a = Faulty::start(&["--timeout", "5"]);
    let spec = format!("{}=0:end", a.addr());
    let args = serve_args(&["--pipeline", &spec]);
    let srv = ServeProc::start(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
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
