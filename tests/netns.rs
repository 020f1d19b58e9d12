//! The pipeline over an emulated link: two network namespaces joined by a veth pair shaped with `tc tbf` (2.5 Gbit/s
//! or 10 Gbit/s), the nodes in one, the coordinator (a thread that entered the other with setns) relaying through the
//! link. Skipped (`SKIPPED: reason` on stderr) where not root or without `ip netns`. Namespaces are deleted on drop
//! (the helpers are in tests/cluster_util/netns.rs, shared with the soak).

mod cluster_util;

use baton::cluster::handshake::Timeouts;
use baton::cluster::{PipelineOpts, PipelineSession};
use cluster_util::netns::{Link, SECRET, netns_exists, secret_file};
use cluster_util::*;
use std::time::Duration;

fn opts() -> PipelineOpts {
    PipelineOpts {
        n_ctx: 1024,
        chunk: 128,
        threads: 1,
        secret: Some(SECRET.as_bytes().to_vec()),
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
        names = (link.a.as_ref().unwrap().0.clone(), link.b.0.clone());
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
    assert!(
        !netns_exists(&names.0) && !netns_exists(&names.1),
        "namespaces left behind: {names:?}"
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
                        secret: Some(SECRET.as_bytes().to_vec()),
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
            let s = Some(SECRET.as_bytes().to_vec());
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
