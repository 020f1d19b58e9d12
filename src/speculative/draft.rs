//! The draft model: a local [`Session`], or a `baton node` serving all its layers through a one-stage
//! [`PipelineSession`]. Either way the coordinator sees one thing: hold this token sequence (keeping the common
//! prefix, rewinding the rest) and give me the logits after it.
//!
//! A remote draft returns its top-[`REMOTE_TOP_K`] log-probabilities per step rather than a vocabulary of logits;
//! the coordinator rebuilds a logit vector from them (−∞ elsewhere) and runs its own sampler chain on it, so the
//! proposal distribution `q` the acceptance rule needs is exactly the one the drafted token was drawn from.

use crate::cluster::handshake::Timeouts;
use crate::cluster::{ModelHandle, Next, PipelineOpts, PipelineSession};
use crate::engine::Session;
use crate::engine::sampler::SamplerParams;
use crate::engine::snapshot::RowDtype;
use crate::generate::TextModel;
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Result, bail};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Log-probabilities a remote draft returns per step (~0.5 KB on the wire).
pub const REMOTE_TOP_K: usize = 64;

pub struct Draft {
    pub text: TextModel,
    handle: ModelHandle,
    /// Longest wait for one remote draft step; a longer stall counts as a dead draft.
    step_timeout: Duration,
    /// "name, local" or "name@host:port".
    pub label: String,
    n_vocab: usize,
    /// Rebuilt logits of a remote step.
    dense: Vec<f32>,
}

impl Draft {
    /// A draft running here, sharing the target's threads (the two never run at once).
    pub fn local(model: Arc<Model>, pool: Arc<ThreadPool>, n_ctx: usize, n_batch: usize) -> Result<Draft> {
        let text = TextModel::from_gguf(&model.file)?;
        let n_ctx = n_ctx.min(model.hp.n_ctx_train.max(1));
        let n_vocab = model.hp.n_vocab;
        let label = format!("{}, local", text.name());
        Ok(Draft {
            text,
            handle: ModelHandle::Local(Box::new(Session::new(model, pool, n_ctx, n_batch)?)),
            step_timeout: Duration::ZERO,
            label,
            n_vocab,
            dense: Vec::new(),
        })
    }

    /// A draft on a `baton node` at `addr` serving every layer of the model at `model_path` (read here only for
    /// its tokenizer and fingerprint).
    pub fn remote(
        model_path: &Path,
        addr: &str,
        n_ctx: usize,
        secret: Option<Vec<u8>>,
        step_timeout: Duration,
    ) -> Result<Draft> {
        let text = TextModel::open(model_path)?;
        let opts = PipelineOpts {
            n_ctx,
            chunk: 256,
            wire: RowDtype::F32,
            secret,
            threads: 1,
            timeouts: Timeouts {
                connect: step_timeout.max(Duration::from_secs(1)),
                io: step_timeout.max(Duration::from_secs(5)),
            },
            // The node returns its argmax (cheap) and the top log-probabilities; the coordinator samples.
            sampling: SamplerParams::greedy(),
            top_k: REMOTE_TOP_K,
            verbose: false,
            ..Default::default()
        };
        let session = PipelineSession::connect(&format!("{addr}=0:end"), model_path, opts)?;
        let n_vocab = session.hparams().n_vocab;
        Ok(Draft {
            label: format!("{}@{addr}", text.name()),
            text,
            handle: ModelHandle::Remote(Box::new(session)),
            step_timeout,
            n_vocab,
            dense: vec![f32::NEG_INFINITY; n_vocab],
        })
    }

    /// The request the draft's node serves next (logged there).
    pub fn set_request_id(&mut self, id: &str) {
        self.handle.set_request_id(id);
    }

    pub fn is_remote(&self) -> bool {
        self.handle.is_remote()
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    pub fn n_ctx(&self) -> usize {
        self.handle.n_ctx()
    }

    /// Positions the draft holds.
    pub fn n_past(&self) -> usize {
        self.handle.n_past()
    }

    /// Makes the draft hold exactly `seq` (the common prefix is kept, the rest rewound, the difference fed in one
    /// batch) and returns the logits after its last token. Returns how many tokens were fed, too.
    pub fn sync(&mut self, seq: &[u32]) -> Result<(&[f32], usize)> {
        if seq.is_empty() {
            bail!("nothing to draft from");
        }
        if seq.len() >= self.n_ctx() {
            bail!("the draft's context of {} tokens is full", self.n_ctx());
        }
        let kept = self.handle.reuse_prefix(seq);
        let n = seq.len() - kept;
        // A prompt takes longer than a step: allow 200 ms a token on top (a loaded one-thread node).
        self.handle
            .set_io_timeout(self.step_timeout + Duration::from_millis(200 * n as u64));
        let next = self.handle.eval(&seq[kept..])?;
        Ok((logits(&mut self.dense, next), n))
    }

    /// Appends one token and returns the logits after it.
    pub fn step(&mut self, token: u32) -> Result<&[f32]> {
        if self.handle.n_past() + 1 >= self.handle.n_ctx() {
            bail!("the draft's context of {} tokens is full", self.handle.n_ctx());
        }
        self.handle.set_io_timeout(self.step_timeout);
        let next = self.handle.step(token)?;
        Ok(logits(&mut self.dense, next))
    }
}

/// The logits a step gave: a local session's own, or rebuilt in `dense` from a node's top log-probabilities.
fn logits<'a>(dense: &'a mut [f32], next: Next<'a>) -> &'a [f32] {
    match next {
        Next::Logits(l) => l,
        Next::Top(s) => rebuild(dense, &s.top, s.token),
    }
}

/// A logit vector from top log-probabilities (−∞ elsewhere); the node's own pick when it sent none.
fn rebuild<'a>(dense: &'a mut [f32], top: &[(u32, f32)], token: u32) -> &'a [f32] {
    dense.fill(f32::NEG_INFINITY);
    for &(t, lp) in top {
        if let Some(d) = dense.get_mut(t as usize) {
            *d = lp;
        }
    }
    if top.is_empty()
        && let Some(d) = dense.get_mut(token as usize)
    {
        *d = 0.0;
    }
    dense
}
