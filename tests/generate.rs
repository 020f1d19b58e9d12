//! The Generator interface on a real model: the local generator matches a hand-written decode loop, keeps its KV
//! between requests, stops when asked, reports log-probabilities, refuses prompts beyond the context.

mod common;
use common::collect;

use baton::engine::sampler::SamplerParams;
use baton::engine::{Input, Session, Want};
use baton::generate::{Finish, GenParams, Generator, LocalGenerator, Prompt};
use baton::kernels::ThreadPool;
use baton::kernels::ops::argmax;
use baton::model::Model;
use std::sync::Arc;

fn local(n_ctx: usize) -> (LocalGenerator, Arc<Model>) {
    let model = Arc::new(Model::load(&common::model("smollm2")).unwrap());
    let pool = Arc::new(ThreadPool::new(2));
    (LocalGenerator::new(model.clone(), pool, n_ctx, 64).unwrap(), model)
}

fn greedy(n: usize) -> GenParams {
    GenParams {
        max_tokens: n,
        sampler: SamplerParams::greedy(),
        top_logprobs: 0,
        ..Default::default()
    }
}

#[test]
fn local_generator_matches_a_plain_decode_loop_and_reuses_its_kv() {
    let (mut g, model) = local(512);
    let prompt = Prompt::Text("The capital of France is".into());
    let (ids, text, o) = collect(&mut g, &prompt, &greedy(12));
    assert_eq!(ids.len(), 12);
    assert_eq!(o.completion_tokens, 12);
    assert_eq!(o.finish, Finish::Length);
    assert_eq!(o.cached_tokens, 0);
    assert!(!text.is_empty());

    // The same tokens from a hand-written greedy loop over a fresh session.
    let toks = g.text.tokenize(&prompt).unwrap();
    assert_eq!(o.prompt_tokens, toks.len());
    let mut s = Session::new(model, Arc::new(ThreadPool::new(2)), 512, 64).unwrap();
    let mut next = argmax(s.eval(&toks).unwrap()) as u32;
    let mut want = vec![next];
    while want.len() < 12 {
        next = argmax(s.forward(Input::Tokens(&[next]), Want::LastLogits).unwrap()) as u32;
        want.push(next);
    }
    assert_eq!(ids, want);

    // A second request extending the first reuses the prompt's KV (all but the last prompt token is kept).
    let (ids2, _, o2) = collect(&mut g, &prompt, &greedy(12));
    assert_eq!(ids2, ids, "same prompt, same greedy output");
    assert_eq!(o2.cached_tokens, toks.len() - 1);
}

#[test]
fn local_generator_stops_when_the_sink_says_so_and_reports_logprobs() {
    let (mut g, _) = local(512);
    let prompt = Prompt::Text("One, two, three,".into());
    let mut seen = 0;
    let p = GenParams {
        top_logprobs: 3,
        ..greedy(50)
    };
    let o = g
        .generate(&prompt, &p, &mut |piece| {
            if piece.token.is_some() {
                seen += 1;
                let lp = piece.logprob.expect("logprob asked for");
                assert!(lp <= 0.0);
                assert_eq!(piece.top.len(), 3);
                // Greedy: the chosen token is the most likely one.
                assert!((piece.top[0].1 - lp).abs() < 1e-5);
                assert!(piece.top[0].1 >= piece.top[1].1 && piece.top[1].1 >= piece.top[2].1);
            }
            seen < 4
        })
        .unwrap();
    assert_eq!(o.finish, Finish::Stopped);
    assert_eq!(o.completion_tokens, 4);
}

#[test]
fn local_generator_refuses_a_prompt_beyond_the_context() {
    let (mut g, _) = local(16);
    let long = Prompt::Text("word ".repeat(40));
    let err = g.generate(&long, &greedy(4), &mut |_| true).unwrap_err().to_string();
    assert!(err.contains("context is 16"), "{err}");
    // And it still works afterwards.
    let (ids, _, _) = collect(&mut g, &Prompt::Text("Hi".into()), &greedy(3));
    assert_eq!(ids.len(), 3);
}

#[test]
fn chat_prompts_use_the_models_template() {
    let (g, _) = local(512);
    let chat = Prompt::Chat(vec![baton::chat::ChatMessage::user("Hello")]);
    let text = g.render(&chat).unwrap();
    assert!(text.contains("<|im_start|>user\nHello<|im_end|>"), "{text}");
    assert!(g.count_prompt(&chat).unwrap() > g.count_prompt(&Prompt::Text("Hello".into())).unwrap());
}
