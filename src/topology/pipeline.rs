//! A model whose layers run on `baton node`s (with the last range possibly here): `baton run --pipeline` and
//! `--decode-node`, `baton serve --pipeline` and remote decode nodes of `--cluster`.

use crate::cluster::disagg::RemotePrefill;
use crate::cluster::{PipelineOpts, PipelineSession, Sampled};
use crate::generate::{GenParams, Generator, Next, Outcome, Piece, Prompt, TextModel, decode_loop};
use anyhow::Result;
use std::path::Path;
use std::time::Instant;

/// A model whose layers are spread over nodes; the last stage samples, so only a token and its top-k
/// log-probabilities come back per step.
pub struct PipelineGenerator {
    text: TextModel,
    spec: String,
    n_ctx: usize,
    session: PipelineSession,
    /// With a single remote full-model stage (a decode node): prompts are prefilled by a prefill node whose KV the
    /// decode node pulls (`baton run --decode-node D --prefill-node P`).
    remote_prefill: Option<RemotePrefill>,
}

impl PipelineGenerator {
    /// Connects to every stage of `spec` (see `baton run --pipeline`). `remote_prefill` is given here, not set
    /// later, so a generator never runs a request with half its topology.
    pub fn connect(
        spec: &str,
        model_path: &Path,
        opts: PipelineOpts,
        remote_prefill: Option<RemotePrefill>,
    ) -> Result<PipelineGenerator> {
        let text = TextModel::open(model_path)?;
        let n_ctx = opts.n_ctx;
        let session = PipelineSession::connect(spec, model_path, opts)?;
        Ok(PipelineGenerator {
            text,
            spec: spec.to_string(),
            n_ctx,
            session,
            remote_prefill,
        })
    }

    pub fn session(&self) -> &PipelineSession {
        &self.session
    }
}

impl Generator for PipelineGenerator {
    fn text(&self) -> &TextModel {
        &self.text
    }

    fn describe(&self) -> String {
        format!("{}, pipeline {}", self.text.name(), self.spec)
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome> {
        let tokens = self.text.prompt_tokens(prompt, self.n_ctx())?;
        let t0 = Instant::now();
        let k = params.top_logprobs;
        let text = &self.text;
        // A request without a seed gets a fresh one, as a local run does.
        let p = &mut self.session;
        p.set_sampling(params.sampler, params.top_logprobs);
        p.set_request_id(&params.request_id);
        let mut cached = p.reuse_prefix(&tokens);
        // Stages whose nodes keep a disk cache may hold more: asked when a whole block could be gained.
        let block = crate::engine::disk_cache::BLOCK;
        if self.remote_prefill.is_none() && tokens.len() > (cached / block + 1) * block {
            cached = p.hold_prefix(&tokens, cached);
        }
        p.reset_stats();
        let conv = |s: Sampled| -> Next {
            let top = if k == 0 { Vec::new() } else { text.top_text(&s.top) };
            (s.token, (k > 0).then_some(s.logprob), top)
        };
        let (first, mut detail) = match &mut self.remote_prefill {
            Some(rp) => rp.eval(p, &tokens[cached..])?,
            None => (p.eval(&tokens[cached..])?, Vec::new()),
        };
        let first = conv(first);
        let t_prompt = t0.elapsed();
        let t1 = Instant::now();
        let (n_gen, finish) = decode_loop(&text.vocab, first, params.max_tokens, sink, |tok| {
            if p.n_past() + 1 >= p.n_ctx() {
                return Ok(None);
            }
            Ok(Some(conv(p.decode_step(tok)?)))
        })?;
        detail.extend(p.stats().iter().map(|st| {
            format!(
                "stage {} layers {:?}: {} requests, {} tokens, compute {:.2} s, wall {:.2} s, sent {} B, \
                     received {} B, {} reconnects",
                st.label,
                st.layers,
                st.requests,
                st.tokens,
                st.compute.as_secs_f64(),
                st.wall.as_secs_f64(),
                st.bytes_sent,
                st.bytes_recv,
                st.reconnects
            )
        }));
        Ok(Outcome {
            prompt_tokens: tokens.len(),
            cached_tokens: cached,
            completion_tokens: n_gen,
            finish,
            t_prompt,
            t_gen: t1.elapsed(),
            detail,
        })
    }
}
