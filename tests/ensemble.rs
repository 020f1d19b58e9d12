//! Ensembles through the full cross-vocabulary path: a model ensembled with itself reproduces its own greedy output
//! (locally and with one member on a real `baton node`), SmolLM2 + Gemma 3 stay in step with the shared text, bits
//! per byte of the mixture, and a member killed mid-generation (clear error, or the others carry on).

mod cluster_util;

use baton::engine::sampler::SamplerParams;
use baton::ensemble::{Combine, Ensemble, EnsembleOpts, MemberOpts, fit, parse_members};
use baton::generate::{Finish, GenParams, Generator, LocalGenerator, Outcome, Prompt};
use baton::kernels::ThreadPool;
use baton::model::Model;
use cluster_util::*;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn ensemble(spec: &str, combine: Combine, degrade: bool) -> Ensemble {
    let opts = EnsembleOpts {
        members: parse_members(spec).unwrap(),
        combine,
        degrade,
        member: MemberOpts {
            n_ctx: 512,
            n_batch: 64,
            threads: 1,
            ..Default::default()
        },
        verbose: false,
        retry_dropped: Duration::ZERO,
    };
    Ensemble::open(&opts).unwrap()
}

fn greedy(n: usize) -> GenParams {
    GenParams {
        max_tokens: n,
        sampler: SamplerParams::greedy(),
        top_logprobs: 0,
        ..Default::default()
    }
}

fn run(g: &mut dyn Generator, prompt: &str, n: usize) -> (String, Outcome) {
    let mut text = String::new();
    let o = g
        .generate(&Prompt::Text(prompt.into()), &greedy(n), &mut |p| {
            text.push_str(&p.text);
            true
        })
        .unwrap();
    (text, o)
}

fn local_greedy(prompt: &str, n: usize) -> String {
    let model = Arc::new(Model::load(&smollm2()).unwrap());
    let mut g = LocalGenerator::new(model, Arc::new(ThreadPool::new(1)), 512, 64).unwrap();
    run(&mut g, prompt, n).0
}

// Prompts whose greedy continuations include accented characters split across byte-level tokens.
const PROMPTS: [&str; 2] = ["The capital of France is", "En français, « merci beaucoup » se dit"];

#[test]
fn self_ensemble_reproduces_greedy_output() {
    let mut e = ensemble("smollm2@local,smollm2@local", Combine::Union, false);
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let want = local_greedy(prompt, 16);
        let rules = if i == 0 {
            vec![Combine::Union, Combine::Confident, Combine::Mix(vec![0.7, 0.3])]
        } else {
            vec![Combine::Union]
        };
        for combine in rules {
            e.set_combine(combine.clone()).unwrap();
            let (got, o) = run(&mut e, prompt, 16);
            assert_eq!(got, want, "{combine:?} on {prompt:?}");
            assert_eq!(o.completion_tokens, 16);
        }
    }
    // A second request on the same ensemble reuses each member's prompt KV and gives the same text.
    let (again, o) = run(&mut e, PROMPTS[1], 16);
    assert_eq!(again, local_greedy(PROMPTS[1], 16));
    assert!(o.cached_tokens > 0, "prompt KV reused");
}

#[test]
fn cross_vocabulary_members_stay_in_step_with_the_text() {
    for combine in [Combine::Union, Combine::Confident] {
        let mut e = ensemble("smollm2@local,gemma3@local", combine.clone(), false);
        let (text, o) = run(&mut e, "The capital of France is", 12);
        assert!(text.contains("Paris"), "{combine:?}: {text:?}");
        assert_eq!(o.completion_tokens, 12);
        // Each member's tokens spell the shared text (all but the last step, which ends the request unsynced).
        for m in &e.members {
            let mine = String::from_utf8(m.generated_bytes()).unwrap();
            assert!(text.starts_with(&mine), "{}: {mine:?} vs {text:?}", m.name());
            assert!(mine.len() + 12 >= text.len(), "{}: {mine:?} vs {text:?}", m.name());
        }
    }
}

#[test]
fn bits_per_byte_of_members_and_mixture() {
    let mut e = ensemble("smollm2@local,gemma3@local", Combine::Union, false);
    let docs = [
        "The cat sat on the mat. It was a sunny day, and the children played in the garden until dinner.",
        "Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.",
    ];
    let scored: Vec<_> = docs
        .iter()
        .map(|d| fit::score_doc(&mut e.members, d).unwrap())
        .collect();
    for d in &scored {
        assert!(
            d.bytes > 60 && d.segs.len() > 10,
            "{} bytes in {} segments",
            d.bytes,
            d.segs.len()
        );
    }
    let w = fit::fit_weights(&scored, 2);
    let r = fit::report(&scored, &w, 1);
    for bpb in &r.member_bpb {
        assert!(*bpb > 0.2 && *bpb < 4.0, "member bits per byte {bpb}");
    }
    // Fitted weights cannot do worse than the best member on the text they were fitted on; equal weights cannot do
    // worse than the average member (mixing is concave).
    assert!(r.ensemble_bpb <= r.member_bpb[r.best] + 1e-9, "{r:?}");
    let eq = fit::report(&scored, &[0.5, 0.5], 1);
    assert!(eq.ensemble_bpb <= (eq.member_bpb[0] + eq.member_bpb[1]) / 2.0 + 1e-9);
    // A member scored alone gives the same figure as in the pair (its own tokenization, its own context).
    let mut solo = ensemble("smollm2@local", Combine::Union, false);
    let s: Vec<_> = docs
        .iter()
        .map(|d| fit::score_doc(&mut solo.members, d).unwrap())
        .collect();
    let bits_solo: f64 = s.iter().map(|d| d.member_bits(0)).sum();
    let bits_pair: f64 = scored.iter().map(|d| d.member_bits(0)).sum();
    let bytes_solo: usize = s.iter().map(|d| d.bytes).sum();
    let bytes_pair: usize = scored.iter().map(|d| d.bytes).sum();
    assert!(bytes_solo >= bytes_pair);
    assert!((bits_solo / bytes_solo as f64 - bits_pair / bytes_pair as f64).abs() < 0.1);
}

#[test]
fn remote_member_on_a_node_matches_and_sends_little() {
    let node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let prompt = PROMPTS[0];
    let want = local_greedy(prompt, 16);
    let mut e = ensemble(&format!("smollm2@local,smollm2@{}", node.addr), Combine::Union, false);
    let (got, o) = run(&mut e, prompt, 16);
    assert_eq!(got, want);
    // Per step: one request (the committed token) and one answer (top-k entries); well under 1 KB each way.
    let remote = &e.members[1];
    let (sent, recv) = remote.wire_bytes();
    let reqs = remote.wire_requests();
    assert!((16..=18).contains(&reqs), "{reqs} round trips");
    let per_step = (sent + recv) as f64 / reqs as f64;
    assert!(per_step < 2048.0, "{per_step} bytes per round trip");
    assert!(o.detail.iter().any(|l| l.contains("round trips")), "{:?}", o.detail);
}

/// Starts `baton run --ensemble` with a remote member, kills the node once text has come out, returns the run's
/// exit success, standard output and standard error.
fn kill_mid_generation(extra: &[&str]) -> (bool, String, String) {
    let mut node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let spec = format!("smollm2@local,smollm2@{}", node.addr);
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "run",
            "--ensemble",
            &spec,
            "--temp",
            "0",
            "-n",
            "40",
            "-t",
            "1",
            "-c",
            "512",
        ])
        .args(extra)
        .arg("Once upon a time")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 64];
    let t0 = Instant::now();
    while out.len() < 10 && t0.elapsed() < Duration::from_secs(60) {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    node.kill();
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    out.extend(rest);
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    (status.success(), String::from_utf8_lossy(&out).into_owned(), err)
}

#[test]
fn killed_member_ends_the_request_with_a_clear_error() {
    let (ok, _out, err) = kill_mid_generation(&[]);
    assert!(!ok, "stderr: {err}");
    assert!(
        err.contains("error: ensemble member smollm2@127.0.0.1:") && err.contains("failed"),
        "stderr: {err}"
    );
}

#[test]
fn killed_member_with_degrade_leaves_the_rest_going() {
    let (ok, out, err) = kill_mid_generation(&["--ensemble-degrade"]);
    assert!(ok, "stderr: {err}");
    assert!(
        err.contains("failed") && err.contains("continuing with smollm2@local"),
        "stderr: {err}"
    );
    assert!(err.contains("stop: length"), "stderr: {err}");
    assert!(out.len() > 40, "{out:?}");
}

/// Under `--ensemble-degrade` a member whose node died is dropped, and a later request tries it again: once the
/// node is back, the member rejoins (what a long-running server needs).
#[test]
fn dropped_member_rejoins_when_its_node_is_back() {
    let mut node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let addr = node.addr.clone();
    let mut e = ensemble(&format!("smollm2@local,smollm2@{addr}"), Combine::Union, true);
    let want = local_greedy(PROMPTS[0], 8);
    assert_eq!(run(&mut e, PROMPTS[0], 8).0, want);

    node.kill();
    let (got, o) = run(&mut e, PROMPTS[0], 8);
    assert_eq!(got, want, "the local member alone is the same model");
    assert!(
        o.detail
            .iter()
            .any(|l| l.contains("failed") && l.contains("continuing with smollm2@local")),
        "{:?}",
        o.detail
    );
    assert!(e.describe().contains("(dropped)"), "{}", e.describe());

    let _back = NodeProc::spawn(&smollm2(), &addr, &[]);
    let before = e.members[1].wire_requests();
    let (got, o) = run(&mut e, PROMPTS[0], 8);
    assert_eq!(got, want);
    assert!(
        o.detail
            .iter()
            .any(|l| l.contains("trying member") && l.contains("again")),
        "{:?}",
        o.detail
    );
    assert!(!e.describe().contains("dropped"), "{}", e.describe());
    assert!(
        e.members[1].wire_requests() >= before + 8,
        "the member did not take part again"
    );
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let mut e = ensemble("smollm2@local,smollm2@local", Combine::Union, false);
    let p = GenParams {
        max_tokens: 12,
        sampler: SamplerParams {
            temp: 0.9,
            seed: Some(5),
            ..Default::default()
        },
        top_logprobs: 3,
        ..Default::default()
    };
    let mut texts = Vec::new();
    for _ in 0..2 {
        let mut text = String::new();
        let mut tops = 0;
        let o = e
            .generate(&Prompt::Text("Once upon a time".into()), &p, &mut |piece| {
                text.push_str(&piece.text);
                tops += piece.top.len();
                assert!(piece.logprob.is_some_and(|l| l <= 0.0));
                true
            })
            .unwrap();
        assert_eq!(o.finish, Finish::Length);
        assert!(tops >= 12);
        texts.push(text);
    }
    assert_eq!(texts[0], texts[1]);
}
