//! The pipeline over an emulated link: two network namespaces joined by a veth pair shaped with `tc tbf` (2.5 Gbit/s
//! or 10 Gbit/s), the nodes in one, the coordinator (a thread that entered the other with setns) relaying through the
//! link. Skipped (`SKIPPED: reason` on stderr) where not root or without `ip netns`. Namespaces are deleted on drop.

mod cluster_util;

use baton::cluster::handshake::Timeouts;
use baton::cluster::{PipelineOpts, PipelineSession};
use cluster_util::*;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn run(cmd: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| format!("{}: {e}", cmd.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// A named network namespace, deleted on drop.
struct Netns(String);

impl Netns {
    fn add(name: String) -> Result<Netns, String> {
        run(&["ip", "netns", "add", &name])?;
        let ns = Netns(name);
        run(&["ip", "-n", &ns.0, "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.0]);
    }
}

/// Two namespaces joined by a shaped veth pair: `a` at 10.213.N.1, `b` at 10.213.N.2.
struct Link {
    a: Netns,
    b: Netns,
    b_ip: String,
}

impl Link {
    /// `None` (after printing why) where the harness cannot run.
    fn new(rate: &str) -> Option<Link> {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIPPED: network-namespace tests need root");
            return None;
        }
        match Self::try_new(rate) {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("SKIPPED: cannot build network namespaces ({e})");
                None
            }
        }
    }

    fn try_new(rate: &str) -> Result<Link, String> {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}x{n}", std::process::id());
        let a = Netns::add(format!("btA{tag}"))?;
        let b = Netns::add(format!("btB{tag}"))?;
        let subnet = 10 + (std::process::id() as usize * 7 + n) % 240;
        let (va, vb) = (format!("bva{tag}"), format!("bvb{tag}"));
        let (va, vb) = (&va[..va.len().min(15)], &vb[..vb.len().min(15)]);
        run(&[
            "ip", "-n", &a.0, "link", "add", va, "type", "veth", "peer", "name", vb, "netns", &b.0,
        ])?;
        let (ip_a, ip_b) = (format!("10.213.{subnet}.1"), format!("10.213.{subnet}.2"));
        run(&["ip", "-n", &a.0, "addr", "add", &format!("{ip_a}/24"), "dev", va])?;
        run(&["ip", "-n", &b.0, "addr", "add", &format!("{ip_b}/24"), "dev", vb])?;
        run(&["ip", "-n", &a.0, "link", "set", va, "up"])?;
        run(&["ip", "-n", &b.0, "link", "set", vb, "up"])?;
        // tbf needs a bucket of at least rate / HZ bytes; 4 MB covers 10 Gbit/s at HZ 250. A slow link gets a small
        // bucket, or its first 4 MB would pass at full speed.
        let slow = rate.ends_with("kbit")
            || rate
                .strip_suffix("mbit")
                .and_then(|r| r.parse::<u32>().ok())
                .is_some_and(|r| r < 100);
        let burst = if slow { "64kb" } else { "4mb" };
        for (ns, dev) in [(&a.0, va), (&b.0, vb)] {
            run(&[
                "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
                burst, "latency", "20ms",
            ])?;
        }
        Ok(Link { a, b, b_ip: ip_b })
    }

    /// A node inside namespace `b`, authenticated (it listens off loopback).
    fn node(&self, secret: &std::path::Path, extra: &[&str]) -> NodeProc {
        let mut args = vec!["--secret-file", secret.to_str().unwrap()];
        args.extend_from_slice(extra);
        NodeProc::try_spawn_in(
            &["ip", "netns", "exec", &self.b.0],
            &smollm2(),
            &format!("{}:0", self.b_ip),
            &args,
        )
        .unwrap_or_else(|log| panic!("node in {} failed:\n{log}", self.b.0))
    }

    /// Runs `f` on a thread that lives in namespace `a` (every socket it opens is there).
    fn in_a<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.a.0);
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = std::fs::File::open(&path).unwrap();
                assert_eq!(
                    unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                    0,
                    "setns {path}"
                );
                f()
            })
            .join()
            .unwrap()
        })
    }
}

fn secret_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let p = dir.path().join("secret");
    std::fs::write(&p, "netns test secret, long enough\n").unwrap();
    p
}

fn opts() -> PipelineOpts {
    PipelineOpts {
        n_ctx: 1024,
        chunk: 128,
        threads: 1,
        secret: Some(b"netns test secret, long enough".to_vec()),
        timeouts: Timeouts {
            connect: Duration::from_secs(5),
            io: Duration::from_secs(60),
        },
        ..Default::default()
    }
}

#[test]
fn pipeline_over_a_shaped_link_matches_local() {
    let names;
    {
        let Some(link) = Link::new("2500mbit") else {
            return;
        };
        names = (link.a.0.clone(), link.b.0.clone());
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(&dir);
        let n1 = link.node(&secret, &[]);
        let n2 = link.node(&secret, &[]);
        let model = smollm2();
        let prompt = prompt(20);
        let (_, ref_toks) = local_reference(&model, &prompt, 5);
        let spec = format!("{}=0:15,{}=15:end", n1.addr, n2.addr);
        let toks = link.in_a(|| {
            let mut p = PipelineSession::connect(&spec, &model, opts()).unwrap();
            let mut t = vec![p.eval(&prompt).unwrap().token];
            while t.len() < 5 {
                t.push(p.decode_step(*t.last().unwrap()).unwrap().token);
            }
            t
        });
        assert_eq!(toks, ref_toks);
        // From the root namespace the nodes are unreachable: the traffic really went through the link.
        assert!(std::net::TcpStream::connect_timeout(&n1.addr.parse().unwrap(), Duration::from_millis(300)).is_err());
    }
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        !list.contains(&names.0) && !list.contains(&names.1),
        "namespaces left behind: {list}"
    );
}

/// `cargo test --test netns bench_shaped_link -- --ignored --nocapture`: pp/tg through 2 and 3 stages over the
/// emulated 2.5 Gbit/s and 10 Gbit/s links. BENCH_PP, BENCH_TG, BENCH_THREADS as in tests/pipeline.rs.
#[test]
#[ignore]
fn bench_shaped_link() {
    let BenchEnv {
        pp,
        tg,
        threads: t,
        chunks,
    } = BenchEnv::from_env();
    let model = smollm2();
    let prompt = prompt(pp);
    let (lpp, ltg) = bench_local(&model, t, &prompt, tg);
    println!("threads per stage {t}, pp{pp} tg{tg}; local: pp {lpp:.1} t/s, tg {ltg:.1} t/s");
    println!("| link | stages | chunk | pp t/s | tg t/s | pp vs local | tg vs local | decode bytes/token |");
    println!("|---|---|---|---|---|---|---|---|");
    for rate in ["2500mbit", "10gbit"] {
        let Some(link) = Link::new(rate) else { return };
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(&dir);
        let ts = t.to_string();
        let nodes: Vec<NodeProc> = (0..3).map(|_| link.node(&secret, &["-t", &ts])).collect();
        for (name, spec) in [
            ("2", format!("{}=0:15,{}=15:end", nodes[0].addr, nodes[1].addr)),
            (
                "3",
                format!(
                    "{}=0:10,{}=10:20,{}=20:end",
                    nodes[0].addr, nodes[1].addr, nodes[2].addr
                ),
            ),
        ] {
            for chunk in chunks.iter().copied() {
                let o = PipelineOpts {
                    chunk,
                    threads: t,
                    ..opts()
                };
                let (ppp, ptg, st) = link.in_a(|| bench_pipeline(&spec, &model, o, &prompt, tg));
                println!(
                    "| {rate} | {name} | {chunk} | {ppp:.1} | {ptg:.1} | {:.2} | {:.2} | {:.0} |",
                    ppp / lpp,
                    ptg / ltg,
                    bytes_per_token(&st, tg)
                );
            }
        }
    }
}

/// Disaggregated prefill over emulated links (`cargo test --test netns bench_handoff_shaped -- --ignored
/// --nocapture`; BENCH_PP prompt lengths, default 512; BENCH_RATES the links, default 2500mbit,20mbit): the prefill
/// node (2 threads) in one namespace, the decode side (1 thread) in the other. A 2.5 Gbit/s link hides the KV
/// transfer behind compute; a link slower than the KV production rate does not, and there `--kv-bits 8` and
/// `--offload auto` matter. Figures in docs/disaggregation.md.
#[test]
#[ignore]
fn bench_handoff_shaped() {
    use baton::cluster::disagg::{Job, Offload, Speeds, learn, plan};
    use baton::cluster::handoff::{NodeOpts, PrefillNode, prefill_with_fallback};
    use baton::engine::Session;
    use baton::engine::snapshot::RowDtype;
    use baton::kernels::ThreadPool;
    use baton::model::Model;
    use std::sync::Arc;
    let lens: Vec<usize> = std::env::var("BENCH_PP")
        .unwrap_or_else(|_| "512".into())
        .split(',')
        .filter_map(|v| v.parse().ok())
        .collect();
    let model = smollm2();
    let m = Arc::new(Model::load(&model).unwrap());
    let hp = m.hp.clone();
    println!("| link | prompt | plan | KV | TTFT | remote | exposed | handoff | bytes | link rate |");
    println!("|---|---:|---|---|---:|---:|---:|---:|---:|---:|");
    let rates = std::env::var("BENCH_RATES").unwrap_or_else(|_| "2500mbit,20mbit".into());
    for rate in rates.split(',') {
        let Some(link) = Link::new(rate) else { return };
        let dir = tempfile::tempdir().unwrap();
        let secret = secret_file(&dir);
        let node = link.node(&secret, &["-t", "2", "-c", "8192"]);
        let mut speeds = Speeds::for_model(&hp);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for &pp in &lens {
            let prompt = prompt(pp);
            let mut runs: Vec<(String, usize, RowDtype)> = vec![
                ("local".into(), 0, RowDtype::F32),
                ("full".into(), hp.n_layer, RowDtype::F32),
                ("full".into(), hp.n_layer, RowDtype::Q8),
                ("half".into(), hp.n_layer / 2, RowDtype::F32),
            ];
            let mut i = 0;
            while i < runs.len() {
                let (name, k, kv) = runs[i].clone();
                let rep = link.in_a(|| {
                    let mut s = Session::new(m.clone(), Arc::new(ThreadPool::new(1)), pp + 64, 512).unwrap();
                    let mut pn = PrefillNode::new(NodeOpts {
                        addr: node.addr.clone(),
                        secret: Some(b"netns test secret, long enough".to_vec()),
                        timeouts: Timeouts {
                            connect: Duration::from_secs(5),
                            io: Duration::from_secs(120),
                        },
                        kv,
                    });
                    prefill_with_fallback(&mut s, Some(&mut pn), &prompt, k).unwrap().1
                });
                assert!(rep.fallback.is_none(), "{rep:?}");
                if kv == RowDtype::F32 {
                    learn(&mut speeds, &rep);
                }
                println!(
                    "| {rate} | {pp} | {name} ({k} layers) | {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} MB | {:.3} MB/s |",
                    kv.name(),
                    ms(rep.total),
                    ms(rep.remote),
                    ms(rep.exposed),
                    ms(rep.handoff),
                    rep.bytes as f64 / 1e6,
                    rep.link_rate / 1e6
                );
                if i == 3 {
                    let job = Job {
                        n_layer: hp.n_layer,
                        start: 0,
                        n: pp,
                        catch_up: 0,
                        chunk: 512,
                        kv_bytes: (hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 4) as f64,
                        hidden_bytes: (hp.n_embd * 4) as f64,
                    };
                    let (k, why) = plan(Offload::Auto, &speeds, &job);
                    println!("<!-- {rate} {pp}: {why} -->");
                    runs.push(("auto".to_string(), k, RowDtype::F32));
                }
                i += 1;
            }
        }
    }
}

/// `cargo test --test netns bench_speculative_shaped_link -- --ignored --nocapture`: a SmolLM2 F16 target here, its
/// SmolLM2 Q4_1 draft on a node across the emulated 2.5 Gbit/s link, against the target alone (greedy, BENCH_TG
/// tokens on two prompts, BENCH_THREADS for the target; the node runs 1 thread).
#[test]
#[ignore]
fn bench_speculative_shaped_link() {
    use baton::engine::sampler::SamplerParams;
    use baton::generate::{GenParams, Generator, LocalGenerator, Prompt};
    use baton::kernels::ThreadPool;
    use baton::model::Model;
    use baton::speculative::{Draft, SpecGenerator, SpecOptions};
    use std::sync::Arc;

    let BenchEnv { tg, threads, .. } = BenchEnv::from_env();
    let Some(link) = Link::new("2500mbit") else { return };
    let dir = tempfile::tempdir().unwrap();
    let f16 = dir.path().join("f16.gguf");
    baton::model::quantize::quantize_file(&smollm2(), &f16, baton::gguf::GgmlType::F16, |_, _| {}).unwrap();
    let secret = secret_file(&dir);
    let node = link.node(&secret, &[]);
    let target = Arc::new(Model::load(&f16).unwrap());
    let pool = Arc::new(ThreadPool::new(threads));
    let prompts = [
        Prompt::Chat(vec![baton::chat::ChatMessage::user(
            "Explain what a CPU cache is, in a few sentences.",
        )]),
        Prompt::Text("The history of the Roman Empire".into()),
    ];
    let p = GenParams {
        max_tokens: tg,
        sampler: SamplerParams::greedy(),
        top_logprobs: 0,
        ..Default::default()
    };
    let run = |g: &mut dyn Generator| -> (f64, String) {
        let (mut toks, mut secs, mut detail) = (0, 0.0, String::new());
        for prompt in &prompts {
            let (_, _, o) = collect(g, prompt, &p);
            toks += o.completion_tokens;
            secs += o.t_gen.as_secs_f64();
            detail = o.detail.get(1).cloned().unwrap_or_default();
        }
        (toks as f64 / secs, detail)
    };
    let mut alone = LocalGenerator::new(target.clone(), pool.clone(), 1024, 64).unwrap();
    let (base, _) = run(&mut alone);
    println!("| target | draft | mode | tok/s | vs alone | last request |");
    println!("|---|---|---|---:|---:|---|");
    println!("| SmolLM2 F16 | none | alone | {base:.1} | 1.00 | |");
    for k in [Some(4), None] {
        let (tps, detail) = link.in_a(|| {
            let s = Some(b"netns test secret, long enough".to_vec());
            let draft = Draft::remote(&smollm2(), &node.addr, 1024, s, Duration::from_secs(5)).unwrap();
            let opts = SpecOptions {
                draft_tokens: k,
                n_ctx: 1024,
                n_batch: 64,
                ..Default::default()
            };
            let mut g = SpecGenerator::new(target.clone(), pool.clone(), draft, opts).unwrap();
            run(&mut g)
        });
        let mode = k.map_or("auto".to_string(), |k| format!("k = {k}"));
        println!(
            "| SmolLM2 F16 | SmolLM2 Q4_1 on a node, 2.5 Gbit/s | {mode} | {tps:.1} | {:.2} | {detail} |",
            tps / base
        );
    }
}
