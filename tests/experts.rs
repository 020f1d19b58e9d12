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
