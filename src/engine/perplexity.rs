//! Perplexity as llama.cpp's `llama-perplexity` measures it: the text in chunks of the session's context, each
//! chunk evaluated from an empty cache (its first token replaced by BOS where the model adds one), the second half
//! of each chunk scored. One function, used by `baton perplexity` and by the golden tests that hold Baton to
//! llama.cpp, so the tests check the shipped code.

use super::{Input, Session, Want};
use crate::kernels::ops;
use anyhow::{Result, bail};

/// The running totals of a perplexity run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Score {
    /// Sum of the negative log-likelihoods of the scored tokens.
    pub nll: f64,
    /// Positions scored.
    pub count: usize,
    /// Positions whose most likely token was the text's next one.
    pub top1: usize,
}

impl Score {
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    pub fn top1_rate(&self) -> f64 {
        self.top1 as f64 / self.count as f64
    }
}

/// Scores the first `n_chunks` chunks of `session.n_ctx()` tokens of `tokens`, in batches of `session.n_batch()`.
/// `on_row(logits, target)` sees each scored position's logits and the text's next token, in order; `on_chunk(c,
/// score)` the totals after chunk `c`. Errors when `tokens` holds fewer than `n_chunks` chunks.
pub fn score(
    session: &mut Session,
    tokens: &[u32],
    n_chunks: usize,
    bos: Option<u32>,
    mut on_row: impl FnMut(&[f32], usize),
    mut on_chunk: impl FnMut(usize, &Score),
) -> Result<Score> {
    let (n_ctx, batch) = (session.n_ctx(), session.n_batch());
    if n_ctx < 8 {
        bail!("perplexity needs a context of at least 8 positions, not {n_ctx}");
    }
    if tokens.len() / n_ctx < n_chunks {
        bail!(
            "{} tokens hold {} chunks of {n_ctx}, not {n_chunks}",
            tokens.len(),
            tokens.len() / n_ctx
        );
    }
    let n_vocab = session.model().hp.n_vocab;
    let first = n_ctx / 2;
    let mut s = Score::default();
    for c in 0..n_chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        session.rewind(0);
        for (b, toks) in chunk.chunks(batch).enumerate() {
            let start = b * batch;
            let end = start + toks.len();
            // Only batches holding scored positions (first .. n_ctx-2) need logits.
            let want = if end > first { Want::AllLogits } else { Want::Hidden };
            let out = session.forward(Input::Tokens(toks), want)?;
            if want == Want::Hidden {
                continue;
            }
            for j in start.max(first)..end.min(n_ctx - 1) {
                let row = &out[(j - start) * n_vocab..(j - start + 1) * n_vocab];
                let target = chunk[j + 1] as usize;
                s.nll += ops::log_sum_exp(row) - row[target] as f64;
                s.count += 1;
                s.top1 += (ops::argmax(row) == target) as usize;
                on_row(row, target);
            }
        }
        on_chunk(c, &s);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::batch::tests::{prompt, tiny};
    use crate::kernels::ThreadPool;
    use crate::model::Arch;
    use std::sync::Arc;

    /// The totals are the sums over the rows `on_row` saw, and a chunk scores positions n_ctx/2 .. n_ctx-2.
    #[test]
    fn scores_the_second_half_of_each_chunk() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(Arch::Llama, dir.path());
        let mut session = Session::new(model, Arc::new(ThreadPool::new(1)), 16, 5).unwrap();
        let tokens = prompt(40, 3);
        let (mut nll, mut rows, mut chunks) = (0.0, 0, 0);
        let s = score(
            &mut session,
            &tokens,
            2,
            Some(1),
            |row, target| {
                nll += ops::log_sum_exp(row) - row[target] as f64;
                rows += 1;
            },
            |_, _| chunks += 1,
        )
        .unwrap();
        assert_eq!((s.count, rows, chunks), (2 * 7, 14, 2));
        assert_eq!(s.nll, nll);
        assert!(s.ppl().is_finite() && s.ppl() > 1.0);
        assert!(score(&mut session, &tokens, 3, None, |_, _| {}, |_, _| {}).is_err());
    }
}
