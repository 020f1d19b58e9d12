//! `--experts-split` with a real `baton-node` on loopback: half of each MoE layer's experts run on the node, and the
//! output has the bits of one process alone (32-bit wire), is close at 16 bits, survives the node's death (its
//! experts then run here), and a node holding another model is refused at the handshake.

mod cluster_util;

use baton::cluster::experts::{ExpertsPeer, STATS, SplitConfig};
use baton::cluster::handshake::Timeouts;
use baton::engine::snapshot::RowDtype;
use baton::engine::{Input, Session, Want};
use baton::kernels::ThreadPool;
use baton::model::Model;
use baton::model::moe::RemoteExperts;
use cluster_util::*;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn config(addr: &str, wire: RowDtype) -> SplitConfig {
    SplitConfig {
        addr: addr.to_string(),
        secret: None,
        wire,
        timeouts: Timeouts {
            connect: Duration::from_secs(5),
            io: Duration::from_secs(60),
        },
    }
}

/// Prompt logits of every row, then `n_gen` greedy steps' logits, of a session with or without the peer.
fn run(model: &Arc<Model>, peer: Option<Arc<dyn RemoteExperts>>, prompt: &[u32], n_gen: usize) -> Vec<Vec<f32>> {
    let mut s = Session::new(model.clone(), Arc::new(ThreadPool::new(1)), 256, 64).unwrap();
    s.set_remote_experts(peer);
    let mut out = vec![s.forward(Input::Tokens(prompt), Want::AllLogits).unwrap().to_vec()];
    let n_vocab = model.hp.n_vocab;
    let mut tok = argmax(&out[0][out[0].len() - n_vocab..]);
    for _ in 0..n_gen {
        let l = s.forward(Input::Tokens(&[tok]), Want::LastLogits).unwrap().to_vec();
        tok = argmax(&l);
        out.push(l);
    }
    out
}

#[test]
fn split_over_a_node_gives_the_local_bits() {
    let path = model("qwen3moe");
    let m = Arc::new(Model::load(&path).unwrap());
    let node = NodeProc::spawn(&path, "127.0.0.1:0", &[]);
    let prompt = prompt(40);
    let local = run(&m, None, &prompt, 12);

    let before = STATS.picks.load(Ordering::Relaxed);
    let peer = Arc::new(ExpertsPeer::connect(config(&node.addr, RowDtype::F32), &m).unwrap());
    let split = run(&m, Some(peer), &prompt, 12);
    for (i, (a, b)) in local.iter().zip(&split).enumerate() {
        assert!(
            a == b,
            "step {i}: the split differs from local by {}",
            max_abs_diff(a, b)
        );
    }
    // Each of the 2 layers sends half of k = 2 picks per row: 40 prompt rows and 12 steps, about 52 picks a layer.
    let sent = STATS.picks.load(Ordering::Relaxed) - before;
    assert!((60..=150).contains(&sent), "the node ran {sent} picks");

    let peer = Arc::new(ExpertsPeer::connect(config(&node.addr, RowDtype::F16), &m).unwrap());
    let half = run(&m, Some(peer), &prompt, 12);
    let worst = local
        .iter()
        .zip(&half)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f32::max);
    eprintln!("16-bit wire: largest logit difference {worst}");
    assert!(
        worst > 0.0 && worst < 0.05,
        "16-bit wire: largest logit difference {worst}"
    );
}

/// The node dies mid-generation: the next layers run its experts here, with the same bits, after one warning; the
/// peer is not tried again at once.
#[test]
fn a_dead_node_leaves_its_experts_here() {
    let path = model("qwen3moe");
    let m = Arc::new(Model::load(&path).unwrap());
    let mut node = NodeProc::spawn(&path, "127.0.0.1:0", &[]);
    let prompt = prompt(24);
    let local = run(&m, None, &prompt, 8);

    let peer = Arc::new(ExpertsPeer::connect(config(&node.addr, RowDtype::F32), &m).unwrap());
    let mut s = Session::new(m.clone(), Arc::new(ThreadPool::new(1)), 256, 64).unwrap();
    s.set_remote_experts(Some(peer.clone()));
    let mut got = vec![s.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec()];
    let fallbacks = STATS.fallbacks.load(Ordering::Relaxed);
    let mut tok = argmax(&got[0][got[0].len() - m.hp.n_vocab..]);
    for step in 0..8 {
        if step == 3 {
            node.kill();
        }
        let l = s.forward(Input::Tokens(&[tok]), Want::LastLogits).unwrap().to_vec();
        tok = argmax(&l);
        got.push(l);
    }
    for (i, (a, b)) in local.iter().zip(&got).enumerate() {
        assert!(a == b, "step {i}: differs from local by {}", max_abs_diff(a, b));
    }
    assert_eq!(
        STATS.fallbacks.load(Ordering::Relaxed),
        fallbacks + 1,
        "one failure, then left alone"
    );
    assert!(!peer.available(), "a failed node waits before it is tried again");
}

/// A node serving another model file is refused at the handshake, naming the fingerprints; `baton run` refuses the
/// flag for a model without experts.
#[test]
fn a_node_with_other_weights_is_refused() {
    let node = NodeProc::spawn(&model("qwen3"), "127.0.0.1:0", &[]);
    let m = Model::load(&model("qwen3moe")).unwrap();
    let err = ExpertsPeer::connect(config(&node.addr, RowDtype::F32), &m)
        .err()
        .expect("refused");
    let err = format!("{err:#}");
    assert!(err.contains("fingerprint"), "{err}");

    let out = Command::new(baton_bin())
        .args(["run", "-m"])
        .arg(model("qwen3"))
        .args(["--experts-split", &node.addr, "-n", "2", "hello"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("without experts"), "{stderr}");
}

/// `baton run --experts-split` prints the text of a run without it, and reports the split's traffic.
#[test]
fn run_with_the_flag_prints_the_local_text() {
    let path = model("qwen3moe");
    let node = NodeProc::spawn(&path, "127.0.0.1:0", &[]);
    let run = |extra: &[&str]| {
        let out = Command::new(baton_bin())
            .args(["run", "-m"])
            .arg(&path)
            .args(["-n", "24", "--temp", "0", "-t", "1"])
            .args(extra)
            .arg("The quick brown fox")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        (String::from_utf8_lossy(&out.stdout).to_string(), stderr)
    };
    let (local, _) = run(&[]);
    let (split, log) = run(&["--experts-split", &node.addr]);
    assert_eq!(local, split);
    assert!(!local.trim().is_empty());
    assert!(log.contains("experts split:") && log.contains("requests"), "{log}");
}

/// `BENCH_MODEL=PATH cargo test --release --test experts bench_experts_split -- --ignored --nocapture`: prefill and
/// decode of a MoE model with half its experts on a node (one thread each side), over loopback and over emulated
/// 10 and 2.5 Gbit/s links (network namespaces, `tc tbf`; needs root), against this process alone on one thread and
/// on two. Per EXPERTS request: bytes each way, the node's compute and this side's wait. BENCH_PP, BENCH_TG as in
/// tests/pipeline.rs. `scripts/gen-test-models.py qwen3moe-bench` writes the model of docs/moe.md.
#[test]
#[ignore]
fn bench_experts_split() {
    let path = std::path::PathBuf::from(std::env::var("BENCH_MODEL").expect("BENCH_MODEL=path of a MoE GGUF"));
    let env = BenchEnv::from_env();
    let (pp, tg) = (env.pp.min(128), env.tg);
    let m = Arc::new(Model::load(&path).unwrap());
    let prompt = prompt(pp);
    let (l1pp, l1tg) = bench_local(&path, 1, &prompt, tg);
    let (l2pp, l2tg) = bench_local(&path, 2, &prompt, tg);
    println!("pp{pp} tg{tg}; alone: 1 thread pp {l1pp:.1} tg {l1tg:.1} t/s, 2 threads pp {l2pp:.1} tg {l2tg:.1} t/s");
    println!(
        "| link | wire | pp t/s | tg t/s | pp vs 1 thread | tg vs 1 thread | decode KiB out/in per request | node ms | \
         wait ms |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let dir = tempfile::tempdir().unwrap();
    let secret = cluster_util::netns::secret_file(&dir);
    for rate in ["loopback", "10gbit", "2500mbit"] {
        let link = match rate {
            "loopback" => None,
            r => match cluster_util::netns::Link::new(r) {
                Some(l) => Some(l),
                None => continue,
            },
        };
        let node = match &link {
            None => NodeProc::spawn(&path, "127.0.0.1:0", &[]),
            Some(l) => NodeProc::try_spawn_in(
                &l.in_b(),
                &path,
                &format!("{}:0", l.b_ip),
                &["--secret-file", secret.to_str().unwrap()],
            )
            .unwrap(),
        };
        for wire in [RowDtype::F32, RowDtype::F16] {
            let cfg = SplitConfig {
                secret: link.as_ref().map(|_| cluster_util::netns::SECRET.as_bytes().to_vec()),
                ..config(&node.addr, wire)
            };
            let measure = || {
                let peer: Arc<dyn RemoteExperts> = Arc::new(ExpertsPeer::connect(cfg, &m).unwrap());
                let mut s = Session::new(m.clone(), Arc::new(ThreadPool::new(1)), pp + tg + 8, 128).unwrap();
                s.set_remote_experts(Some(peer));
                let t0 = std::time::Instant::now();
                let mut tok = argmax(s.forward(Input::Tokens(&prompt), Want::LastLogits).unwrap());
                let pp_s = pp as f64 / t0.elapsed().as_secs_f64();
                let before = snapshot();
                let t0 = std::time::Instant::now();
                for _ in 0..tg {
                    tok = argmax(s.forward(Input::Tokens(&[tok]), Want::LastLogits).unwrap());
                }
                let tg_s = tg as f64 / t0.elapsed().as_secs_f64();
                let after = snapshot();
                let d: Vec<f64> = after.iter().zip(before).map(|(a, b)| (a - b) as f64).collect();
                (pp_s, tg_s, d)
            };
            let (ppt, tgt, d) = match &link {
                None => measure(),
                Some(l) => l.in_a(measure),
            };
            let n = d[0].max(1.0);
            println!(
                "| {rate} | {} | {ppt:.1} | {tgt:.1} | {:.2} | {:.2} | {:.2} / {:.2} | {:.3} | {:.3} |",
                wire.name(),
                ppt / l1pp,
                tgt / l1tg,
                d[1] / n / 1024.0,
                d[2] / n / 1024.0,
                d[3] / n / 1000.0,
                d[4] / n / 1000.0
            );
        }
    }
}

/// Requests, bytes sent, bytes received, node µs, wait µs so far.
fn snapshot() -> [u64; 5] {
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    [
        g(&STATS.requests),
        g(&STATS.bytes_sent),
        g(&STATS.bytes_recv),
        g(&STATS.remote_us),
        g(&STATS.wait_us),
    ]
}
