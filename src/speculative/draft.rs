//! The draft model: a local [`Session`], or a `baton node` serving all its layers through a one-stage
//! [`PipelineSession`]. Either way the coordinator sees one thing: hold this token sequence (keeping the common
//! prefix, rewinding the rest) and give me the logits after it.
//!
//! A remote draft returns its top-[`REMOTE_TOP_K`] log-probabilities per step rather than a vocabulary of logits;
//! the coordinator rebuilds a logit vector from them (−∞ elsewhere) and runs its own sampler chain on it, so the
//! proposal distribution `q` the acceptance rule needs is exactly the one the drafted token was drawn from.

use crate::cluster::handshake::Timeouts;
use crate::cluster::{PipelineOpts, PipelineSession};
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

enum Backend {
    Local(Box<Session>),
    Remote {
        session: Box<PipelineSession>,
        /// Longest wait for one draft step; a longer stall counts as a dead draft.
        step_timeout: Duration,
    },
}

pub struct Draft {
    pub text: TextModel,
    backend: Backend,
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
            backend: Backend::Local(Box::new(Session::new(model, pool, n_ctx, n_batch)?)),
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
        };
        let session = PipelineSession::connect(&format!("{addr}=0:end"), model_path, opts)?;
        let n_vocab = session.hparams().n_vocab;
        Ok(Draft {
            label: format!("{}@{addr}", text.name()),
            text,
            backend: Backend::Remote {
                session: Box::new(session),
                step_timeout,
            },
            n_vocab,
            dense: vec![f32::NEG_INFINITY; n_vocab],
        })
    }

    pub fn is_remote(&self) -> bool {
        matches!(self.backend, Backend::Remote { .. })
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    pub fn n_ctx(&self) -> usize {
        match &self.backend {
            Backend::Local(s) => s.n_ctx(),
            Backend::Remote { session, .. } => session.n_ctx(),
        }
    }

    /// Positions the draft holds.
    pub fn n_past(&self) -> usize {
        match &self.backend {
            Backend::Local(s) => s.n_past(),
            Backend::Remote { session, .. } => session.n_past(),
        }
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
        match &mut self.backend {
            Backend::Local(s) => {
                let kept = s.reuse_prefix(seq);
                Ok((s.eval(&seq[kept..])?, seq.len() - kept))
            }
            Backend::Remote { session, step_timeout } => {
                let kept = session.reuse_prefix(seq);
                let n = seq.len() - kept;
                // A prompt takes longer than a step: allow 200 ms a token on top (a loaded one-thread node).
                session.set_io_timeout(*step_timeout + Duration::from_millis(200 * n as u64));
                let s = session.eval(&seq[kept..])?;
                Ok((rebuild(&mut self.dense, &s.top, s.token), n))
            }
        }
    }

    /// Appends one token and returns the logits after it.
    pub fn step(&mut self, token: u32) -> Result<&[f32]> {
        match &mut self.backend {
            Backend::Local(s) => {
                if s.n_past() + 1 >= s.n_ctx() {
                    bail!("the draft's context of {} tokens is full", s.n_ctx());
                }
                s.eval(&[token])
            }
            Backend::Remote { session, step_timeout } => {
                if session.n_past() + 1 >= session.n_ctx() {
                    bail!("the draft's context of {} tokens is full", session.n_ctx());
                }
                session.set_io_timeout(*step_timeout);
                let s = session.decode_step(token)?;
                Ok(rebuild(&mut self.dense, &s.top, s.token))
            }
        }
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
