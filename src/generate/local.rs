//! A model on this machine: the generator of `baton run` without cluster flags and of `baton serve`'s local slots.

use super::{GenParams, Generator, Outcome, Piece, Prompt, TextModel, decode_loop};
use crate::engine::batcher::{Batcher, LocalStep, Seat};
use crate::engine::disk_cache::DiskCache;
use crate::engine::sampler::Sampler;
use crate::engine::snapshot::{self, RowDtype};
use crate::engine::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Context, Result, anyhow, bail};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// A model on this machine: one [`Session`] whose KV is kept between requests.
pub struct LocalGenerator {
    pub model: Arc<Model>,
    pub text: TextModel,
    /// Always here except while lent to the batcher for a step (gone only if the batcher died with it).
    session: Option<Box<Session>>,
    n_ctx: usize,
    /// Decode steps shared with other sessions' in one batched forward (`baton serve`); `None`: each step alone.
    seat: Option<Seat>,
    /// Prompt prefixes kept on disk (`--kv-cache-dir`).
    disk: Option<Arc<DiskCache>>,
    /// Draw a bar over the prompt's tokens while it is prefilled (`baton run -v`; only on a terminal).
    progress: bool,
}

impl LocalGenerator {
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, n_ctx: usize, n_batch: usize) -> Result<LocalGenerator> {
        let text = TextModel::from_gguf(&model.file)?;
        let n_ctx = n_ctx.min(model.hp.n_ctx_train.max(1));
        let session = Session::new(model.clone(), pool, n_ctx, n_batch)?;
        Ok(LocalGenerator {
            model,
            text,
            session: Some(Box::new(session)),
            n_ctx,
            seat: None,
            disk: None,
            progress: false,
        })
    }

    /// Decodes through `batcher`, together with the other sessions using it (prefill stays on this thread).
    pub fn with_batcher(mut self, batcher: &Arc<Batcher<LocalStep>>) -> LocalGenerator {
        self.seat = Some(batcher.seat());
        self
    }

    /// Draws a progress bar over each prompt's prefill (when standard error is a terminal).
    pub fn with_progress(mut self, on: bool) -> LocalGenerator {
        self.progress = on;
        self
    }

    /// Tokens whose KV this generator holds (for routing requests to the cache that shares their prefix).
    pub fn cached_tokens(&self) -> &[u32] {
        self.session.as_deref().map_or(&[], |s| &s.tokens()[..s.n_past()])
    }
}

fn session_mut(slot: &mut Option<Box<Session>>) -> Result<&mut Session> {
    slot.as_deref_mut()
        .ok_or_else(|| anyhow!("this generator's session was lost with the batcher"))
}

impl Generator for LocalGenerator {
    fn text(&self) -> &TextModel {
        &self.text
    }

    fn describe(&self) -> String {
        format!("{}, local", self.text.name())
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

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
        let k = params.top_logprobs;
        let text = &self.text;
        let slot = &mut self.session;
        let mut guide = text.guide(params);
        let mut pick = |sampler: &mut Sampler, logits: &[f32]| text.pick_guided(sampler, guide.as_mut(), logits, k);
        let disk = self.disk.as_deref();
        let progress = self.progress;
        let (cached, first) = {
            let session = session_mut(slot)?;
            let mut cached = session.reuse_prefix(&tokens);
            if let Some(d) = disk {
                cached = d.load_prefix(session, &tokens)?;
            }
            let todo = &tokens[cached..];
            // A bar only where the prompt takes more than one batch: a single forward has nothing to show.
            let bar = (progress && todo.len() > session.n_batch())
                .then(|| crate::util::count_bar(todo.len() as u64, "prefill", "tokens"));
            let logits = session
                .eval_reporting(todo, &mut |n| {
                    if let Some(b) = &bar {
                        b.inc(n as u64)
                    }
                })
                .context("prompt processing failed")?;
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
            (cached, pick(&mut sampler, logits))
        };
        let t_prompt = t0.elapsed();
        if let Some(d) = disk
            && let Err(e) = d.store_prefix(session_mut(slot)?, &tokens, cached)
        {
            tracing::warn!("kv-cache: not storing this prompt: {e:#}");
        }
        let t1 = Instant::now();
        let mut seat = self.seat.as_mut();
        let _decoding = seat.as_ref().map(|s| s.batcher().decoding());
        let (n_gen, finish) = decode_loop(&text.vocab, first, params.max_tokens, sink, |tok| {
            sampler.accept(tok);
            let session = session_mut(slot)?;
            if session.n_past() + 1 >= session.n_ctx() {
                return Ok(None);
            }
            let logits = match seat.as_deref_mut() {
                Some(seat) => seat.step(slot, tok)?,
                None => session.forward(Input::Tokens(&[tok]), Want::LastLogits)?,
            };
            Ok(Some(pick(&mut sampler, logits)))
        })?;
        Ok(Outcome {
            prompt_tokens: tokens.len(),
            cached_tokens: cached,
            completion_tokens: n_gen,
            finish,
            t_prompt,
            t_gen: t1.elapsed(),
            detail: Vec::new(),
        })
    }

    fn set_disk_cache(&mut self, cache: Arc<DiskCache>) -> Result<()> {
        self.disk = Some(cache);
        Ok(())
    }

    fn save_session(&self, path: &Path) -> Result<usize> {
        let s = self
            .session
            .as_deref()
            .ok_or_else(|| anyhow!("this generator's session was lost with the batcher"))?;
        let n = s.n_past();
        if n == 0 {
            bail!("the session holds nothing to save");
        }
        snapshot::save(s, path, s.kv().layers.clone(), 0..n, RowDtype::F16)
            .with_context(|| format!("cannot save the session to {}", path.display()))?;
        Ok(n)
    }

    fn load_session(&mut self, path: &Path) -> Result<usize> {
        let s = session_mut(&mut self.session)?;
        let info = snapshot::restore(s, path)?;
        Ok(info.pos.end)
    }
}
