//! A model here whose prompts are prefilled (all or the first `k` layers) on the least-loaded node of a prefill
//! pool: `baton run --prefill-node` and `baton serve`'s local decode slots with prefill nodes. The planner, the pool
//! and the handoff it drives are in `cluster::disagg` and `cluster::handoff`.

use crate::cluster::disagg::{Offload, PrefillPool, Speeds, job_for, learn, plan, probe_local_speed};
use crate::cluster::handoff::{HandoffReport, NodeOpts, PrefillNode, prefill_with_fallback};
use crate::engine::sampler::Sampler;
use crate::engine::{Input, Session, Want};
use crate::generate::{GenParams, Generator, Outcome, Piece, Prompt, TextModel, decode_loop};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::Result;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `baton run --prefill-node` / `baton serve --prefill-node`: a full model here, prompts prefilled on the least-loaded
/// node of a pool; this process holds the KV afterwards and decodes alone.
pub struct DisaggGenerator {
    model: Arc<Model>,
    text: TextModel,
    session: Session,
    prefill: Arc<PrefillPool>,
    /// One link per pool member: its connection and its records of what that node holds for this session.
    links: Vec<PrefillNode>,
    offload: Offload,
    /// The planner's measurements per pool member (the local speed is the same for all).
    speeds: Vec<Speeds>,
    /// The member used last (preferred among equally loaded ones: it holds this conversation).
    last: Option<usize>,
}

impl DisaggGenerator {
    /// Connects nothing yet: a node is connected on the first request that uses it (and again after any failure).
    /// `link` gives the secret, timeouts and KV precision for every member. With `auto`, the local prefill speed is
    /// measured once here on a 128-token batch.
    pub fn new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        n_ctx: usize,
        n_batch: usize,
        link: NodeOpts,
        prefill: Arc<PrefillPool>,
        offload: Offload,
    ) -> Result<DisaggGenerator> {
        let text = TextModel::from_gguf(&model.file)?;
        let n_ctx = n_ctx.min(model.hp.n_ctx_train.max(1));
        let session = Session::new(model.clone(), pool.clone(), n_ctx, n_batch)?;
        let local = match offload {
            Offload::Auto => Some(probe_local_speed(&model, pool, n_batch)?),
            _ => None,
        };
        let links = prefill
            .members
            .iter()
            .map(|m| {
                PrefillNode::new(NodeOpts {
                    addr: m.addr.clone(),
                    ..link.clone()
                })
            })
            .collect();
        let speeds = vec![
            Speeds {
                local,
                ..Speeds::for_model(&model.hp)
            };
            prefill.members.len()
        ];
        Ok(DisaggGenerator {
            model,
            text,
            session,
            prefill,
            links,
            offload,
            speeds,
            last: None,
        })
    }

    /// Link rates to the pool's members (bytes/s, in pool order) known before any request, e.g. from a cluster
    /// file: the planner starts from them instead of learning the link from the first streams.
    pub fn seed_link_rates(&mut self, rates: &[Option<f64>]) {
        for (sp, r) in self.speeds.iter_mut().zip(rates) {
            if let Some(r) = r.filter(|r| r.is_finite() && *r > 0.0) {
                sp.link = Some(r);
            }
        }
    }

    /// Prefills `tokens` with layers offloaded to the least-loaded prefill node (or locally when none is up).
    fn prefill(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, HandoffReport, String)> {
        let Some(lease) = self.prefill.pick(self.last) else {
            let (logits, rep) = prefill_with_fallback(&mut self.session, None, tokens, 0)?;
            return Ok((logits, rep, "local: no prefill node is up".into()));
        };
        let i = lease.index;
        let job = job_for(&self.session, tokens, self.links[i].opts.kv);
        let (k, why) = plan(self.offload, &self.speeds[i], &job);
        let (logits, rep) = prefill_with_fallback(&mut self.session, Some(&mut self.links[i]), tokens, k)?;
        drop(lease);
        learn(&mut self.speeds[i], &rep);
        let local = self.speeds[i].local;
        self.speeds.iter_mut().for_each(|s| s.local = local);
        if k > 0 {
            self.prefill.report(i, &rep);
        }
        if rep.layers > 0 {
            self.last = Some(i);
        }
        let why = if self.prefill.members.len() > 1 {
            format!("{why} on {}", self.prefill.members[i].name)
        } else {
            why
        };
        Ok((logits, rep, why))
    }
}

impl Generator for DisaggGenerator {
    fn text(&self) -> &TextModel {
        &self.text
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.prefill.members.iter().map(|m| m.addr.as_str()).collect();
        format!("{}, prefill on {}", self.text.name(), names.join(", "))
    }

    fn n_ctx(&self) -> usize {
        self.session.n_ctx()
    }

    /// Prefill runs remotely but every token is sampled here, so the mask applies.
    fn constrains(&self) -> bool {
        true
    }

    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome> {
        let tokens = self.text.prompt_tokens(prompt, self.n_ctx())?;
        let t0 = Instant::now();
        let mut sampler = Sampler::after_prompt(params.sampler, self.model.hp.n_vocab, &tokens);
        for l in &mut self.links {
            l.request_id.clone_from(&params.request_id);
        }
        let (logits, rep, why) = self.prefill(&tokens)?;
        let top_k = params.top_logprobs;
        let text = &self.text;
        let mut guide = text.guide(params);
        let mut pick = |sampler: &mut Sampler, logits: &[f32]| text.pick_guided(sampler, guide.as_mut(), logits, top_k);
        let ts = Instant::now();
        let first = pick(&mut sampler, &logits);
        let t_sample = ts.elapsed();
        let t_prompt = t0.elapsed();
        let t1 = Instant::now();
        let session = &mut self.session;
        let mut first_step: Option<Duration> = None;
        let (n_gen, finish) = decode_loop(&text.vocab, first, params.max_tokens, sink, |tok| {
            sampler.accept(tok);
            if session.n_past() + 1 >= session.n_ctx() {
                return Ok(None);
            }
            let ts = Instant::now();
            let logits = session.forward(Input::Tokens(&[tok]), Want::LastLogits)?;
            let next = pick(&mut sampler, logits);
            first_step.get_or_insert(ts.elapsed());
            Ok(Some(next))
        })?;
        let mut detail = vec![format!("plan: {why}")];
        detail.extend(rep.lines());
        detail.push(format!(
            "ttft: {:.1} ms = prefill {:.1} ms + first sample {:.2} ms; first decode step {:.1} ms",
            t_prompt.as_secs_f64() * 1e3,
            rep.total.as_secs_f64() * 1e3,
            t_sample.as_secs_f64() * 1e3,
            first_step.unwrap_or_default().as_secs_f64() * 1e3
        ));
        Ok(Outcome {
            prompt_tokens: tokens.len(),
            cached_tokens: rep.held,
            completion_tokens: n_gen,
            finish,
            t_prompt,
            t_gen: t1.elapsed(),
            detail,
        })
    }
}
