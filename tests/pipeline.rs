//! The layer-split pipeline with real `baton-node` processes on loopback: equivalence with the local run, handshake
//! refusals that name the difference, authentication, garbage frames, and a stage killed or stalled mid-decode.

mod cluster_util;

use baton::cluster::wire::{self, Msg};
use baton::cluster::{PipelineOpts, PipelineSession};
use baton::engine::snapshot::RowDtype;
use cluster_util::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Prompt logits and greedy tokens of SmolLM2 through a pipeline.
fn pipeline_run(spec: &str, o: PipelineOpts, prompt: &[u32], n_gen: usize) -> (Vec<f32>, Vec<u32>, PipelineSession) {
    pipeline_run_on(&smollm2(), spec, o, prompt, n_gen)
}

/// Prompt logits and greedy tokens of `model` through a pipeline.
fn pipeline_run_on(
    model: &std::path::Path,
    spec: &str,
    o: PipelineOpts,
    prompt: &[u32],
    n_gen: usize,
) -> (Vec<f32>, Vec<u32>, PipelineSession) {
    let mut p = PipelineSession::connect(spec, model, o).unwrap();
    let logits = p.eval_logits(prompt).unwrap();
    let mut toks = vec![argmax(&logits)];
    while toks.len() < n_gen {
        let s = p.decode_step(*toks.last().unwrap()).unwrap();
        assert_eq!(s.top[0].0, s.token, "greedy picks the top log-probability");
        toks.push(s.token);
    }
    (logits, toks, p)
}

#[test]
fn two_and_three_stages_match_the_local_run() {
    let model = smollm2();
    let prompt = prompt(40); // 3 chunks of 16: the pipelined prefill path
    let (ref_logits, ref_toks) = local_reference(&model, &prompt, 8);
    let a = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let b = NodeProc::spawn(&model, "127.0.0.1:0", &[]);

    let spec2 = format!("{}=0:13,{}=13:end", a.addr, b.addr);
    let (logits, toks, p) = pipeline_run(&spec2, pipeline_opts(), &prompt, 8);
    let d = max_abs_diff(&logits, &ref_logits);
    assert!(d <= 1e-4, "2 stages: logits differ by {d}");
    assert_eq!(toks, ref_toks, "2 stages: greedy tokens");
    let st = p.stats();
    assert_eq!(st.len(), 2);
    assert!(
        st.iter()
            .all(|s| s.requests == 3 + 7 && s.tokens == 47 && s.bytes_sent > 0)
    );
    // A decode step moves one hidden row per boundary; the last stage returns a token, not logits.
    let mut p = p;
    p.reset_stats();
    p.decode_step(*toks.last().unwrap()).unwrap();
    let st = p.stats();
    assert!(st[0].bytes_recv > 2304 && st[0].bytes_recv < 2304 + 100, "{st:?}");
    assert!(st[1].bytes_recv < 100, "{st:?}");
    drop(p);

    // Three stages, the coordinator owning the middle range.
    let spec3 = format!("{}=0:7,local=7:21,{}=21:end", a.addr, b.addr);
    let (logits, toks, _p) = pipeline_run(&spec3, pipeline_opts(), &prompt, 8);
    let d = max_abs_diff(&logits, &ref_logits);
    assert!(d <= 1e-4, "3 stages: logits differ by {d}");
    assert_eq!(toks, ref_toks, "3 stages: greedy tokens");

    // Three remote stages, the coordinator owning nothing; the first node serves two sessions' ranges.
    let c = NodeProc::spawn(&model, "127.0.0.1:0", &["--layers", "20:30"]);
    let spec3r = format!("{}=0:10,{}=10:20,{}=20:end", a.addr, b.addr, c.addr);
    let (logits, toks, mut p) = pipeline_run(&spec3r, pipeline_opts(), &prompt, 8);
    assert!(max_abs_diff(&logits, &ref_logits) <= 1e-4);
    assert_eq!(toks, ref_toks);

    // Rewind costs nothing on the wire and gives the same continuation again.
    p.rewind(prompt.len() + 2);
    let s = p.decode_step(toks[2]).unwrap();
    assert_eq!(s.token, toks[3]);
    assert_eq!(p.replays(), 0);
}

/// The generated models of the other architectures (llama with RoPE factors, qwen2, qwen3, qwen3moe, dots1, glm4moe, deepseek2, phi3, and a llama of every i-quant; tests/models/)
/// over two stages, a node's layer then the coordinator's, give the local run's logits and greedy tokens.
#[test]
fn new_architectures_two_stages_match_the_local_run() {
    for name in GENERATED {
        let model = model(name);
        let prompt = prompt(40);
        let (ref_logits, ref_toks) = local_reference(&model, &prompt, 8);
        let a = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
        let spec = format!("{}=0:1,local=1:end", a.addr);
        let (logits, toks, _p) = pipeline_run_on(&model, &spec, pipeline_opts(), &prompt, 8);
        let d = max_abs_diff(&logits, &ref_logits);
        assert!(d <= 1e-4, "{name}, 2 stages: logits differ by {d}");
        assert_eq!(toks, ref_toks, "{name}, 2 stages: greedy tokens");
    }
}

#[test]
fn narrower_wire_stays_close() {
    let model = smollm2();
    let prompt = prompt(24);
    let (ref_logits, ref_toks) = local_reference(&model, &prompt, 4);
    let a = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    for (wire, tol) in [(RowDtype::F16, 2.0), (RowDtype::BF16, 4.0), (RowDtype::Q8, 4.0)] {
        let spec = format!("{}=0:15,local=15:end", a.addr);
        let (logits, toks, p) = pipeline_run(
            &spec,
            PipelineOpts {
                wire,
                ..pipeline_opts()
            },
            &prompt,
            4,
        );
        let d = max_abs_diff(&logits, &ref_logits);
        eprintln!("{wire:?}: prompt logits differ from local by at most {d}");
        assert!(d > 0.0, "{wire:?} should not be lossless");
        assert!(d <= tol, "{wire:?}: logits differ by {d}");
        // The first greedy token may flip only between near-tied candidates.
        let top = ref_toks[0] as usize;
        assert!(
            ref_logits[top] - ref_logits[toks[0] as usize] <= 2.0 * tol,
            "{wire:?}: greedy token {}",
            toks[0]
        );
        // Hidden bytes from the first stage: 24 + 3 tokens' rows at the wire's row size.
        let hidden_bytes = 27 * wire.row_bytes(576) as u64;
        let recv = p.stats()[0].bytes_recv;
        assert!(
            recv > hidden_bytes && recv < hidden_bytes + 2048,
            "{wire:?}: {recv} bytes received"
        );
    }
}

#[test]
fn handshake_mismatch_is_refused_with_the_difference_named() {
    let gemma = NodeProc::spawn(&gemma3(), "127.0.0.1:0", &[]);
    let e = PipelineSession::connect(
        &format!("{}=0:15,local=15:end", gemma.addr),
        &smollm2(),
        pipeline_opts(),
    )
    .err()
    .expect("a node with another model must be refused")
    .to_string();
    assert!(
        e.contains("fingerprint") && e.contains("(gemma3)") && e.contains("(llama)"),
        "{e}"
    );
    assert!(e.contains("has n_layer 30, this node has 18"), "{e}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        gemma.log().contains("dropped connection"),
        "the node logs the refusal:\n{}",
        gemma.log()
    );

    let pinned = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &["--layers", "0:10"]);
    let e = PipelineSession::connect(
        &format!("{}=0:15,local=15:end", pinned.addr),
        &smollm2(),
        pipeline_opts(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("asks for layers 0:15, this node serves only 0:10"), "{e}");
    let e = PipelineSession::connect(
        &format!("{}=0:14,local=15:end", pinned.addr),
        &smollm2(),
        pipeline_opts(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("layers 14 are not covered"), "{e}");
    let e = PipelineSession::connect(
        &format!("{}=0:10,local=10:end", pinned.addr),
        &smollm2(),
        PipelineOpts {
            n_ctx: 100_000,
            ..pipeline_opts()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("context of 100000"), "{e}");
}

#[test]
fn authentication_is_required_off_loopback_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "correct horse battery staple\n").unwrap();
    let model = smollm2();

    let log = NodeProc::try_spawn(&model, "0.0.0.0:0", &[])
        .err()
        .expect("no secret off loopback");
    assert!(log.contains("refusing to listen on 0.0.0.0"), "{log}");

    let port = free_port();
    let node = NodeProc::spawn(
        &model,
        &format!("0.0.0.0:{port}"),
        &["--secret-file", secret.to_str().unwrap()],
    );
    let spec = format!("127.0.0.1:{port}=0:15,local=15:end");
    let e = PipelineSession::connect(&spec, &model, pipeline_opts())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("requires a shared secret"), "{e}");
    let wrong = PipelineOpts {
        secret: Some(b"wrong horse battery staple".to_vec()),
        ..pipeline_opts()
    };
    let e = PipelineSession::connect(&spec, &model, wrong)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(node.log().contains("wrong shared secret"), "{}", node.log());

    let right = PipelineOpts {
        secret: Some(b"correct horse battery staple".to_vec()),
        ..pipeline_opts()
    };
    let mut p = PipelineSession::connect(&spec, &model, right).unwrap();
    let s = p.eval(&prompt(8)).unwrap();
    let (_, ref_toks) = local_reference(&model, &prompt(8), 1);
    assert_eq!(s.token, ref_toks[0]);

    // A coordinator with a secret does not trust a node that cannot prove it knows it.
    let open = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let with = PipelineOpts {
        secret: Some(b"correct horse battery staple".to_vec()),
        ..pipeline_opts()
    };
    let e = PipelineSession::connect(&format!("{}=0:15,local=15:end", open.addr), &model, with)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cannot prove"), "{e}");
}

#[test]
fn garbage_frames_drop_only_their_connection() {
    let model = smollm2();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let spec = format!("{}=0:15,local=15:end", node.addr);
    let mut p = PipelineSession::connect(&spec, &model, pipeline_opts()).unwrap();
    let first = p.eval(&prompt(12)).unwrap();

    // A peer that connects and says nothing must not block anyone.
    let _silent = TcpStream::connect(&node.addr).unwrap();
    let mut head = [0u8; wire::HEADER_LEN];
    head[..4].copy_from_slice(&wire::MAGIC);
    head[4] = wire::VERSION;
    head[5] = wire::ty::HELLO;
    let huge = {
        let mut h = head;
        h[5] = wire::ty::FORWARD;
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        h.to_vec()
    };
    let truncated = {
        let mut h = head;
        h[8..12].copy_from_slice(&32u32.to_le_bytes());
        let mut v = h.to_vec();
        v.extend_from_slice(&[1, 2, 3]);
        v
    };
    let bad_version = {
        let mut h = head;
        h[4] = 9;
        h.to_vec()
    };
    let junk: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    for (name, bytes) in [
        ("http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        ("huge length", huge),
        ("truncated", truncated),
        ("bad version", bad_version),
        ("junk", junk),
    ] {
        let mut s = TcpStream::connect(&node.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        let t0 = Instant::now();
        let _ = s.read_to_end(&mut reply);
        assert!(
            t0.elapsed() < Duration::from_secs(9),
            "{name}: the node must drop the connection"
        );
        if name == "bad version" {
            let (m, _) = wire::read_msg(&mut &reply[..]).unwrap();
            assert!(
                matches!(m, Msg::Error { ref message } if message.contains("version 9")),
                "{m:?}"
            );
        }
    }
    // A garbage frame in the middle of a session (after a valid handshake) drops that connection only.
    let mut raw = TcpStream::connect(&node.addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    wire::write_msg(&mut raw, &Msg::Hello { nonce: [1; 32] }).unwrap();
    assert!(matches!(wire::read_msg(&mut raw).unwrap().0, Msg::Challenge { .. }));
    raw.write_all(b"BTON\x01\x03\x00\x00\xff\xff\xff\x7f").unwrap();
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest);

    // The session still works, on the same connection, and new ones can open.
    let next = p.decode_step(first.token).unwrap();
    let (_, ref_toks) = local_reference(&model, &prompt(12), 2);
    assert_eq!([first.token, next.token], ref_toks[..]);
    let mut q = PipelineSession::connect(&spec, &model, pipeline_opts()).unwrap();
    assert_eq!(q.eval(&prompt(12)).unwrap().token, ref_toks[0]);
    assert_eq!(p.stats()[0].reconnects, 0);
    let log = node.log();
    assert!(log.contains("magic") && log.contains("exceeds the limit"), "{log}");
}

#[test]
fn killed_stage_mid_decode_errors_then_recovers_after_restart() {
    let model = smollm2();
    let prompt = prompt(20);
    let (_, ref_toks) = local_reference(&model, &prompt, 10);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut b = NodeProc::spawn(&model, &listen, &[]);
    let a = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let spec = format!("{}=0:10,{listen}=10:end", a.addr);
    let mut p = PipelineSession::connect(
        &spec,
        &model,
        PipelineOpts {
            verbose: true,
            ..pipeline_opts()
        },
    )
    .unwrap();
    let mut toks = vec![p.eval(&prompt).unwrap().token];
    for _ in 0..4 {
        toks.push(p.decode_step(*toks.last().unwrap()).unwrap().token);
    }

    b.kill();
    let t0 = Instant::now();
    let e = p
        .decode_step(*toks.last().unwrap())
        .expect_err("a dead stage must fail the step")
        .to_string();
    assert!(t0.elapsed() < Duration::from_secs(10), "error took {:?}", t0.elapsed());
    assert!(e.contains(&listen), "the error names the stage: {e}");
    assert_eq!(p.n_past(), prompt.len() + 4, "a failed step changes nothing");
    // While it is down, the next request fails fast too.
    let e = p.decode_step(*toks.last().unwrap()).err().unwrap().to_string();
    assert!(e.contains("cannot connect") && e.contains(&listen), "{e}");

    let _b = NodeProc::spawn(&model, &listen, &[]);
    // The restarted stage has no KV: it answers mismatch, the coordinator replays, decoding goes on exactly.
    while toks.len() < 10 {
        toks.push(p.decode_step(*toks.last().unwrap()).unwrap().token);
    }
    assert_eq!(toks, ref_toks);
    assert_eq!(p.replays(), 1);
    assert!(p.stats()[1].reconnects >= 1);
}

#[test]
fn stalled_stage_times_out_then_continues() {
    let model = smollm2();
    let prompt = prompt(16);
    let (_, ref_toks) = local_reference(&model, &prompt, 6);
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let spec = format!("local=0:15,{}=15:end", node.addr);
    let mut p = PipelineSession::connect(&spec, &model, pipeline_opts()).unwrap();
    let mut toks = vec![p.eval(&prompt).unwrap().token];
    toks.push(p.decode_step(toks[0]).unwrap().token);

    p.set_io_timeout(Duration::from_secs(2));
    node.signal(libc::SIGSTOP);
    let t0 = Instant::now();
    let e = p
        .decode_step(toks[1])
        .expect_err("a stalled stage must fail the step")
        .to_string();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(5),
        "took {took:?}"
    );
    assert!(e.contains("did not answer") && e.contains(&node.addr), "{e}");
    node.signal(libc::SIGCONT);

    p.set_io_timeout(Duration::from_secs(20));
    while toks.len() < 6 {
        toks.push(p.decode_step(*toks.last().unwrap()).unwrap().token);
    }
    assert_eq!(toks, ref_toks);
}

/// `cargo test --release --test pipeline bench_loopback -- --ignored --nocapture`: pp/tg through 1, 2, 3 stages on
/// loopback against the local run, and decode bytes per token at each wire width. BENCH_PP, BENCH_TG, BENCH_THREADS.
#[test]
#[ignore]
fn bench_loopback() {
    let BenchEnv {
        pp,
        tg,
        threads: t,
        chunks,
    } = BenchEnv::from_env();
    let model = smollm2();
    let prompt = prompt(pp);
    let ts = t.to_string();
    let nodes: Vec<NodeProc> = (0..3)
        .map(|_| NodeProc::spawn(&model, "127.0.0.1:0", &["-t", &ts, "-c", "2048"]))
        .collect();
    let (lpp, ltg) = bench_local(&model, t, &prompt, tg);
    println!("threads per stage {t}, pp{pp} tg{tg}");
    println!("| setup | chunk | pp t/s | tg t/s | pp vs local | tg vs local |");
    println!("|---|---|---|---|---|---|");
    println!("| local | 512 | {lpp:.1} | {ltg:.1} | 1.00 | 1.00 |");
    let specs = [
        ("1 stage (remote)", format!("{}=0:end", nodes[0].addr)),
        (
            "2 stages (remote+remote)",
            format!("{}=0:15,{}=15:end", nodes[0].addr, nodes[1].addr),
        ),
        (
            "2 stages (remote+local)",
            format!("{}=0:15,local=15:end", nodes[0].addr),
        ),
        (
            "3 stages (remote x3)",
            format!(
                "{}=0:10,{}=10:20,{}=20:end",
                nodes[0].addr, nodes[1].addr, nodes[2].addr
            ),
        ),
    ];
    for (name, spec) in &specs {
        for chunk in chunks.iter().copied() {
            let o = PipelineOpts {
                n_ctx: 2048,
                chunk,
                threads: t,
                top_k: 0,
                ..pipeline_opts()
            };
            let (ppp, ptg, _) = bench_pipeline(spec, &model, o, &prompt, tg);
            println!(
                "| {name} | {chunk} | {ppp:.1} | {ptg:.1} | {:.2} | {:.2} |",
                ppp / lpp,
                ptg / ltg
            );
        }
    }
    println!();
    println!("| wire | decode bytes/token (2 remote stages, all frames) | hidden payload/boundary |");
    println!("|---|---|---|");
    for wire in [RowDtype::F32, RowDtype::F16, RowDtype::BF16, RowDtype::Q8] {
        let o = PipelineOpts {
            n_ctx: 2048,
            chunk: 128,
            threads: t,
            top_k: 0,
            wire,
            ..pipeline_opts()
        };
        let (_, _, st) = bench_pipeline(&specs[1].1, &model, o, &prompt[..64], 32);
        println!(
            "| {} | {:.0} | {} |",
            wire.name(),
            bytes_per_token(&st, 32),
            wire.row_bytes(576)
        );
    }
}

/// Perplexity through 2 stages at each wire width against the local run, on the token ids in BENCH_TOKENS (a file of
/// whitespace-separated ids), scored in chunks of BENCH_CTX (256) tokens, every token after the first.
#[test]
#[ignore]
fn bench_perplexity() {
    let Some(path) = std::env::var_os("BENCH_TOKENS") else {
        eprintln!("SKIPPED: set BENCH_TOKENS to a file of token ids");
        return;
    };
    let ctx: usize = std::env::var("BENCH_CTX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let ids: Vec<u32> = std::fs::read_to_string(path)
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    let chunks: Vec<&[u32]> = ids.chunks_exact(ctx).take(8).collect();
    let model = smollm2();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &["-c", "2048"]);
    let nll = |logits: &[f32], toks: &[u32]| -> f64 {
        let v = logits.len() / toks.len();
        let mut s = 0.0;
        for i in 0..toks.len() - 1 {
            let row = &logits[i * v..(i + 1) * v];
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let lse = m as f64 + row.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln();
            s += lse - row[toks[i + 1] as usize] as f64;
        }
        s
    };
    let n_scored = (chunks.len() * (ctx - 1)) as f64;
    let local = {
        let m = std::sync::Arc::new(baton::model::Model::load(&model).unwrap());
        let mut s =
            baton::engine::Session::new(m, std::sync::Arc::new(baton::kernels::ThreadPool::new(1)), ctx, ctx).unwrap();
        let mut tot = 0.0;
        for c in &chunks {
            s.rewind(0);
            tot += nll(
                s.forward(baton::engine::Input::Tokens(c), baton::engine::Want::AllLogits)
                    .unwrap(),
                c,
            );
        }
        (tot / n_scored).exp()
    };
    println!("{} chunks of {ctx} tokens; local perplexity {local:.4}", chunks.len());
    println!("| wire | perplexity | delta vs local |");
    println!("|---|---|---|");
    let wires = std::env::var("BENCH_WIRES").unwrap_or("32,16,bf16,8".into());
    for wire in wires.split(',').map(|w| RowDtype::parse(w).unwrap()) {
        let o = PipelineOpts {
            n_ctx: ctx,
            chunk: 128,
            wire,
            ..pipeline_opts()
        };
        let mut p = PipelineSession::connect(&format!("{}=0:15,local=15:end", node.addr), &model, o).unwrap();
        let mut tot = 0.0;
        for c in &chunks {
            p.rewind(0);
            tot += nll(&p.eval_all_logits(c).unwrap(), c);
        }
        let ppl = (tot / n_scored).exp();
        println!(
            "| {} | {ppl:.4} | {:+.4} ({:+.3}%) |",
            wire.name(),
            ppl - local,
            100.0 * (ppl / local - 1.0)
        );
    }
}

#[test]
fn bench_command_measures_through_a_pipeline() {
    let node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &["--threads", "1"]);
    let spec = format!("{}=0:15,local=15:end", node.addr);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["bench", "-m"])
        .arg(smollm2())
        .args([
            "--pipeline",
            &spec,
            "-p",
            "32",
            "-n",
            "8",
            "-r",
            "2",
            "-t",
            "1",
            "--json",
            "--wire-bits",
            "16",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let figures: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tests: Vec<&str> = figures.iter().map(|f| f["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp32", "tg8"]);
    for f in &figures {
        assert!(f["tps_median"].as_f64().unwrap() > 0.0);
        assert_eq!(f["samples"].as_array().unwrap().len(), 2);
    }
    // Per-stage bytes on the wire: f16 hidden states, one boundary each way per token.
    assert!(stderr.contains("bytes/token on the wire"), "{stderr}");
}

/// The last stage runs the engine's own sampler: with the same seed, a pipelined run samples exactly the tokens a
/// local run samples (temperature, top-k, top-p, min-p and the repetition penalty all travel in OPEN), and a second
/// request with other settings reuses the stages' KV.
#[test]
fn sampled_pipeline_output_equals_the_local_run_with_the_same_seed() {
    use baton::engine::sampler::SamplerParams;
    use baton::generate::{GenParams, Generator, LocalGenerator, Prompt};
    use baton::topology::PipelineGenerator;
    use std::sync::Arc;
    let node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &["--threads", "1"]);
    let model = Arc::new(baton::model::Model::load(&smollm2()).unwrap());
    let pool = Arc::new(baton::kernels::ThreadPool::new(1));
    let mut local = LocalGenerator::new(model, pool, 512, 16).unwrap();
    let mut piped = PipelineGenerator::connect(
        &format!("{}=0:12,local=12:end", node.addr),
        &smollm2(),
        pipeline_opts(),
        None,
    )
    .unwrap();
    let prompt = Prompt::Text("List some fruits: apple, banana,".into());
    let run = |g: &mut dyn Generator, sampler: SamplerParams| {
        let mut ids = Vec::new();
        let p = GenParams {
            max_tokens: 24,
            sampler,
            top_logprobs: 0,
            ..Default::default()
        };
        let o = g
            .generate(&prompt, &p, &mut |piece| {
                ids.extend(piece.token);
                true
            })
            .unwrap();
        (ids, o.cached_tokens)
    };
    for (i, sampler) in [
        SamplerParams {
            temp: 0.9,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.3,
            repeat_last_n: 16,
            seed: Some(11),
        },
        SamplerParams {
            temp: 1.2,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: Some(12),
        },
    ]
    .into_iter()
    .enumerate()
    {
        let (want, _) = run(&mut local, sampler);
        let (got, cached) = run(&mut piped, sampler);
        assert_eq!(got, want, "settings #{i}");
        if i == 1 {
            assert!(cached > 0, "the second request reuses the stages' KV");
        }
    }
}

/// Greedy text of `baton run --pipeline ADDR=0:end` (the whole model on one node): `n` tokens of `prompt`.
fn run_on_node(addr: &str, prompt: &str, n: usize) -> String {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["run", "-m"])
        .arg(smollm2())
        .args([
            "--pipeline",
            &format!("{addr}=0:end"),
            "--temp",
            "0",
            "-n",
            &n.to_string(),
            "-c",
            "256",
        ])
        .arg(prompt)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A decode node serving several sessions at once steps them together (one batched forward for the next token of
/// each): each client gets the greedy text it gets alone, and the node's log shows more rows than steps. With
/// `--no-batch` nothing is batched.
#[test]
fn a_node_batches_the_decode_steps_of_concurrent_sessions() {
    let prompts = ["The capital of France is", "List three colors:", "Water boils at"];
    let mut node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &["--threads", "1"]);
    let alone: Vec<String> = prompts.iter().map(|p| run_on_node(&node.addr, p, 24)).collect();
    assert!(
        !node.log().contains("batched decode"),
        "one session at a time: {}",
        node.log()
    );
    let together: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(|| run_on_node(&node.addr, p, 24)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone, "each session's text with its steps batched");
    let log = node.log();
    let (rows, steps) = log
        .lines()
        .filter_map(|l| l.split_once("batched decode so far: ")?.1.split_once(" rows in "))
        .map(|(r, s)| {
            (
                r.parse::<u64>().unwrap(),
                s.trim_end_matches(" steps").parse::<u64>().unwrap(),
            )
        })
        .next_back()
        .unwrap_or_else(|| panic!("no batched step: {log}"));
    assert!(rows > steps && steps > 0, "{rows} rows in {steps} steps");
    node.kill();
    let node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &["--threads", "1", "--no-batch"]);
    std::thread::scope(|s| {
        for p in &prompts {
            s.spawn(|| run_on_node(&node.addr, p, 8));
        }
    });
    assert!(!node.log().contains("batched decode"), "{}", node.log());
}
