//! Helpers for the cluster tests: `baton-node` child processes that are always killed, free loopback ports,
//! the local reference run.
#![allow(dead_code)]

use baton::engine::{Input, Session, Want};
use baton::kernels::ThreadPool;
use baton::model::Model;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

#[path = "../common/mod.rs"]
mod common;
pub use common::*;
pub mod netns;

/// The real SmolLM2 model, fetched on first use (override with BATON_TEST_MODEL).
pub fn smollm2() -> PathBuf {
    std::env::var_os("BATON_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| model("smollm2"))
}

pub fn gemma3() -> PathBuf {
    model("gemma3")
}

/// Pipeline options for loopback tests: a short context, 16-token chunks, one thread, generous I/O timeouts.
pub fn pipeline_opts() -> baton::cluster::PipelineOpts {
    baton::cluster::PipelineOpts {
        n_ctx: 512,
        chunk: 16,
        threads: 1,
        timeouts: baton::cluster::handshake::Timeouts {
            connect: Duration::from_secs(5),
            io: Duration::from_secs(120),
        },
        top_k: 3,
        ..Default::default()
    }
}

/// The shape of an ignored benchmark test, from BENCH_PP, BENCH_TG, BENCH_THREADS and BENCH_CHUNKS.
pub struct BenchEnv {
    pub pp: usize,
    pub tg: usize,
    pub threads: usize,
    pub chunks: Vec<usize>,
}

impl BenchEnv {
    pub fn from_env() -> BenchEnv {
        let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
        BenchEnv {
            pp: env("BENCH_PP", 512),
            tg: env("BENCH_TG", 128),
            threads: env("BENCH_THREADS", 1),
            chunks: std::env::var("BENCH_CHUNKS")
                .unwrap_or("128,512".into())
                .split(',')
                .map(|c| c.parse().expect("BENCH_CHUNKS: comma-separated numbers"))
                .collect(),
        }
    }
}

/// Resident memory of process `pid` in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

pub fn node_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_baton-node"))
}

/// A free loopback port (bound then released; the node rebinds it with SO_REUSEADDR).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `cmd` (killed if the test process dies), gathers its standard error, and waits at most 60 s for the line
/// from which `listening` takes the address it listens on. `Err(log)` when it exits or stays silent first.
pub fn spawn_listening(
    mut cmd: Command,
    listening: impl Fn(&str) -> Option<String> + Send + 'static,
) -> Result<(Child, String, Arc<Mutex<String>>), String> {
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let log2 = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(addr) = listening(&line) {
                let _ = tx.send(addr);
            }
            let mut l = log2.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    let t0 = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(addr) => return Ok((child, addr, log)),
            Err(_) => {
                if let Ok(Some(_)) = child.try_wait() {
                    std::thread::sleep(Duration::from_millis(100));
                    return Err(log.lock().unwrap().clone());
                }
                if t0.elapsed() > Duration::from_secs(60) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("no listening line within 60 s; log:\n{}", log.lock().unwrap()));
                }
            }
        }
    }
}

/// A `baton serve` child process on an ephemeral loopback port, killed on drop (its log printed when the test
/// fails).
pub struct ServeProc {
    pub child: Child,
    pub addr: String,
    pub log: Arc<Mutex<String>>,
}

impl ServeProc {
    /// `baton serve ARGS` (with `--listen 127.0.0.1:0` unless ARGS names one); `Err(log)` when it does not start.
    pub fn try_start(args: &[&str]) -> Result<ServeProc, String> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.arg("serve").args(args);
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        let (child, addr, log) = spawn_listening(cmd, |line| {
            line.split_once("listening on http://")
                .map(|(_, rest)| rest.trim().to_string())
        })?;
        Ok(ServeProc { child, addr, log })
    }

    pub fn start(args: &[&str]) -> ServeProc {
        Self::try_start(args).unwrap_or_else(|log| panic!("baton serve failed to start:\n{log}"))
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// One request on its own connection (`Connection: close`), not streamed: status and body.
    pub fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        self.http_with(method, path, body, "")
    }

    /// [`ServeProc::http`] with extra header lines (`"Name: value\r\n"` each).
    pub fn http_with(&self, method: &str, path: &str, body: &str, headers: &str) -> (u16, String) {
        let (code, _, body) = self.exchange(method, path, body, headers);
        (code, body)
    }

    /// [`ServeProc::http_with`], also returning the response's head (status line and headers).
    pub fn exchange(&self, method: &str, path: &str, body: &str, headers: &str) -> (u16, String, String) {
        let (code, head, body) = self
            .try_exchange(method, path, body, headers, Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        assert!(!head.to_ascii_lowercase().contains("chunked"), "{head}");
        (code, head, body)
    }

    /// [`ServeProc::exchange`] that reports instead of panicking: a connection refused or reset, no answer within
    /// `limit` (`Err` starting with "timed out"), or something that is not an HTTP response.
    pub fn try_exchange(
        &self,
        method: &str,
        path: &str,
        body: &str,
        headers: &str,
        limit: Duration,
    ) -> Result<(u16, String, String), String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.addr).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(limit)).map_err(|e| e.to_string())?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
             {headers}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!("timed out after {limit:?}"),
            _ => format!("read: {e}"),
        })?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| format!("not an HTTP response: {text:?}"))?;
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("no status in {head:?}"))?;
        Ok((code, head.to_string(), body.to_string()))
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (code, text) = self.http("POST", path, &body.to_string());
        (
            code,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    /// [`ServeProc::post`] with extra header lines.
    pub fn post_with(&self, path: &str, body: &serde_json::Value, headers: &str) -> (u16, serde_json::Value) {
        let (code, text) = self.http_with("POST", path, &body.to_string(), headers);
        (
            code,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.http("GET", path, "")
    }

    /// The value of the `/metrics` line starting with `name` (0 when absent).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .map_or(0.0, |v| v.trim().parse().unwrap())
    }
}

impl Drop for ServeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("server log:\n{}", self.log());
        }
    }
}

/// A `baton-node` child process, killed (and reaped) on drop; also killed if the test process dies.
pub struct NodeProc {
    pub child: Child,
    pub addr: String,
    pub log: Arc<Mutex<String>>,
}

impl NodeProc {
    /// Starts a node and waits (at most 60 s) until it listens; `Err(log)` when it exits first.
    pub fn try_spawn(model: &Path, listen: &str, extra: &[&str]) -> Result<NodeProc, String> {
        Self::try_spawn_in(&[], model, listen, extra)
    }

    /// Like [`NodeProc::try_spawn`], run through `prefix` (e.g. `ip netns exec NAME`, which execs in place).
    pub fn try_spawn_in(prefix: &[&str], model: &Path, listen: &str, extra: &[&str]) -> Result<NodeProc, String> {
        let mut cmd = match prefix.split_first() {
            None => Command::new(node_bin()),
            Some((p, rest)) => {
                let mut c = Command::new(p);
                c.args(rest).arg(node_bin());
                c
            }
        };
        cmd.args([
            "--model",
            model.to_str().unwrap(),
            "--listen",
            listen,
            "-t",
            "1",
            "-c",
            "1024",
        ])
        .args(extra);
        let (child, addr, log) = spawn_listening(cmd, |line| {
            // A node started with `--log-format json` writes the same message as a JSON field.
            let json = serde_json::from_str::<serde_json::Value>(line).ok();
            let msg = match &json {
                Some(v) => v["message"].as_str()?,
                None => line,
            };
            msg.strip_prefix("baton node: listening on ")
                .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
        })?;
        Ok(NodeProc { child, addr, log })
    }

    pub fn spawn(model: &Path, listen: &str, extra: &[&str]) -> NodeProc {
        Self::try_spawn(model, listen, extra).unwrap_or_else(|log| panic!("baton-node failed to start:\n{log}"))
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: i32) {
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill();
    }
}

/// The local reference: logits of the prompt's last token, then `n_gen` greedy tokens.
pub fn local_reference(model: &Path, prompt: &[u32], n_gen: usize) -> (Vec<f32>, Vec<u32>) {
    let m = Arc::new(Model::load(model).unwrap());
    let mut s = Session::new(m, Arc::new(ThreadPool::new(1)), 1024, 512).unwrap();
    let logits = s.forward(Input::Tokens(prompt), Want::LastLogits).unwrap().to_vec();
    let mut toks = vec![argmax(&logits)];
    while toks.len() < n_gen {
        let l = s
            .forward(Input::Tokens(&[*toks.last().unwrap()]), Want::LastLogits)
            .unwrap();
        toks.push(argmax(l));
    }
    (logits, toks)
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Some token ids that exist in every vocabulary used here.
pub fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| 100 + (i as u32 * 37) % 900).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// The scale logits are compared at: their largest magnitude, at least 1 (so 1e-3 of it is never under 1e-3).
pub fn logit_scale(logits: &[f32]) -> f32 {
    logits.iter().fold(1.0f32, |m, x| m.max(x.abs()))
}

/// Prefill and decode speed of the local run: (pp tokens/s, tg tokens/s).
pub fn bench_local(model: &Path, threads: usize, prompt: &[u32], tg: usize) -> (f64, f64) {
    let m = Arc::new(Model::load(model).unwrap());
    let mut s = Session::new(m, Arc::new(ThreadPool::new(threads)), prompt.len() + tg + 8, 512).unwrap();
    let t0 = Instant::now();
    let mut last = 0;
    let n = prompt.chunks(512).count();
    for (i, c) in prompt.chunks(512).enumerate() {
        let want = if i + 1 == n { Want::LastLogits } else { Want::Hidden };
        let out = s.forward(Input::Tokens(c), want).unwrap();
        if i + 1 == n {
            last = argmax(out);
        }
    }
    let pp = prompt.len() as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for _ in 0..tg {
        last = argmax(s.forward(Input::Tokens(&[last]), Want::LastLogits).unwrap());
    }
    (pp, tg as f64 / t0.elapsed().as_secs_f64())
}

/// Prefill and decode speed through a pipeline: (pp tokens/s, tg tokens/s, decode-only per-stage stats).
pub fn bench_pipeline(
    spec: &str,
    model: &Path,
    o: baton::cluster::PipelineOpts,
    prompt: &[u32],
    tg: usize,
) -> (f64, f64, Vec<baton::cluster::StageStats>) {
    let mut p = baton::cluster::PipelineSession::connect(spec, model, o).unwrap();
    let t0 = Instant::now();
    let mut last = p.eval(prompt).unwrap().token;
    let pp = prompt.len() as f64 / t0.elapsed().as_secs_f64();
    p.reset_stats();
    let t0 = Instant::now();
    for _ in 0..tg {
        last = p.decode_step(last).unwrap().token;
    }
    (pp, tg as f64 / t0.elapsed().as_secs_f64(), p.stats())
}

/// Per decoded token: bytes sent + received over all stages.
pub fn bytes_per_token(stats: &[baton::cluster::StageStats], tg: usize) -> f64 {
    stats.iter().map(|s| (s.bytes_sent + s.bytes_recv) as f64).sum::<f64>() / tg as f64
}
