//! Disaggregated prefill with real `baton-node` processes on loopback: the decode side's greedy output equals the local
//! run (full and partial offload, both models, short and long prompts, multi-turn), and every fault ends in a correct
//! completion through the local fallback.

mod cluster_util;

use baton::cluster::handoff::{HandoffReport, NodeOpts, PrefillNode, prefill_with_fallback};
use baton::cluster::handshake::Timeouts;
use baton::engine::Session;
use baton::engine::snapshot::RowDtype;
use baton::kernels::ThreadPool;
use baton::model::Model;
use cluster_util::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const N_CTX: usize = 1024;

/// Batches of 32 tokens, so a prompt of ~100 tokens already streams several chunks per layer (the machine these tests
/// run on is small; the 1000-token runs are the `#[ignore]`d `long_prompts_match_local`).
fn session(model: &Path) -> Session {
    session_b(model, 32)
}

fn session_b(model: &Path, n_batch: usize) -> Session {
    let m = Arc::new(Model::load(model).unwrap());
    Session::new(m, Arc::new(ThreadPool::new(1)), N_CTX, n_batch).unwrap()
}

fn node_opts(addr: &str, kv: RowDtype, io: u64) -> NodeOpts {
    NodeOpts {
        addr: addr.to_string(),
        secret: None,
        timeouts: Timeouts {
            connect: Duration::from_secs(3),
            io: Duration::from_secs(io),
        },
        kv,
    }
}

/// Greedy continuation after the prompt's logits.
fn decode(s: &mut Session, logits: &[f32], n_gen: usize) -> Vec<u32> {
    let mut toks = vec![argmax(logits)];
    while toks.len() < n_gen {
        let l = s
            .forward(
                baton::engine::Input::Tokens(&[*toks.last().unwrap()]),
                baton::engine::Want::LastLogits,
            )
            .unwrap();
        toks.push(argmax(l));
    }
    toks
}

/// The local reference with the same batching as the decode side.
fn local(model: &Path, prompt: &[u32], n_gen: usize) -> (Vec<f32>, Vec<u32>) {
    local_b(model, prompt, n_gen, 32)
}

fn local_b(model: &Path, prompt: &[u32], n_gen: usize, n_batch: usize) -> (Vec<f32>, Vec<u32>) {
    let mut s = session_b(model, n_batch);
    let logits = s.eval(prompt).unwrap().to_vec();
    let toks = decode(&mut s, &logits, n_gen);
    (logits, toks)
}

fn disagg(
    model: &Path,
    node: &mut PrefillNode,
    prompt: &[u32],
    k: usize,
    n_gen: usize,
) -> (Vec<f32>, Vec<u32>, HandoffReport) {
    disagg_b(model, node, prompt, k, n_gen, 32)
}

fn disagg_b(
    model: &Path,
    node: &mut PrefillNode,
    prompt: &[u32],
    k: usize,
    n_gen: usize,
    n_batch: usize,
) -> (Vec<f32>, Vec<u32>, HandoffReport) {
    let mut s = session_b(model, n_batch);
    let (logits, rep) = prefill_with_fallback(&mut s, Some(node), prompt, k).unwrap();
    let toks = decode(&mut s, &logits, n_gen);
    (logits, toks, rep)
}

fn check_equivalence(model: &Path, n_layer: usize, partial: usize, lens: &[usize], n_batch: usize) {
    let node = NodeProc::spawn(model, "127.0.0.1:0", &[]);
    let mut pn = PrefillNode::new(node_opts(&node.addr, RowDtype::F32, 120));
    for &len in lens {
        let prompt = prompt(len);
        let (ref_logits, ref_toks) = local_b(model, &prompt, 8, n_batch);
        for k in [n_layer, partial] {
            let (logits, toks, rep) = disagg_b(model, &mut pn, &prompt, k, 8, n_batch);
            assert!(rep.fallback.is_none(), "{rep:?}");
            rep.lines()
                .iter()
                .for_each(|l| eprintln!("{len} tokens, {k} layers: {l}"));
            assert_eq!(rep.layers, k);
            assert_eq!(rep.sent, len);
            let d = max_abs_diff(&logits, &ref_logits);
            assert!(d <= 1e-4, "{len} tokens, {k} layers: logits differ by {d}");
            assert_eq!(toks, ref_toks, "{len} tokens, {k} layers: greedy tokens");
            // Every layer's KV crossed the wire at f32: 2 × heads × head_dim × 4 bytes per layer and position.
            let hp = &Model::load(model).unwrap().hp;
            let kv_bytes = (len * k * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 4) as u64;
            assert!(
                rep.bytes > kv_bytes && rep.bytes < kv_bytes + kv_bytes / 2 + 2_000_000,
                "{rep:?}"
            );
        }
    }
}

#[test]
fn smollm2_full_and_partial_offload_match_local() {
    check_equivalence(&smollm2(), 30, 13, &[12, 100], 32);
}

#[test]
fn gemma3_full_and_partial_offload_match_local() {
    // Gemma 3 mixes sliding-window and global layers; the split at 7 puts both kinds on each side.
    check_equivalence(&gemma3(), 18, 7, &[12, 100], 32);
}

/// The generated models of the other architectures (llama with RoPE factors, qwen2, qwen3, qwen3moe, dots1, glm4moe, deepseek2, phi3,
/// and a llama of every i-quant; tests/models/), two layers offloaded (all of most of them) and one.
#[test]
fn new_architectures_full_and_partial_offload_match_local() {
    for name in GENERATED {
        check_equivalence(&model(name), 2, 1, &[12, 100], 32);
    }
}

/// 1000+-token prompts in 512-token batches, both models (minutes on a loaded 2-core machine:
/// `cargo nextest run --test handoff --run-ignored all long`).
#[test]
#[ignore]
fn long_prompts_match_local() {
    check_equivalence(&smollm2(), 30, 13, &[1100], 512);
    check_equivalence(&gemma3(), 18, 7, &[1100], 512);
}

#[test]
fn second_turn_offloads_only_the_new_suffix() {
    let model = smollm2();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let mut pn = PrefillNode::new(node_opts(&node.addr, RowDtype::F32, 60));
    let mut s = session(&model);
    let turn1 = prompt(48);
    let (logits, rep1) = prefill_with_fallback(&mut s, Some(&mut pn), &turn1, 30).unwrap();
    assert_eq!((rep1.held, rep1.sent), (0, 48));
    let gen1 = decode(&mut s, &logits, 6);
    // The decode side fed gen1[..5] through its cache; the prefill node never saw them.
    let mut turn2 = turn1.clone();
    turn2.extend_from_slice(&gen1);
    turn2.extend(prompt(16).iter().map(|t| t + 3));
    let (ref_logits, ref_toks) = local(&model, &turn2, 8);
    for k in [30, 30, 13] {
        let mut s2 = session(&model);
        let (l, _) = prefill_with_fallback(&mut s2, None, &turn1, 0).unwrap();
        decode(&mut s2, &l, 6);
        let (logits2, rep2) = prefill_with_fallback(&mut s2, Some(&mut pn), &turn2, k).unwrap();
        assert!(rep2.fallback.is_none(), "{rep2:?}");
        assert_eq!(rep2.held, 53, "the decode side keeps turn 1 and the tokens it decoded");
        assert_eq!(rep2.sent, turn2.len() - 53, "only the new suffix crosses the wire");
        assert!(max_abs_diff(&logits2, &ref_logits) <= 1e-4);
        assert_eq!(decode(&mut s2, &logits2, 8), ref_toks, "layers {k}");
        // The node caught up on the decoded tokens itself on the first request for this layer range.
        if k == 13 {
            assert_eq!(
                rep2.catch_up, 53,
                "a fresh range on the node recomputes the whole prefix"
            );
        }
    }
    // Same conversation, same session: the node already holds turn 2, nothing to catch up.
    let (_, rep) = prefill_with_fallback(&mut s, Some(&mut pn), &turn1, 30).unwrap();
    assert_eq!(rep.sent, 1, "turn 1 again: only the last token is fed");
}

/// A loopback proxy in front of `upstream`; `hook(offset, bytes)` sees (and may change) every node → client read and
/// returns false to cut both connections.
fn proxy(upstream: String, hook: impl Fn(u64, &mut [u8]) -> bool + Send + Sync + 'static) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let hook = Arc::new(hook);
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut client) = c else { break };
            let Ok(mut up) = TcpStream::connect(&upstream) else {
                continue;
            };
            let (mut c2, mut u2) = (client.try_clone().unwrap(), up.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut u2);
                let _ = u2.shutdown(std::net::Shutdown::Both);
            });
            let hook = hook.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                let mut off = 0u64;
                loop {
                    let n = match up.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if !hook(off, &mut buf[..n]) {
                        break;
                    }
                    off += n as u64;
                    if client.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = client.shutdown(std::net::Shutdown::Both);
                let _ = up.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

fn assert_fallback(
    model: &Path,
    pn: &mut PrefillNode,
    prompt: &[u32],
    k: usize,
    what: &str,
    reference: &(Vec<f32>, Vec<u32>),
) -> HandoffReport {
    let (ref_logits, ref_toks) = reference;
    let (logits, toks, rep) = disagg(model, pn, prompt, k, 6);
    let why = rep
        .fallback
        .clone()
        .unwrap_or_else(|| panic!("{what}: no fallback, {rep:?}"));
    eprintln!("{what}: fell back: {why}");
    assert_eq!(rep.layers, 0);
    assert!(max_abs_diff(&logits, ref_logits) <= 1e-4);
    assert_eq!(&toks, ref_toks, "{what}: completion after the fallback");
    rep
}

#[test]
fn connection_faults_fall_back_to_a_correct_local_prefill() {
    let model = smollm2();
    let prompt = prompt(64);
    let r = local(&model, &prompt, 6);

    // Nobody listening.
    let mut pn = PrefillNode::new(node_opts(&format!("127.0.0.1:{}", free_port()), RowDtype::F32, 5));
    let rep = assert_fallback(&model, &mut pn, &prompt, 30, "node down", &r);
    assert!(rep.fallback.unwrap().contains("connect"));

    // A node that refuses the layer range.
    let pinned = NodeProc::spawn(&model, "127.0.0.1:0", &["--layers", "0:10"]);
    let mut pn = PrefillNode::new(node_opts(&pinned.addr, RowDtype::F32, 5));
    let rep = assert_fallback(&model, &mut pn, &prompt, 30, "refused", &r);
    assert!(rep.fallback.unwrap().contains("serves only 0:10"));
    drop(pinned);

    // A stalled node (stopped): past the 2 s deadline the decode side prefills alone.
    let stalled = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let mut pn = PrefillNode::new(node_opts(&stalled.addr, RowDtype::F32, 2));
    stalled.signal(libc::SIGSTOP);
    let t0 = std::time::Instant::now();
    let rep = assert_fallback(&model, &mut pn, &prompt, 30, "stalled", &r);
    assert!(t0.elapsed() < Duration::from_secs(30));
    assert!(rep.fallback.unwrap().contains("within"));
}

#[test]
fn stream_faults_fall_back_to_a_correct_local_prefill() {
    let model = smollm2();
    let prompt = prompt(64);
    let r = local(&model, &prompt, 6);

    // A byte flipped in flight, inside the KV stream (300 kB in: well past the handshake).
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let at = 300_000u64;
    let flipped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f2 = flipped.clone();
    let corrupt = proxy(node.addr.clone(), move |off, b| {
        if off <= at && at < off + b.len() as u64 && !f2.swap(true, std::sync::atomic::Ordering::SeqCst) {
            b[(at - off) as usize] ^= 0x40;
        }
        true
    });
    let mut pn = PrefillNode::new(node_opts(&corrupt, RowDtype::F32, 10));
    let rep = assert_fallback(&model, &mut pn, &prompt, 30, "corrupt chunk", &r);
    let why = rep.fallback.unwrap();
    assert!(why.contains("checksum") || why.contains("malformed"), "{why}");
    assert!(flipped.load(std::sync::atomic::Ordering::SeqCst));
    // The next request reconnects (through the proxy, which flips only once) and offloads again.
    let (_, _, rep) = disagg(&model, &mut pn, &prompt[..40], 30, 1);
    assert!(rep.fallback.is_none() && rep.layers == 30, "{rep:?}");

    // The node killed mid-stream (after 500 kB of KV reached the proxy).
    let mut victim = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let pid = victim.child.id() as i32;
    let killer = proxy(victim.addr.clone(), move |off, _| {
        if off > 500_000 {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        true
    });
    let mut pn = PrefillNode::new(node_opts(&killer, RowDtype::F32, 10));
    assert_fallback(&model, &mut pn, &prompt, 13, "node killed", &r);
    victim.kill();
}

/// KV at f16 / bf16 / 8 bits on the wire: the first 64 tokens of a real text are prefilled remotely at each precision,
/// then the next 32 are scored locally on top of that KV. Reports the perplexity and logit deltas against f32. The
/// cache holds f16, so f16 on the wire is exact and the narrower ones are not.
#[test]
fn narrower_kv_on_the_wire_stays_close() {
    let model = smollm2();
    let m = Arc::new(Model::load(&model).unwrap());
    let vocab = baton::vocab::Vocab::from_gguf(&m.file).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/ppl-text.txt")).unwrap();
    let toks = vocab.tokenize(&text, true, false);
    let (head, tail) = (&toks[..64], &toks[64..96]);
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let score = |kv: RowDtype| -> (f64, Vec<f32>, u64) {
        let mut pn = PrefillNode::new(node_opts(&node.addr, kv, 60));
        let mut s = session(&model);
        let (_, rep) = prefill_with_fallback(&mut s, Some(&mut pn), head, 30).unwrap();
        assert!(rep.fallback.is_none(), "{rep:?}");
        let n_vocab = m.hp.n_vocab;
        let out = s
            .forward(baton::engine::Input::Tokens(tail), baton::engine::Want::AllLogits)
            .unwrap()
            .to_vec();
        let mut nll = 0.0;
        for j in 0..tail.len() - 1 {
            let row = &out[j * n_vocab..(j + 1) * n_vocab];
            nll += baton::kernels::ops::log_sum_exp(row) - row[tail[j + 1] as usize] as f64;
        }
        ((nll / (tail.len() - 1) as f64).exp(), out, rep.bytes)
    };
    let (ppl32, logits32, bytes32) = score(RowDtype::F32);
    for (kv, max_rel) in [(RowDtype::F16, 0.0), (RowDtype::BF16, 0.03), (RowDtype::Q8, 0.05)] {
        let (ppl, logits, bytes) = score(kv);
        let d = max_abs_diff(&logits, &logits32);
        let rel = (ppl - ppl32) / ppl32;
        eprintln!(
            "kv {}: perplexity {ppl:.4} vs f32 {ppl32:.4} ({:+.3}%), max logit delta {d:.4}, {bytes} bytes vs {bytes32}",
            kv.name(),
            rel * 100.0
        );
        if kv == RowDtype::F16 {
            assert_eq!(d, 0.0, "f16 on the wire carries the f16 cache exactly");
        } else {
            assert!(d > 0.0, "{kv:?} is lossy");
        }
        assert!(rel.abs() <= max_rel, "{kv:?}: perplexity moved by {:.2}%", rel * 100.0);
        assert!(bytes < bytes32 * 6 / 10, "{kv:?}: {bytes} bytes vs {bytes32} at f32");
    }
}

/// TTFT local (1 thread) vs disaggregated (prefill node with 2 threads) on loopback, for the table in
/// docs/disaggregation.md: `BATON_BENCH_LENS=512,1024,2048 cargo nextest run --test handoff --run-ignored all
/// bench_ttft --no-capture` (the lengths default to 512,1024).
#[test]
#[ignore]
fn bench_ttft_loopback() {
    use baton::cluster::disagg::{Job, Offload, Speeds, learn, plan};
    let model = smollm2();
    let lens: Vec<usize> = std::env::var("BATON_BENCH_LENS")
        .unwrap_or_else(|_| "512,1024".into())
        .split(',')
        .map(|x| x.trim().parse().unwrap())
        .collect();
    let max = *lens.iter().max().unwrap();
    let ctx = (max + 64).to_string();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &["-t", "2", "-c", &ctx]);
    let m = Arc::new(Model::load(&model).unwrap());
    let hp = m.hp.clone();
    let new_session = || Session::new(m.clone(), Arc::new(ThreadPool::new(1)), max + 64, 512).unwrap();
    let mut speeds = Speeds::for_model(&hp);
    println!(
        "| prompt | local 1 thread | full offload | 50% offload | auto (k) | full: remote / exposed / handoff | KV bytes | link rate |"
    );
    println!("|---:|---:|---:|---:|---:|---|---:|---:|");
    for &n in &lens {
        let prompt = prompt(n);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let run = |k: usize| -> HandoffReport {
            let mut s = new_session();
            let mut pn = PrefillNode::new(node_opts(&node.addr, RowDtype::F32, 120));
            let (_, rep) = prefill_with_fallback(&mut s, Some(&mut pn), &prompt, k).unwrap();
            assert!(rep.fallback.is_none(), "{rep:?}");
            rep
        };
        let local = run(0);
        learn(&mut speeds, &local);
        let full = run(hp.n_layer);
        learn(&mut speeds, &full);
        let half = run(hp.n_layer / 2);
        learn(&mut speeds, &half);
        let job = Job {
            n_layer: hp.n_layer,
            start: 0,
            n,
            catch_up: 0,
            chunk: 512,
            kv_bytes: (hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 4) as f64,
            hidden_bytes: (hp.n_embd * 4) as f64,
        };
        let (k, why) = plan(Offload::Auto, &speeds, &job);
        eprintln!("{n} tokens: {why}");
        let auto = run(k);
        println!(
            "| {n} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms ({k}) | {:.0} / {:.0} / {:.0} ms | {:.1} MB | {:.0} MB/s |",
            ms(local.total),
            ms(full.total),
            ms(half.total),
            ms(auto.total),
            ms(full.remote),
            ms(full.exposed),
            ms(full.handoff),
            full.bytes as f64 / 1e6,
            full.link_rate / 1e6
        );
    }
}

/// `baton demo`: both nodes as child processes, the disaggregated completion identical to the local one, the TTFT
/// breakdown shown, and the prefill node gone afterwards.
#[test]
fn demo_runs_and_cleans_up() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["demo", "-m"])
        .arg(smollm2())
        .args(["-p", "80", "-n", "4", "--prefill-threads", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("completions identical"), "{stdout}");
    assert!(
        stdout.contains("exposed transfer") && stdout.contains("link rate"),
        "{stdout}"
    );
    let addr = stdout
        .lines()
        .find_map(|l| l.strip_prefix("prefill node listening on "))
        .expect("the demo names its node");
    assert!(
        TcpStream::connect(addr.trim()).is_err(),
        "the prefill node outlived the demo"
    );
}

/// `baton run --prefill-node` end to end, and its fallback when the node is gone.
#[test]
fn run_with_a_prefill_node() {
    let model = smollm2();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let run = |addr: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["run", "-m"])
            .arg(&model)
            .args([
                "-t",
                "1",
                "-c",
                "256",
                "-b",
                "32",
                "--temp",
                "0",
                "-n",
                "6",
                "-v",
                "--offload-layers",
                "20",
            ])
            .args(["--prefill-node", addr, "--prefill-timeout", "5"])
            .arg("The capital of France is a city that")
            .output()
            .unwrap();
        assert!(out.status.success());
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (a, err_a) = run(&node.addr);
    assert!(err_a.contains("prefill: layers 0..20 of 30 remote"), "{err_a}");
    assert!(err_a.contains("ttft:") && !err_a.contains("warning"), "{err_a}");
    let (b, err_b) = run(&format!("127.0.0.1:{}", free_port()));
    assert!(err_b.contains("warning: disaggregated prefill on"), "{err_b}");
    assert_eq!(a, b, "the fallback gives the same greedy completion");
}

/// `baton run` with the given arguments (greedy, 8 tokens, batches of 32): (status ok, stdout, stderr).
fn baton_run(model: &Path, extra: &[&str], prompt: &str) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["run", "-m"])
        .arg(model)
        .args(["-t", "1", "-c", "256", "-b", "32", "--temp", "0", "-n", "8", "-v"])
        .args(extra)
        .arg(prompt)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const LONG_PROMPT: &str = "The history of the city begins with a small settlement on the river, where traders from \
    the north met farmers from the south and exchanged grain, salt and stories about the sea that none of them";

/// Runs `LONG_PROMPT` locally, then with decode node `d` pulling from prefill node `p`, full (`always`) and partial
/// (`40%`) offload: the greedy text must be the local one, with no fallback. Returns the local text.
fn remote_decode_matches_local(model: &Path, p: &NodeProc, d: &NodeProc, n_layer: usize, extra: &[&str]) -> String {
    let (ok, local, err) = baton_run(model, &[], LONG_PROMPT);
    assert!(ok, "{err}");
    let partial = (n_layer as f32 * 0.4).round() as usize;
    for (offload, k) in [("always", n_layer), ("40%", partial)] {
        let args = [
            &[
                "--decode-node",
                &d.addr,
                "--prefill-node",
                &p.addr,
                "--offload",
                offload,
            ],
            extra,
        ]
        .concat();
        let (ok, out, err) = baton_run(model, &args, LONG_PROMPT);
        assert!(ok, "{err}");
        let want = format!("layers 0..{k} of {n_layer} remote");
        assert!(err.contains(&want) && !err.contains("fallback"), "{err}");
        assert!(
            err.contains("plan (decode node)") && err.contains("exposed transfer"),
            "{err}"
        );
        assert_eq!(out, local, "offload {offload}: greedy output of the remote decode node");
    }
    local
}

/// Protocol 3: the decode node is remote. The coordinator names the prefill node; the decode node pulls the KV from
/// it (authenticating with its own secret) and decodes. Greedy output equals the local run for full and partial
/// offload; a decode node that does not know the prefill node's secret falls back to its own prefill, same output.
#[test]
fn remote_decode_node_pulls_the_kv_and_matches_local() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k");
    std::fs::write(&key, "a-long-enough-secret\n").unwrap();
    let wrong = dir.path().join("w");
    std::fs::write(&wrong, "another-long-secret!\n").unwrap();
    let key_s = key.to_str().unwrap();
    let p = NodeProc::spawn(&model, "127.0.0.1:0", &["--secret-file", key_s]);
    let d = NodeProc::spawn(&model, "127.0.0.1:0", &["--secret-file", key_s]);
    let local = remote_decode_matches_local(&model, &p, &d, 30, &["--secret-file", key_s]);
    assert!(d.log().contains("opened session"), "{}", d.log());
    // A decode node with another secret: the prefill node refuses it, it prefills alone, same text.
    let d2 = NodeProc::spawn(&model, "127.0.0.1:0", &["--secret-file", wrong.to_str().unwrap()]);
    let args = [
        "--decode-node",
        &d2.addr,
        "--prefill-node",
        &p.addr,
        "--secret-file",
        wrong.to_str().unwrap(),
    ];
    let (ok, out, err) = baton_run(&model, &args, LONG_PROMPT);
    assert!(ok, "{err}");
    assert!(err.contains("prefill: local") && err.contains("fallback"), "{err}");
    assert!(err.contains("authentication failed"), "{err}");
    assert!(d2.log().contains("warning: disaggregated prefill on"), "{}", d2.log());
    assert_eq!(out, local);
}

/// The prefill node killed mid-stream while a remote decode node pulls from it: the decode node falls back to its
/// own prefill and the completion is the local one.
#[test]
fn remote_decode_survives_the_prefill_node_dying_mid_stream() {
    let model = smollm2();
    let mut victim = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let d = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let pid = victim.child.id() as i32;
    let killed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let k2 = killed.clone();
    let killer = proxy(victim.addr.clone(), move |off, _| {
        if off > 300_000 {
            unsafe { libc::kill(pid, libc::SIGKILL) };
            k2.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        true
    });
    let (ok, local, err) = baton_run(&model, &[], LONG_PROMPT);
    assert!(ok, "{err}");
    let args = [
        "--decode-node",
        &d.addr,
        "--prefill-node",
        &killer,
        "--offload",
        "always",
        "--prefill-timeout",
        "5",
    ];
    let t0 = std::time::Instant::now();
    let (ok, out, err) = baton_run(&model, &args, LONG_PROMPT);
    assert!(ok, "{err}");
    assert!(
        killed.load(std::sync::atomic::Ordering::SeqCst),
        "the stream passed 300 kB"
    );
    assert!(err.contains("prefill: local") && err.contains("fallback"), "{err}");
    assert_eq!(out, local, "the completion after the fallback");
    assert!(t0.elapsed() < Duration::from_secs(50));
    victim.kill();
}

/// A decode node asked to pull from itself prefills the prompt itself at once (pulling from its own socket would
/// wait on its own compute lock until the prefill timeout), and says so; the text is the local run's.
#[test]
fn a_decode_node_named_as_its_own_prefill_node_prefills_itself() {
    let model = smollm2();
    let d = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let (ok, local, err) = baton_run(&model, &[], LONG_PROMPT);
    assert!(ok, "{err}");
    let args = [
        "--decode-node",
        &d.addr,
        "--prefill-node",
        &d.addr,
        "--offload",
        "always",
        "--prefill-timeout",
        "120",
    ];
    let t0 = std::time::Instant::now();
    let (ok, out, err) = baton_run(&model, &args, LONG_PROMPT);
    assert!(ok, "{err}");
    assert!(err.contains("the prefill node named is this node"), "{err}");
    assert_eq!(out, local);
    assert!(
        t0.elapsed() < Duration::from_secs(100),
        "it did not wait for the prefill timeout"
    );
}

/// Gemma 3 with a remote decode node: full and partial offload (sliding-window and global layers on both sides of
/// the split) give the local run's greedy text.
#[test]
fn gemma3_remote_decode_matches_local() {
    let model = gemma3();
    let p = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let d = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    remote_decode_matches_local(&model, &p, &d, 18, &[]);
}
