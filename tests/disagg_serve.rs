//! `baton serve` with prefill nodes (real `baton serve` and `baton-node` processes on loopback): a local decode side
//! whose turn 2 offloads only the new suffix, and a router over 2 prefill + 2 decode nodes that keeps answering
//! while nodes die.

mod cluster_util;

use cluster_util::{NodeProc, smollm2};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// A `baton serve` child process, killed on drop (its log printed when the test fails).
struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["serve", "-t", "1", "-c", "512", "-b", "32", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn baton serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some((_, rest)) = line.split_once("listening on http://") {
                    let _ = tx.send(rest.trim().to_string());
                }
                let mut l = log2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => Server { child, addr, log },
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("baton serve did not start:\n{}", log.lock().unwrap());
            }
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// One request on its own connection (`Connection: close`): status and body.
    fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(!head.to_ascii_lowercase().contains("chunked"), "{head}");
        let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (code, body.to_string())
    }

    fn chat(&self, messages: Value) -> Value {
        let body = json!({"model": "smollm2", "temperature": 0, "max_tokens": 4, "messages": messages});
        let (code, text) = self.http("POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(code, 200, "{text}\nserver log:\n{}", self.log());
        serde_json::from_str(&text).unwrap()
    }

    /// The value of the metric line starting with `name` (0 when absent).
    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.http("GET", "/metrics", "");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("server log:\n{}", self.log());
        }
    }
}

fn user(content: &str) -> Value {
    json!({"role": "user", "content": content})
}

fn reply(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn usage(v: &Value) -> (f64, f64) {
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_f64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap(),
    )
}

/// `baton serve --prefill-node P`: the server decodes with its own model, P prefills. Turn 2 of a conversation keeps
/// turn 1 and the reply in the decode side's cache and sends only the new suffix's KV (the report, as metrics).
#[test]
fn serve_with_a_prefill_node_offloads_only_the_new_suffix() {
    let p = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let model = smollm2();
    let srv = Server::start(&[
        "-m",
        model.to_str().unwrap(),
        "--prefill-node",
        &p.addr,
        "--offload",
        "always",
    ]);
    let sent = |srv: &Server, kind: &str| {
        srv.metric(&format!(
            "baton_prefill_tokens_total{{node=\"{}\",kind=\"{kind}\"}}",
            p.addr
        ))
    };
    let q1 = "Name three colours of the rainbow.";
    let a = srv.chat(json!([user(q1)]));
    let (n1, cached1) = usage(&a);
    assert_eq!(cached1, 0.0);
    assert_eq!(
        sent(&srv, "sent"),
        n1,
        "turn 1: the whole prompt was prefilled remotely"
    );
    let bytes1 = srv.metric(&format!(
        "baton_wire_bytes_total{{peer=\"{}\",direction=\"received\"}}",
        p.addr
    ));
    assert!(bytes1 > n1 * 40_000.0, "{bytes1} bytes of KV for {n1} tokens");

    let turn2 = json!([user(q1), {"role": "assistant", "content": reply(&a)}, user("And two more?")]);
    let b = srv.chat(turn2);
    let (n2, cached2) = usage(&b);
    assert!(cached2 >= n1, "turn 2 keeps turn 1 (and its reply): {cached2} of {n2}");
    assert_eq!(
        sent(&srv, "sent") - n1,
        n2 - cached2,
        "only the new suffix crossed the wire"
    );
    assert_eq!(sent(&srv, "held"), cached2);
    assert_eq!(
        srv.metric(&format!(
            "baton_prefill_requests_total{{node=\"{}\",outcome=\"offloaded\"}}",
            p.addr
        )),
        2.0
    );
    // The same conversation on a plain local server gives the same replies.
    drop(srv);
    let local = Server::start(&["-m", model.to_str().unwrap()]);
    let a2 = local.chat(json!([user(q1)]));
    assert_eq!(reply(&a2), reply(&a));
}

/// 2 prefill + 2 decode nodes behind the router: concurrent requests use both prefill nodes, a conversation's next
/// turn goes to the decode node holding its prefix (`/metrics`), and after a prefill node and then a decode node are
/// killed, requests still complete (prefill fallback / retry on the other decode node).
#[test]
fn router_over_two_prefill_and_two_decode_nodes() {
    let t_start = Instant::now();
    let model = smollm2();
    let mut p = [0, 1].map(|_| NodeProc::spawn(&model, "127.0.0.1:0", &[]));
    let mut d = [0, 1].map(|_| NodeProc::spawn(&model, "127.0.0.1:0", &[]));
    let dir = tempfile::tempdir().unwrap();
    let mut file = format!(
        "model = {:?}\noffload = \"always\"\nprefill_timeout = 5.0\n",
        model.display().to_string()
    );
    for (i, n) in p.iter().enumerate() {
        file.push_str(&format!(
            "[[node]]\nname = \"p{i}\"\naddr = \"{}\"\nrole = \"prefill\"\n",
            n.addr
        ));
    }
    for (i, n) in d.iter().enumerate() {
        file.push_str(&format!(
            "[[node]]\nname = \"d{i}\"\naddr = \"{}\"\nrole = \"decode\"\nslots = 1\n",
            n.addr
        ));
    }
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, file).unwrap();
    let srv = Arc::new(Server::start(&[
        "--cluster",
        path.to_str().unwrap(),
        "--node-timeout",
        "30",
    ]));
    let offloaded = |srv: &Server, i: usize| {
        srv.metric(&format!(
            "baton_prefill_requests_total{{node=\"p{i}\",outcome=\"offloaded\"}}"
        ))
    };

    // Two conversations at once: one per decode node, each prefilled by a different prefill node.
    let story = "Once upon a time, in a quiet village by the sea, there lived an old fisherman named Tom.";
    let planets = "List the planets of the solar system in order from the sun.";
    let threads: Vec<_> = [story, planets]
        .map(|q| {
            let srv = srv.clone();
            std::thread::spawn(move || srv.chat(json!([user(q)])))
        })
        .into_iter()
        .collect();
    let first: Vec<Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        (offloaded(&srv, 0), offloaded(&srv, 1)),
        (1.0, 1.0),
        "one prompt per prefill node"
    );
    let routed = |i: usize, why: &str| srv.metric(&format!("baton_routed_total{{node=\"d{i}\",reason=\"{why}\"}}"));
    assert_eq!(routed(0, "least_loaded") + routed(1, "least_loaded"), 2.0);

    // The story's next turn: routed for its prefix, and the decode node only receives the new suffix's KV.
    let next = json!([user(story), {"role": "assistant", "content": reply(&first[0])}, user("What happened next?")]);
    let prefix_before = routed(0, "prefix") + routed(1, "prefix");
    let b = srv.chat(next.clone());
    assert_eq!(
        routed(0, "prefix") + routed(1, "prefix"),
        prefix_before + 1.0,
        "prefix-affine routing"
    );
    let (n2, cached2) = usage(&b);
    assert!(cached2 > 20.0 && cached2 < n2, "{b}");

    // A prefill node dies: requests still complete (the one that hits it falls back; it is taken out).
    p[0].kill();
    for q in ["Say hello in French.", "Say hello in Spanish.", "Count to three."] {
        srv.chat(json!([user(q)]));
    }
    let t0 = Instant::now();
    while !srv.log().contains("prefill node p0") {
        assert!(t0.elapsed() < Duration::from_secs(10), "p0 was never taken out");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(offloaded(&srv, 1) >= 2.0);
    // It comes back on the same address: the health check puts it back.
    let addr = p[0].addr.clone();
    p[0] = NodeProc::spawn(&model, &addr, &[]);
    let t0 = Instant::now();
    while !srv.log().contains(&format!("prefill node p0 ({addr}) is back up")) {
        assert!(t0.elapsed() < Duration::from_secs(10), "p0 was not put back");
        std::thread::sleep(Duration::from_millis(100));
    }

    // A decode node dies too: its requests are retried on the other one.
    d[0].kill();
    for q in ["Name a fruit.", "Name a tree."] {
        srv.chat(json!([user(q)]));
    }
    assert_eq!(
        srv.metric("baton_requests_total{path=\"/v1/chat/completions\",status=\"200\"}"),
        8.0
    );
    eprintln!("router test took {:.1} s", t_start.elapsed().as_secs_f64());
    assert!(t_start.elapsed() < Duration::from_secs(120));
}
