//! Speculative decoding on the real models: greedy output identical to the target alone (same vocabulary and
//! across vocabularies), sampled output distributed as the target's (chi-square on random-weight models), a draft
//! on a real `baton-node` process on loopback that is killed or stalled mid-generation.

mod cluster_util;

use baton::engine::sampler::{Sampler, SamplerParams};
use baton::engine::{Input, Session, Want};
use baton::generate::{GenParams, Generator, LocalGenerator, Prompt};
use baton::gguf::GgufFile;
use baton::kernels::ThreadPool;
use baton::model::random::{RandomSpec, write_random_model};
use baton::model::{Arch, Model};
use baton::speculative::{Draft, SpecGenerator, SpecOptions};
use cluster_util::*;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pool() -> Arc<ThreadPool> {
    Arc::new(ThreadPool::new(1))
}

fn load(p: &Path) -> Arc<Model> {
    Arc::new(Model::load(p).unwrap())
}

fn params(n: usize, sampler: SamplerParams) -> GenParams {
    GenParams {
        max_tokens: n,
        sampler,
        top_logprobs: 0,
        ..Default::default()
    }
}

fn opts(k: Option<usize>) -> SpecOptions {
    SpecOptions {
        draft_tokens: k,
        n_ctx: 512,
        n_batch: 64,
        ..Default::default()
    }
}

fn prompts() -> Vec<Prompt> {
    use baton::chat::ChatMessage;
    vec![
        Prompt::Text("The capital of France is".into()),
        Prompt::Chat(vec![ChatMessage::user("Write a short poem about the sea.")]),
        Prompt::Text("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".into()),
    ]
}

/// Greedy tokens of the target alone and with the draft, for each prompt; returns the generator for its stats.
fn compare_greedy(target: &Path, mut spec: SpecGenerator, n: usize) -> (usize, usize) {
    let mut alone = LocalGenerator::new(load(target), pool(), 512, 64).unwrap();
    let p = params(n, SamplerParams::greedy());
    let (mut cands, mut acc) = (0, 0);
    for prompt in prompts() {
        let (want, want_text, _) = collect(&mut alone, &prompt, &p);
        let (got, got_text, o) = collect(&mut spec, &prompt, &p);
        assert_eq!(got_text, want_text, "{prompt:?}: text differs");
        assert_eq!(got, want, "{prompt:?}: tokens differ");
        assert_eq!(o.completion_tokens, want.len());
        eprintln!("{prompt:?}: {want_text:?}\n  {}", o.detail.join("\n  "));
        cands += spec.stats().candidates;
        acc += spec.stats().accepted;
    }
    (cands, acc)
}

#[test]
fn same_vocabulary_greedy_is_the_target_alone() {
    // Target: SmolLM2 re-quantized to Q8_0 by `baton quantize`'s code; draft: the Q4_1 file.
    let dir = tempfile::tempdir().unwrap();
    let q8 = dir.path().join("smollm2-q8_0.gguf");
    baton::model::quantize::quantize_file(&smollm2(), &q8, baton::gguf::GgmlType::Q8_0, |_, _| {}).unwrap();
    let draft = Draft::local(load(&smollm2()), pool(), 1024, 64).unwrap();
    let spec = SpecGenerator::new(load(&q8), pool(), draft, opts(Some(4))).unwrap();
    assert!(spec.same_vocab());
    let (cands, acc) = compare_greedy(&q8, spec, 12);
    eprintln!("accepted {acc} of {cands}");
    assert!(cands >= 15, "speculation ran: {cands} candidates");
    assert!(acc * 10 >= cands * 6, "Q4_1 agrees with Q8_0 mostly: {acc} of {cands}");
}

#[test]
fn cross_vocabulary_greedy_is_the_target_alone() {
    let draft = Draft::local(load(&smollm2()), pool(), 1024, 64).unwrap();
    let spec = SpecGenerator::new(load(&gemma3()), pool(), draft, opts(Some(4))).unwrap();
    assert!(!spec.same_vocab());
    let (cands, acc) = compare_greedy(&gemma3(), spec, 12);
    eprintln!("accepted {acc} of {cands}");
    assert!(cands >= 8, "speculation ran: {cands} candidates");
    assert!(acc > 0, "some of SmolLM2's text is Gemma's too");
}

/// Across vocabularies at temperature > 0 every emitted token is the target's own draw from its own RNG stream, so
/// the same seed gives the same text as the target alone.
#[test]
fn cross_vocabulary_sampling_with_a_seed_is_the_target_alone() {
    let draft = Draft::local(load(&smollm2()), pool(), 1024, 64).unwrap();
    let mut spec = SpecGenerator::new(load(&gemma3()), pool(), draft, opts(Some(4))).unwrap();
    let mut alone = LocalGenerator::new(load(&gemma3()), pool(), 512, 64).unwrap();
    for seed in [1, 2] {
        let p = params(
            12,
            SamplerParams {
                temp: 0.8,
                seed: Some(seed),
                ..Default::default()
            },
        );
        let prompt = Prompt::Text("Once upon a time".into());
        let (want, _, _) = collect(&mut alone, &prompt, &p);
        let (got, _, _) = collect(&mut spec, &prompt, &p);
        assert_eq!(got, want, "seed {seed}");
        assert!(spec.stats().candidates > 0);
    }
}

/// The sampler's distribution at the end of `prefix` on `model`.
fn dist_after(s: &mut Session, prefix: &[u32], sp: &SamplerParams) -> Vec<(u32, f32)> {
    s.rewind(0);
    let logits = s.forward(Input::Tokens(prefix), Want::LastLogits).unwrap();
    let mut sampler = Sampler::new(*sp, logits.len());
    sampler.probs(logits)
}

/// Exact law of the first two sampled tokens: p(a) p(b | a).
fn joint(model: &Path, prompt: &[u32], sp: &SamplerParams) -> std::collections::HashMap<(u32, u32), f64> {
    let mut s = Session::new(load(model), pool(), 64, 64).unwrap();
    let mut out = std::collections::HashMap::new();
    for (a, pa) in dist_after(&mut s, prompt, sp) {
        let mut pre = prompt.to_vec();
        pre.push(a);
        for (b, pb) in dist_after(&mut s, &pre, sp) {
            out.insert((a, b), pa as f64 * pb as f64);
        }
    }
    out
}

fn chi_square(
    counts: &std::collections::HashMap<(u32, u32), usize>,
    law: &std::collections::HashMap<(u32, u32), f64>,
    n: usize,
) -> (f64, usize) {
    let (mut x2, mut cells, mut rest_e, mut rest_c) = (0.0, 0usize, 0.0, 0usize);
    for (k, p) in law {
        let e = p * n as f64;
        let c = *counts.get(k).unwrap_or(&0);
        if e >= 5.0 {
            x2 += (c as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            rest_e += e;
            rest_c += c;
        }
    }
    // Small cells pooled, and anything drawn outside the law's support counted there too.
    rest_c += counts
        .iter()
        .filter(|(k, _)| !law.contains_key(k))
        .map(|(_, c)| c)
        .sum::<usize>();
    if rest_e >= 5.0 {
        x2 += (rest_c as f64 - rest_e).powi(2) / rest_e;
        cells += 1;
    } else if rest_c > 0 && rest_e < 1e-9 {
        x2 = f64::INFINITY;
    }
    (x2, cells.saturating_sub(1))
}

/// Same vocabulary at temperature 1 with top-k 4: a random-weight target and its 4-bit copy as the draft, which
/// disagree often enough for both branches of the rule to run. The first two emitted tokens (the second decided by the acceptance rule) must follow the target's law.
#[test]
fn same_vocabulary_sampling_follows_the_target_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = GgufFile::open(&smollm2()).unwrap();
    let (tp, dp) = (dir.path().join("target.gguf"), dir.path().join("draft.gguf"));
    write_random_model(&vocab, &RandomSpec::tiny(Arch::Llama), &tp).unwrap();
    // The draft: the same weights at 4 bits, so its top tokens overlap the target's with other probabilities.
    baton::model::quantize::quantize_file(&tp, &dp, baton::gguf::GgmlType::Q4_0, |_, _| {}).unwrap();
    let sp = SamplerParams {
        temp: 1.0,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        ..Default::default()
    };
    let draft = Draft::local(load(&dp), pool(), 256, 64).unwrap();
    let mut spec = SpecGenerator::new(load(&tp), pool(), draft, opts(Some(1))).unwrap();
    let prompt = Prompt::Text("Hello".into());
    let ids = baton::generate::TextModel::open(&tp)
        .unwrap()
        .tokenize(&prompt)
        .unwrap();
    let law = joint(&tp, &ids, &sp);
    let draft_law = joint(&dp, &ids, &sp);

    // Warm-up: the first decode step of a generator runs the target alone (it measures its cost).
    let p = |seed| params(3, SamplerParams { seed: Some(seed), ..sp });
    collect(&mut spec, &prompt, &p(0));
    let n = 700;
    let mut counts = std::collections::HashMap::new();
    let (mut cands, mut acc) = (0, 0);
    let t0 = Instant::now();
    for seed in 1..=n as u64 {
        let (t, _, _) = collect(&mut spec, &prompt, &p(seed));
        *counts.entry((t[0], t[1])).or_insert(0usize) += 1;
        cands += spec.stats().candidates;
        acc += spec.stats().accepted;
    }
    eprintln!(
        "{n} runs in {:.1} s; {acc} of {cands} candidates accepted",
        t0.elapsed().as_secs_f64()
    );
    assert!(cands >= n, "every run verified a draft token");
    assert!(
        acc > cands / 10 && acc < cands * 9 / 10,
        "both branches of the rule ran: {acc} of {cands}"
    );
    let (x2, dof) = chi_square(&counts, &law, n);
    // Normal approximation of the chi-square tail: mean dof, sd sqrt(2 dof); 4.5 sd is p ~ 1e-5.
    let bound = dof as f64 + 4.5 * (2.0 * dof as f64).sqrt();
    eprintln!("chi-square {x2:.1} with {dof} dof (bound {bound:.1})");
    assert!(
        x2 < bound,
        "the emitted tokens do not follow the target: chi-square {x2:.1}, {dof} dof"
    );
    // The test can fail: the draft's own law is far from these counts.
    let (x2_draft, _) = chi_square(&counts, &draft_law, n);
    assert!(
        x2_draft > 10.0 * bound,
        "the draft's law should be rejected: {x2_draft:.1}"
    );
}

#[test]
fn remote_draft_on_a_node_and_losing_it_mid_generation() {
    let model = smollm2();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let mut alone = LocalGenerator::new(load(&model), pool(), 512, 64).unwrap();
    let p = params(20, SamplerParams::greedy());
    let prompt = Prompt::Text("The three primary colours are".into());
    let (want, _, _) = collect(&mut alone, &prompt, &p);

    let draft = Draft::remote(&model, &node.addr, 1024, None, Duration::from_secs(1)).unwrap();
    let mut spec = SpecGenerator::new(load(&model), pool(), draft, opts(Some(4))).unwrap();
    let (got, _, o) = collect(&mut spec, &prompt, &p);
    assert_eq!(got, want);
    let st = spec.stats().clone();
    eprintln!("{}", o.detail.join("\n"));
    assert!(st.candidates >= 12 && st.accepted * 10 >= st.candidates * 9, "{st:?}");
    assert!(st.draft_lost.is_none());

    // Killed after 6 pieces: the rest comes from the target alone, one warning.
    let mut node = Some(node);
    let (mut got, mut n) = (Vec::new(), 0);
    let prompt2 = Prompt::Text("The three primary colours are red,".into());
    let (want2, _, _) = collect(&mut alone, &prompt2, &p);
    let t0 = Instant::now();
    spec.generate(&prompt2, &p, &mut |piece| {
        got.extend(piece.token);
        n += 1;
        if n == 6 {
            node.take().unwrap().kill();
        }
        true
    })
    .unwrap();
    assert_eq!(got, want2, "the target finishes alone with its own output");
    let st = spec.stats().clone();
    assert!(st.draft_lost.is_some() && st.warned, "{st:?}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    // The next request tries the draft again, fails, and says nothing more.
    let (got, _, _) = collect(&mut spec, &prompt, &p);
    assert_eq!(got, want);
    assert!(spec.stats().draft_lost.is_some() && !spec.stats().warned);

    // A stalled node (SIGSTOP): the step times out after 1 s, the target goes on.
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let draft = Draft::remote(&model, &node.addr, 1024, None, Duration::from_secs(1)).unwrap();
    let mut spec = SpecGenerator::new(load(&model), pool(), draft, opts(Some(4))).unwrap();
    let (mut got, mut n) = (Vec::new(), 0);
    let t0 = Instant::now();
    spec.generate(&prompt2, &p, &mut |piece| {
        got.extend(piece.token);
        n += 1;
        if n == 6 {
            node.signal(libc::SIGSTOP);
        }
        true
    })
    .unwrap();
    assert_eq!(got, want2);
    assert!(spec.stats().draft_lost.is_some() && spec.stats().warned);
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

/// `baton run --draft` prints exactly what `baton run` prints (greedy), and `-v` reports the acceptance.
#[test]
fn cli_draft_flag_gives_the_same_text() {
    let bin = env!("CARGO_BIN_EXE_baton");
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin)
            .args([
                "run", "-m", "smollm2", "-t", "1", "-n", "16", "--temp", "0", "-c", "256",
            ])
            .args(extra)
            .arg("Rust is a programming language that")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };
    let (want, _) = run(&[]);
    let (got, err) = run(&["--draft", "smollm2", "--draft-tokens", "3", "-v"]);
    assert_eq!(got, want);
    assert!(err.contains("accepted"), "{err}");
    assert!(!want.trim().is_empty());
}

/// `cargo test --test speculative bench_speculative -- --ignored --nocapture`: tokens/s of the target alone and
/// with each draft (fixed 4 tokens and `auto`), greedy, on two prompts, as a markdown table. BENCH_N tokens per
/// prompt (64), BENCH_THREADS (2), BENCH_PAIRS (indices into the list below).
#[test]
#[ignore]
fn bench_speculative() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (n, threads) = (env("BENCH_N", 64), env("BENCH_THREADS", 2));
    let pool = Arc::new(ThreadPool::new(threads));
    let dir = tempfile::tempdir().unwrap();
    let (f16, q8, rnd) = (
        dir.path().join("f16.gguf"),
        dir.path().join("q8_0.gguf"),
        dir.path().join("random.gguf"),
    );
    baton::model::quantize::quantize_file(&smollm2(), &f16, baton::gguf::GgmlType::F16, |_, _| {}).unwrap();
    baton::model::quantize::quantize_file(&smollm2(), &q8, baton::gguf::GgmlType::Q8_0, |_, _| {}).unwrap();
    write_random_model(
        &GgufFile::open(&smollm2()).unwrap(),
        &RandomSpec::tiny(Arch::Llama),
        &rnd,
    )
    .unwrap();
    let node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let bench_prompts = [
        Prompt::Chat(vec![baton::chat::ChatMessage::user(
            "Explain what a CPU cache is, in a few sentences.",
        )]),
        Prompt::Text("The history of the Roman Empire".into()),
    ];
    let p = params(n, SamplerParams::greedy());
    let run = |g: &mut dyn Generator| -> (f64, String) {
        let (mut toks, mut secs, mut detail) = (0, 0.0, String::new());
        for prompt in &bench_prompts {
            let (_, _, o) = collect(g, prompt, &p);
            toks += o.completion_tokens;
            secs += o.t_gen.as_secs_f64();
            detail = o.detail.get(1).cloned().unwrap_or_default();
        }
        (toks as f64 / secs, detail)
    };
    println!("| target | draft | mode | tok/s | vs alone | last request |");
    println!("|---|---|---|---:|---:|---|");
    let (smol, gem) = (smollm2(), gemma3());
    let pairs: Vec<(&str, &Path, &str, Option<&Path>, bool)> = vec![
        ("SmolLM2 Q8_0", &q8, "SmolLM2 Q4_1, local", Some(&smol), false),
        ("SmolLM2 F16", &f16, "SmolLM2 Q4_1, local", Some(&smol), false),
        (
            "SmolLM2 F16",
            &f16,
            "random 4x64 (same vocab), local",
            Some(&rnd),
            false,
        ),
        (
            "SmolLM2 F16",
            &f16,
            "SmolLM2 Q4_1 on a node (1 thread), loopback",
            None,
            true,
        ),
        ("Gemma 3 270M", &gem, "SmolLM2 Q4_1, local", Some(&smol), false),
    ];
    // BENCH_PAIRS=0,3 runs a subset.
    let only: Option<Vec<usize>> = std::env::var("BENCH_PAIRS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect());
    for (i, (tname, target, dname, draft, remote)) in pairs.into_iter().enumerate() {
        if only.as_ref().is_some_and(|o| !o.contains(&i)) {
            continue;
        }
        let mut alone = LocalGenerator::new(load(target), pool.clone(), 1024, 64).unwrap();
        let (base, _) = run(&mut alone);
        drop(alone);
        println!("| {tname} | none | alone | {base:.1} | 1.00 | |");
        for k in [Some(4), None] {
            let draft = if remote {
                Draft::remote(&smol, &node.addr, 1024, None, Duration::from_secs(5)).unwrap()
            } else {
                Draft::local(load(draft.unwrap()), pool.clone(), 2048, 64).unwrap()
            };
            let mut g = SpecGenerator::new(
                load(target),
                pool.clone(),
                draft,
                SpecOptions {
                    draft_tokens: k,
                    n_ctx: 1024,
                    n_batch: 64,
                    ..Default::default()
                },
            )
            .unwrap();
            let (tps, detail) = run(&mut g);
            let mode = k.map_or("auto".to_string(), |k| format!("k = {k}"));
            println!(
                "| {tname} | {dname} | {mode} | {tps:.1} | {:.2} | {detail} |",
                tps / base
            );
        }
    }
}
