//! One pipeline stage's engine side, shared by the node server and the coordinator's local stage: a
//! [`Session`] over a layer range, the prefix hash of every position it holds, and sampling on the last stage.
//!
//! Every request names the position it starts at and the hash of the token prefix before it. The stage runs it only
//! if it holds that exact prefix (then it rewinds to it: a rewind costs nothing on the wire); otherwise it answers
//! "mismatch" and the coordinator rebuilds it by replay. KV that belongs to another prefix is never used.

use super::wire::WantOut;
use super::{PrefixHash, prefix_next, prefix_root};
use crate::engine::disk_cache::DiskCache;
use crate::engine::sampler::{Sampler, SamplerParams, top_logprobs};
use crate::engine::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Result, bail};
use std::sync::Arc;
use std::time::Instant;

/// A sampled token with its log-probability and the top-k alternatives (log-softmax of the raw logits).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Picks the next token from `logits` with `sampler` (its penalty window refilled from `history`, the tokens the
/// session holds, so replays and rewinds never leave it stale) and reports the `top_k` most likely alternatives.
pub fn sample(logits: &[f32], sampler: &mut Sampler, history: &[u32], top_k: usize) -> Sampled {
    let n = sampler.params().repeat_last_n;
    if n > 0 && sampler.params().repeat_penalty != 1.0 {
        sampler.reset();
        for &t in &history[history.len().saturating_sub(n)..] {
            sampler.accept(t);
        }
    }
    let token = sampler.sample(logits);
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max + logits.iter().map(|&v| ((v - max) as f64).exp()).sum::<f64>().ln() as f32;
    Sampled {
        token,
        logprob: logits[token as usize] - lse,
        top: top_logprobs(logits, top_k),
    }
}

/// What a stage produced for one request.
#[derive(Debug)]
pub enum StageOut {
    /// The stage does not hold the prefix the request builds on; it holds `n_past` positions.
    Mismatch(usize),
    Ack,
    Hidden(Vec<f32>),
    Sample(Sampled),
    Logits(Vec<f32>),
}

pub struct StageCore {
    session: Session,
    /// `hashes[p]` is the hash of the prefix `0..p`; `len() == n_past() + 1`.
    hashes: Vec<PrefixHash>,
    sampler: Sampler,
    top_k: usize,
}

impl StageCore {
    pub fn new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        n_ctx: usize,
        n_batch: usize,
        sampling: SamplerParams,
        top_k: usize,
    ) -> Result<StageCore> {
        Ok(StageCore {
            session: Session::new(model, pool, n_ctx, n_batch)?,
            hashes: vec![prefix_root()],
            sampler: Sampler::new(sampling, 0),
            top_k,
        })
    }

    /// New sampling parameters (a reopened session); the RNG restarts from their seed.
    pub fn set_sampling(&mut self, sampling: SamplerParams, top_k: usize) {
        self.sampler = Sampler::new(sampling, 0);
        self.top_k = top_k;
    }

    pub fn n_past(&self) -> usize {
        self.session.n_past()
    }

    pub fn session(&self) -> &Session {
        &self.session
    }

    /// For a forward pass run directly on the session (a batched decode step, a disaggregated prefill); the caller
    /// then [`StageCore::record`]s the tokens it appended, or [`StageCore::rewind`]s, so the prefix hashes follow.
    pub fn session_mut(&mut self) -> &mut Session {
        &mut self.session
    }

    /// Whether the stage holds positions `0..pos` with prefix hash `prefix` (then it may rewind to `pos`).
    pub fn holds_prefix(&self, pos: usize, prefix: &PrefixHash) -> bool {
        pos < self.hashes.len() && self.hashes[pos] == *prefix
    }

    /// Forgets every position from `n` on (KV and hashes).
    pub fn rewind(&mut self, n: usize) {
        self.session.rewind(n);
        self.hashes.truncate(n.min(self.hashes.len() - 1) + 1);
    }

    /// Extends the positions held `0..pos` (token ids `tokens[..pos]`) with the blocks of `tokens` found in `disk`
    /// (`--kv-cache-dir`), keeping the prefix hashes in step; returns the positions now held. Needs the session to
    /// know the ids of the positions it holds (a range fed from token ids does).
    pub fn load_from_disk(&mut self, disk: &DiskCache, tokens: &[u32]) -> Result<usize> {
        let pos = self.n_past();
        if self.session.tokens().len() != pos || tokens.get(..pos) != Some(self.session.tokens()) {
            bail!("the session does not hold a prefix of these tokens");
        }
        let held = disk.load_prefix(&mut self.session, tokens)?;
        // A block refused after its rewind can leave less than before; what was read holds these very ids.
        self.hashes.truncate(held.min(pos) + 1);
        if held > pos {
            self.record(&tokens[pos..held]);
        }
        Ok(held)
    }

    /// LOOKUP: keeps the longest prefix of `tokens` whose ids the session holds, then extends it with the blocks
    /// `disk` has; returns the positions now held. The coordinator then starts its FORWARDs at the least any stage
    /// holds.
    pub fn hold_prefix(&mut self, tokens: &[u32], disk: Option<&DiskCache>) -> Result<usize> {
        if tokens.len() > self.session.n_ctx() {
            bail!(
                "lookup of {} tokens exceeds the context size {}",
                tokens.len(),
                self.session.n_ctx()
            );
        }
        let known = &self.session.tokens()[..self.session.tokens().len().min(self.n_past())];
        let q = known.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        self.rewind(q);
        match disk {
            Some(d) => self.load_from_disk(d, tokens),
            None => Ok(q),
        }
    }

    /// Queues for `disk` the whole blocks the session holds, those from `fresh_from` on just computed (a no-op
    /// when the ids of some position held are unknown).
    pub fn store_to_disk(&self, disk: &DiskCache, fresh_from: usize) -> Result<()> {
        let s = &self.session;
        match s.tokens().get(..s.n_past()) {
            Some(tokens) => disk.store_prefix(s, tokens, fresh_from),
            None => Ok(()),
        }
    }

    /// Extends the prefix hashes with tokens just appended to the session by a forward pass run directly on it.
    pub fn record(&mut self, tokens: &[u32]) {
        let mut h = *self.hashes.last().unwrap();
        for &t in tokens {
            h = prefix_next(&h, t);
            self.hashes.push(h);
        }
    }

    /// Samples the next token from logits the session just produced for its last position (its tokens are the
    /// penalty window, as in [`StageCore::run`]); used after a disaggregated prefill on a decode node.
    pub fn sample_next(&mut self, logits: &[f32]) -> Sampled {
        sample(logits, &mut self.sampler, self.session.tokens(), self.top_k)
    }

    /// Runs one batch that starts at `pos` after the prefix hashed `prefix`.
    pub fn run(
        &mut self,
        pos: usize,
        prefix: &PrefixHash,
        tokens: &[u32],
        hidden: Option<&[f32]>,
        want: WantOut,
    ) -> Result<(StageOut, u64)> {
        match self.prepare(pos, prefix, tokens, hidden, want)? {
            Ok(prep) => self.forward_prepared(&prep, tokens, hidden),
            Err(mismatch) => Ok((mismatch, 0)),
        }
    }

    /// The forward pass of a request [`StageCore::prepare`] accepted, alone, then [`StageCore::finish`]; returns the
    /// output and the forward's time in microseconds.
    pub fn forward_prepared(
        &mut self,
        prep: &Prepared,
        tokens: &[u32],
        hidden: Option<&[f32]>,
    ) -> Result<(StageOut, u64)> {
        let input = match hidden {
            Some(h) => Input::Hidden(h),
            None => Input::Tokens(tokens),
        };
        let t0 = Instant::now();
        let out = self.session.forward(input, prep.engine_want);
        let us = t0.elapsed().as_micros() as u64;
        match out {
            Ok(o) => {
                let o = o.to_vec();
                Ok((self.finish(prep, tokens, &o), us))
            }
            Err(e) => {
                // The cache may hold part of the batch; forget it.
                self.session.rewind(prep.pos);
                Err(e)
            }
        }
    }

    /// Everything [`StageCore::run`] does before the forward pass: checks the request, checks the prefix (a
    /// mismatch comes back as `Ok(Err(StageOut::Mismatch))`), rewinds to `pos` and notes the penalty window. The
    /// caller then feeds `tokens` to the session (alone, or one row of a batched step) and calls
    /// [`StageCore::finish`] with its output.
    pub fn prepare(
        &mut self,
        pos: usize,
        prefix: &PrefixHash,
        tokens: &[u32],
        hidden: Option<&[f32]>,
        want: WantOut,
    ) -> Result<std::result::Result<Prepared, StageOut>> {
        let model = self.session.model().clone();
        let e = model.hp.n_embd;
        if tokens.is_empty() {
            bail!("empty batch");
        }
        if tokens.len() > self.session.n_batch() {
            bail!(
                "batch of {} tokens exceeds the session's batch size {}",
                tokens.len(),
                self.session.n_batch()
            );
        }
        if pos + tokens.len() > self.session.n_ctx() {
            bail!(
                "positions {pos}..{} exceed the context size {}",
                pos + tokens.len(),
                self.session.n_ctx()
            );
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= model.hp.n_vocab) {
            bail!("token id {t} is outside the vocabulary of {}", model.hp.n_vocab);
        }
        match (model.is_first(), hidden) {
            (true, None) => {}
            (false, Some(h)) if h.len() == tokens.len() * e => {}
            (false, Some(h)) => bail!(
                "hidden state of {} values for {} tokens of width {e}",
                h.len(),
                tokens.len()
            ),
            (true, Some(_)) => bail!(
                "layers {:?} start at 0 and take token ids, not a hidden state",
                model.range
            ),
            (false, None) => bail!(
                "layers {:?} need the hidden state entering layer {}",
                model.range,
                model.range.start
            ),
        }
        let last = model.is_last();
        let engine_want = match want {
            WantOut::Hidden | WantOut::Ack => Want::Hidden,
            WantOut::Sample | WantOut::LastLogits if last => Want::LastLogits,
            WantOut::AllLogits if last => Want::AllLogits,
            _ => bail!(
                "layers {:?} do not end at the output head; they return hidden states only",
                model.range
            ),
        };
        // The prefix check: hold exactly the prefix the request builds on, or refuse.
        if pos >= self.hashes.len() || self.hashes[pos] != *prefix {
            return Ok(Err(StageOut::Mismatch(self.n_past())));
        }
        self.session.rewind(pos);
        self.hashes.truncate(pos + 1);

        // The penalty window of a local run at this point: the positions before `pos` plus this batch.
        let mut history = Vec::new();
        if want == WantOut::Sample {
            let held = self.session.tokens();
            history.extend_from_slice(
                &held[held.len().min(pos).saturating_sub(self.sampler.params().repeat_last_n)..held.len().min(pos)],
            );
            history.extend_from_slice(tokens);
        }
        Ok(Ok(Prepared {
            pos,
            want,
            engine_want,
            history,
        }))
    }

    /// Everything [`StageCore::run`] does after the forward pass that appended `tokens` and produced `out`.
    pub fn finish(&mut self, prep: &Prepared, tokens: &[u32], out: &[f32]) -> StageOut {
        let result = match prep.want {
            WantOut::Ack => StageOut::Ack,
            WantOut::Hidden => StageOut::Hidden(out.to_vec()),
            WantOut::LastLogits | WantOut::AllLogits => StageOut::Logits(out.to_vec()),
            WantOut::Sample => StageOut::Sample(sample(out, &mut self.sampler, &prep.history, self.top_k)),
        };
        if !self.session.model().is_first() {
            self.session.note_tokens(prep.pos, tokens);
        }
        let mut h = *self.hashes.last().unwrap();
        for &t in tokens {
            h = prefix_next(&h, t);
            self.hashes.push(h);
        }
        result
    }
}

/// A request checked by [`StageCore::prepare`], waiting for its forward pass.
pub struct Prepared {
    pub pos: usize,
    pub want: WantOut,
    pub engine_want: Want,
    history: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplerParams) -> Sampler {
        Sampler::new(p, 0)
    }

    /// Greedy without the chain's cuts: what each test below starts from.
    fn plain() -> SamplerParams {
        SamplerParams {
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: Some(0),
            ..SamplerParams::greedy()
        }
    }

    #[test]
    fn greedy_picks_argmax_with_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let s = sample(&logits, &mut sampler(plain()), &[], 3);
        assert_eq!(s.token, 1, "first maximum wins");
        let lse = logits.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln() as f32;
        assert!((s.logprob - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>()[2], 2);
        assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let logits = [10.0f32, 0.0, 0.0, 9.0];
        let p = SamplerParams {
            temp: 1.0,
            top_p: 0.5,
            seed: Some(3),
            ..plain()
        };
        let mut s = sampler(p);
        for _ in 0..50 {
            assert_eq!(sample(&logits, &mut s, &[], 0).token, 0);
        }
        let mut s = sampler(SamplerParams { top_p: 1.0, ..p });
        let seen: std::collections::HashSet<u32> = (0..400).map(|_| sample(&logits, &mut s, &[], 0).token).collect();
        assert!(seen.contains(&3));
    }

    #[test]
    fn the_penalty_window_comes_from_the_history_given() {
        // Token 0 leads slightly; a penalty on recently seen tokens hands greedy decoding to token 1.
        let logits = [2.0f32, 1.9, 0.0];
        let p = SamplerParams {
            repeat_penalty: 1.5,
            repeat_last_n: 4,
            ..plain()
        };
        let mut s = sampler(p);
        assert_eq!(sample(&logits, &mut s, &[2, 2], 0).token, 0);
        assert_eq!(sample(&logits, &mut s, &[0, 2], 0).token, 1);
        // Out of the window again: only the last 4 tokens count.
        assert_eq!(sample(&logits, &mut s, &[0, 2, 2, 2, 2], 0).token, 0);
    }

    #[test]
    fn same_seed_samples_as_the_engine_sampler() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplerParams {
            temp: 0.9,
            top_p: 0.95,
            seed: Some(7),
            top_k: 20,
            min_p: 0.05,
            ..plain()
        };
        let mut ours = sampler(p);
        let mut engine = Sampler::new(p, logits.len());
        for _ in 0..20 {
            assert_eq!(sample(&logits, &mut ours, &[], 0).token, engine.sample(&logits));
        }
    }
}
