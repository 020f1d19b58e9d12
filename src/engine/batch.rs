//! Batched decode across sessions: one forward pass over the next token of each of several sessions.
//!
//! Decode is bound by reading the weights: a step over B sessions reads them once instead of B times. The matmuls
//! run over the B rows together; each row attends over its own session's KV at its own position (sliding windows
//! included), and each row gets its own logits. The sessions keep their KV, tokens and positions exactly as if
//! each had been fed its token alone, so they go on with prefill, prefix reuse or single steps afterwards.

use super::session::{self, Session};
use crate::backend::{LayerKv, RowsKv};
use crate::kernels::ThreadPool;
use crate::model::Model;
use crate::model::blocks::{Buffers, Step};
use crate::model::rope::RopeTables;
use anyhow::{Result, bail};
use half::f16;
use std::ops::DerefMut;
use std::sync::Arc;

/// The scratch of batched steps over up to `max_rows` sessions of one model, allocated once: a step allocates
/// nothing.
pub struct Batch {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    max_rows: usize,
    n_ctx: usize,
    ropes: RopeTables,
    bufs: Buffers,
    /// Residual stream, one row per session.
    x: Vec<f32>,
    head_in: Vec<f32>,
    /// `[rows, n_vocab]`.
    logits: Vec<f32>,
}

/// Row `t` of the batch is session `t`'s next position in its own cache.
struct EachKv<'a, S> {
    sessions: &'a mut [S],
    il: usize,
}

impl<S: DerefMut<Target = Session> + Sync> RowsKv for EachKv<'_, S> {
    fn pos(&self, t: usize) -> usize {
        self.sessions[t].n_past()
    }

    fn read(&self, t: usize) -> (&[f16], &[f16], usize) {
        let kv = self.sessions[t].kv();
        let (k, v) = kv.layer(self.il);
        (k, v, kv.n_ctx)
    }

    fn write(&mut self, t: usize) -> LayerKv<'_> {
        self.sessions[t].kv_mut().layer_mut(self.il)
    }
}

impl Batch {
    /// Scratch for steps over up to `max_rows` sessions of `model` whose contexts are at most `n_ctx` positions.
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, max_rows: usize, n_ctx: usize) -> Result<Batch> {
        if max_rows == 0 || n_ctx == 0 {
            bail!("a batch needs at least one row and one position");
        }
        if model.embeddings().is_none() || !model.is_last() {
            bail!(
                "batched decode needs the whole model (tokens in, logits out), not layers {:?}",
                model.range
            );
        }
        let hp = &model.hp;
        Ok(Batch {
            ropes: RopeTables::new(&model.hp, model.range.clone(), n_ctx),
            bufs: Buffers::new(hp, max_rows, n_ctx, pool.n_threads()),
            x: vec![0.0; max_rows * hp.n_embd],
            head_in: vec![0.0; max_rows * hp.n_embd],
            logits: vec![0.0; max_rows * hp.n_vocab],
            max_rows,
            n_ctx,
            model,
            pool,
        })
    }

    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Whether this scratch steps sessions of `model` (the same loaded model).
    pub fn serves(&self, model: &Arc<Model>) -> bool {
        Arc::ptr_eq(&self.model, model)
    }

    /// Feeds `tokens[t]` to `sessions[t]` at its next position, all in one forward pass, and returns the logits,
    /// `[sessions.len(), n_vocab]`, row `t` for session `t`. Nothing changes when an error is returned.
    pub fn step<S: DerefMut<Target = Session> + Sync>(&mut self, sessions: &mut [S], tokens: &[u32]) -> Result<&[f32]> {
        let model = self.model.clone();
        let hp = &model.hp;
        let n = sessions.len();
        if n == 0 || n > self.max_rows {
            bail!("a batched step takes 1 to {} sessions, not {n}", self.max_rows);
        }
        if tokens.len() != n {
            bail!("{} tokens for {n} sessions", tokens.len());
        }
        for s in sessions.iter() {
            if !Arc::ptr_eq(s.model(), &model) {
                bail!("a batched step runs sessions of one loaded model only");
            }
            if s.n_ctx() > self.n_ctx {
                bail!(
                    "a session of {} positions exceeds the batch's {}",
                    s.n_ctx(),
                    self.n_ctx
                );
            }
            if s.n_past() + 1 > s.n_ctx() {
                bail!(
                    "context full: a session holds all {} positions (use a larger -c)",
                    s.n_ctx()
                );
            }
        }
        if sessions.iter().any(|s| !s.gpu_layers().is_empty()) {
            return self.step_each(sessions, tokens);
        }
        session::embed(&model, tokens, &mut self.x)?;
        let be = crate::backend::for_numerics(crate::kernels::ggml::Numerics::from_env());
        // Sessions of one model share its experts peer (`--experts-split`).
        let experts = sessions[0].remote_experts().cloned();

        for il in model.range.clone() {
            let step = Step {
                hp,
                pool: &self.pool,
                rope: self.ropes.of(il),
                il,
                n_tok: n,
                be,
                experts: experts.as_deref(),
            };
            let mut rows = EachKv {
                sessions: &mut *sessions,
                il,
            };
            session::layer(&step, &model, &mut self.x, &mut self.bufs, &mut rows);
        }
        for (s, &tok) in sessions.iter_mut().zip(tokens) {
            s.push_decoded(tok);
        }
        session::head(
            &model,
            &self.pool,
            be,
            &self.x,
            0..n,
            &mut self.head_in,
            &mut self.logits,
            &mut self.bufs.sc,
        );
        Ok(&self.logits[..n * hp.n_vocab])
    }

    /// The step of sessions whose layers run (partly) on a GPU: each its own forward pass, since the GPU keeps each
    /// session's cache apart. When one fails, the sessions stepped before it are rewound: nothing changes.
    fn step_each<S: DerefMut<Target = Session>>(&mut self, sessions: &mut [S], tokens: &[u32]) -> Result<&[f32]> {
        let nv = self.model.hp.n_vocab;
        for t in 0..sessions.len() {
            match sessions[t].forward(super::Input::Tokens(&tokens[t..t + 1]), super::Want::LastLogits) {
                Ok(row) => self.logits[t * nv..(t + 1) * nv].copy_from_slice(row),
                Err(e) => {
                    for s in &mut sessions[..t] {
                        let n = s.n_past() - 1;
                        s.rewind(n);
                    }
                    return Err(e);
                }
            }
        }
        Ok(&self.logits[..sessions.len() * nv])
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::{Input, Want};
    use crate::gguf::GgufFile;
    use crate::model::Arch;
    use crate::model::random::{RandomSpec, write_random_model};

    /// A tiny random-weight model of `arch` written into `dir`, built on smollm2's file (fetched into the cache on
    /// first use; a test that cannot get it fails rather than passing untested).
    pub(crate) fn tiny(arch: Arch, dir: &std::path::Path) -> Arc<Model> {
        let base = crate::fetch::resolve("smollm2").unwrap_or_else(|e| panic!("model smollm2 unavailable: {e:#}"));
        let p = dir.join(format!("{}.gguf", arch.name()));
        write_random_model(&GgufFile::open(&base).unwrap(), &RandomSpec::tiny(arch), &p).unwrap();
        Arc::new(Model::load(&p).unwrap())
    }

    /// Tokens every vocabulary here has.
    pub(crate) fn prompt(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| 100 + (i * 37 + seed * 11) % 900).collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// Three sessions at different positions (the random gemma3's window of 16 crossed by two of them), stepped
    /// together, give the logits each gets alone, and then hold the same KV positions and tokens.
    #[test]
    fn batched_step_matches_single_steps_random_models() {
        let dir = tempfile::tempdir().unwrap();
        let pool = Arc::new(ThreadPool::new(2));
        for arch in [Arch::Llama, Arch::Gemma3, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe] {
            let m = tiny(arch, dir.path());
            let nv = m.hp.n_vocab;
            let lens = [3, 20, 41];
            let new = || Session::new(m.clone(), pool.clone(), 64, 64).unwrap();
            let (mut alone, mut batched): (Vec<Session>, Vec<Session>) = (Vec::new(), Vec::new());
            for (i, &n) in lens.iter().enumerate() {
                let toks = prompt(n, i as u32);
                for v in [&mut alone, &mut batched] {
                    let mut s = new();
                    s.eval(&toks).unwrap();
                    v.push(s);
                }
            }
            let mut batch = Batch::new(m.clone(), pool.clone(), 4, 64).unwrap();
            for step in 0..20u32 {
                let toks: Vec<u32> = (0..3).map(|i| 200 + step * 3 + i).collect();
                let mut refs: Vec<&mut Session> = batched.iter_mut().collect();
                let got = batch.step(&mut refs, &toks).unwrap().to_vec();
                for (i, s) in alone.iter_mut().enumerate() {
                    let want = s.forward(Input::Tokens(&toks[i..i + 1]), Want::LastLogits).unwrap();
                    let d = max_diff(want, &got[i * nv..(i + 1) * nv]);
                    assert!(d < 1e-3, "{arch:?} step {step} row {i}: logits differ by {d}");
                }
            }
            for (a, b) in alone.iter().zip(&batched) {
                assert_eq!(a.n_past(), b.n_past());
                assert_eq!(a.tokens(), b.tokens());
            }
        }
    }

    #[test]
    fn bad_batches_are_refused_and_change_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny(Arch::Llama, dir.path());
        let pool = Arc::new(ThreadPool::new(1));
        let other = Arc::new(Model::load(&dir.path().join("llama.gguf")).unwrap());
        let mut batch = Batch::new(m.clone(), pool.clone(), 2, 8).unwrap();
        let mut a = Session::new(m.clone(), pool.clone(), 8, 8).unwrap();
        let mut b = Session::new(m.clone(), pool.clone(), 8, 8).unwrap();
        let mut c = Session::new(m.clone(), pool.clone(), 8, 8).unwrap();
        a.eval(&prompt(8, 0)).unwrap();
        b.eval(&prompt(3, 1)).unwrap();
        let err = |r: Result<&[f32]>| format!("{:#}", r.expect_err("refused"));
        assert!(err(batch.step(&mut [&mut a, &mut b], &[1, 2])).contains("context full"));
        assert!(err(batch.step(&mut [&mut b, &mut c], &[1])).contains("1 tokens for 2"));
        assert!(err(batch.step(&mut [&mut b, &mut c], &[1, 999_999])).contains("outside the vocabulary"));
        assert!(err(batch.step(&mut [&mut a, &mut b, &mut c], &[1, 2, 3])).contains("1 to 2 sessions"));
        let mut d = Session::new(other, pool.clone(), 8, 8).unwrap();
        assert!(err(batch.step(&mut [&mut d], &[1])).contains("one loaded model"));
        let mut big = Session::new(m.clone(), pool.clone(), 16, 8).unwrap();
        assert!(err(batch.step(&mut [&mut big], &[1])).contains("exceeds the batch"));
        assert_eq!((b.n_past(), c.n_past()), (3, 0));
        batch.step(&mut [&mut b, &mut c], &[1, 2]).unwrap();
        assert_eq!((b.n_past(), c.n_past()), (4, 1));
        assert_eq!(&c.tokens(), &[2]);
    }
}
