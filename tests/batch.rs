//! Batched decode across sessions: on the real models, sessions at different positions decoded together give the
//! greedy tokens (and, within a stated tolerance, the logits) each gets decoded alone; and `baton serve` with several
//! slots answers concurrent requests with the text each gets alone, decoding them in shared steps.

mod common;

use baton::engine::{Batch, Input, Session, Want};
use baton::kernels::ThreadPool;
use baton::kernels::ops::argmax;
use baton::model::Model;
use std::sync::Arc;

/// Largest logit difference allowed between a row of a batched step and the same session's step alone. The rows
/// go through the same kernels except the matmul's several-rows path, whose per-block sums may be added in another
/// order.
const LOGIT_TOL: f32 = 1e-3;

/// Greedy steps compared.
const STEPS: usize = 12;

fn check_model(name: &str) {
    let m = Arc::new(Model::load(&common::model(name)).unwrap());
    let pool = Arc::new(ThreadPool::new(2));
    let nv = m.hp.n_vocab;
    let text = baton::generate::TextModel::from_gguf(&m.file).unwrap();
    let prompts = [
        "The capital of France is",
        "Write a haiku about the sea. Waves",
        "1, 2, 3, 4,",
        "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
    ];
    let new = || Session::new(m.clone(), pool.clone(), 256, 64).unwrap();
    let (mut alone, mut batched, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for p in prompts {
        let toks = text.vocab.tokenize(p, true, false);
        let mut a = new();
        next.push(argmax(a.eval(&toks).unwrap()) as u32);
        alone.push(a);
        let mut b = new();
        b.eval(&toks).unwrap();
        batched.push(b);
    }
    let positions: Vec<usize> = batched.iter().map(|s| s.n_past()).collect();
    assert!(
        positions.windows(2).all(|w| w[0] != w[1]),
        "prompts of distinct lengths: {positions:?}"
    );

    // Greedy: each session alone, then all four in shared steps.
    let mut want = vec![Vec::new(); prompts.len()];
    for (i, s) in alone.iter_mut().enumerate() {
        let mut t = next[i];
        for _ in 0..STEPS {
            want[i].push(t);
            t = argmax(s.forward(Input::Tokens(&[t]), Want::LastLogits).unwrap()) as u32;
        }
    }
    let mut batch = Batch::new(m.clone(), pool.clone(), prompts.len(), 256).unwrap();
    let mut got = vec![Vec::new(); prompts.len()];
    let mut toks = next.clone();
    for _ in 0..STEPS {
        for (g, &t) in got.iter_mut().zip(&toks) {
            g.push(t);
        }
        let mut refs: Vec<&mut Session> = batched.iter_mut().collect();
        let logits = batch.step(&mut refs, &toks).unwrap();
        for (i, t) in toks.iter_mut().enumerate() {
            *t = argmax(&logits[i * nv..(i + 1) * nv]) as u32;
        }
    }
    assert_eq!(
        got, want,
        "{name}: batched greedy tokens differ from each session decoded alone"
    );

    // Logits of one more step: a batch of three (the second session sits this one out), against each alone.
    let mut worst = 0.0f32;
    let step_toks = [toks[0], toks[2], toks[3]];
    let (s0, rest) = batched.split_at_mut(1);
    let (_, rest) = rest.split_at_mut(1);
    let (s2, s3) = rest.split_at_mut(1);
    let mut refs = [&mut s0[0], &mut s2[0], &mut s3[0]];
    let got = batch.step(&mut refs, &step_toks).unwrap().to_vec();
    for (row, i) in [0, 2, 3].into_iter().enumerate() {
        let want = alone[i].forward(Input::Tokens(&[toks[i]]), Want::LastLogits).unwrap();
        let d = want
            .iter()
            .zip(&got[row * nv..(row + 1) * nv])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        worst = worst.max(d);
    }
    eprintln!("{name}: largest logit difference batched vs alone: {worst:e}");
    assert!(
        worst < LOGIT_TOL,
        "{name}: logits differ by {worst} (tolerance {LOGIT_TOL})"
    );
    let held = |v: &[Session]| v.iter().map(|s| (s.n_past(), s.tokens().to_vec())).collect::<Vec<_>>();
    assert_eq!(
        held(&batched),
        held(&alone),
        "{name}: positions and tokens held (the left-out session did not move)"
    );
}

#[test]
fn batched_decode_matches_alone_smollm2() {
    check_model("smollm2");
}

#[test]
fn batched_decode_matches_alone_gemma3() {
    check_model("gemma3");
}
