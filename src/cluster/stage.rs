//! One pipeline stage's engine side, shared by the node server and the coordinator's local stage: a
//! [`Session`] over a layer range, the prefix hash of every position it holds, and sampling on the last stage.
//!
//! Every request names the position it starts at and the hash of the token prefix before it. The stage runs it only
//! if it holds that exact prefix (then it rewinds to it: a rewind costs nothing on the wire); otherwise it answers
//! "mismatch" and the coordinator rebuilds it by replay. KV that belongs to another prefix is never used.

use super::wire::WantOut;
use super::{PrefixHash, prefix_next, prefix_root};
use crate::engine::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

/// Sampling parameters, sent to the last stage when a session opens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampled token with its log-probability and the top-k alternatives (log-softmax of the raw logits).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Picks the next token from `logits`: argmax when greedy, otherwise temperature + top-p sampling.
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng, top_k: usize) -> Sampled {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max + logits.iter().map(|&v| ((v - max) as f64).exp()).sum::<f64>().ln() as f32;
    let mut order: Vec<u32> = Vec::new();
    let token = if p.temperature <= 0.0 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        best as u32
    } else {
        order = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let t = p.temperature;
        let weights: Vec<f64> = order
            .iter()
            .map(|&i| (((logits[i as usize] - max) / t) as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut keep = weights.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (k, w) in weights.iter().enumerate() {
                acc += w / total;
                if acc >= p.top_p as f64 {
                    keep = k + 1;
                    break;
                }
            }
        }
        let kept: f64 = weights[..keep].iter().sum();
        let mut r = rng.r#gen::<f64>() * kept;
        let mut pick = order[keep - 1];
        for (k, w) in weights[..keep].iter().enumerate() {
            if r < *w {
                pick = order[k];
                break;
            }
            r -= w;
        }
        pick
    };
    let top = if top_k == 0 {
        Vec::new()
    } else {
        if order.is_empty() {
            // Partial selection: the k largest, then sorted.
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            let k = top_k.min(idx.len());
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            idx.truncate(k);
            idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            order = idx;
        }
        order
            .iter()
            .take(top_k)
            .map(|&i| (i, logits[i as usize] - lse))
            .collect()
    };
    Sampled {
        token,
        logprob: logits[token as usize] - lse,
        top,
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
    pub session: Session,
    /// `hashes[p]` is the hash of the prefix `0..p`; `len() == n_past() + 1`.
    hashes: Vec<PrefixHash>,
    pub sampling: SamplingParams,
    rng: StdRng,
    pub top_k: usize,
}

impl StageCore {
    pub fn new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        n_ctx: usize,
        n_batch: usize,
        sampling: SamplingParams,
        top_k: usize,
    ) -> Result<StageCore> {
        Ok(StageCore {
            session: Session::new(model, pool, n_ctx, n_batch)?,
            hashes: vec![prefix_root()],
            rng: StdRng::seed_from_u64(sampling.seed),
            sampling,
            top_k,
        })
    }

    pub fn n_past(&self) -> usize {
        self.session.n_past()
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

    /// Extends the prefix hashes with tokens just appended to the session by a forward pass run directly on it.
    pub fn record(&mut self, tokens: &[u32]) {
        let mut h = *self.hashes.last().unwrap();
        for &t in tokens {
            h = prefix_next(&h, t);
            self.hashes.push(h);
        }
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
        let model = self.session.model.clone();
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
        let input = match (model.is_first(), hidden) {
            (true, None) => Input::Tokens(tokens),
            (false, Some(h)) if h.len() == tokens.len() * e => Input::Hidden(h),
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
        };
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
            return Ok((StageOut::Mismatch(self.n_past()), 0));
        }
        self.session.rewind(pos);
        self.hashes.truncate(pos + 1);

        let t0 = Instant::now();
        let out = self.session.forward(input, engine_want);
        let us = t0.elapsed().as_micros() as u64;
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                // The cache may hold part of the batch; forget it.
                self.session.rewind(pos);
                return Err(e);
            }
        };
        let result = match want {
            WantOut::Ack => StageOut::Ack,
            WantOut::Hidden => StageOut::Hidden(out.to_vec()),
            WantOut::LastLogits | WantOut::AllLogits => StageOut::Logits(out.to_vec()),
            WantOut::Sample => StageOut::Sample(sample(out, &self.sampling, &mut self.rng, self.top_k)),
        };
        let mut h = *self.hashes.last().unwrap();
        for &t in tokens {
            h = prefix_next(&h, t);
            self.hashes.push(h);
        }
        Ok((result, us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_with_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let mut rng = StdRng::seed_from_u64(0);
        let s = sample(&logits, &SamplingParams::default(), &mut rng, 3);
        assert_eq!(s.token, 1, "first maximum wins");
        let lse = logits.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln() as f32;
        assert!((s.logprob - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>()[2], 2);
        assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let logits = [10.0f32, 0.0, 0.0, 9.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 3,
        };
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..50 {
            assert_eq!(sample(&logits, &p, &mut rng, 0).token, 0);
        }
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            seed: 3,
        };
        let seen: std::collections::HashSet<u32> = (0..400).map(|_| sample(&logits, &p, &mut rng, 0).token).collect();
        assert!(seen.contains(&3));
    }
}
