//! One model's session, here or on a `baton node` serving all its layers: what a speculative draft and an
//! ensemble member drive, the same way wherever the model runs.

use super::pipeline::{PipelineSession, StageStats};
use super::stage::Sampled;
use crate::engine::{Input, Session, Want};
use anyhow::Result;
use std::time::Duration;

pub enum ModelHandle {
    Local(Box<Session>),
    Remote(Box<PipelineSession>),
}

/// What a forward pass gives about the next token: the full logits (local) or the node's pick with its top
/// log-probabilities (remote: the rest never crosses the wire).
pub enum Next<'a> {
    Logits(&'a [f32]),
    Top(Sampled),
}

impl ModelHandle {
    pub fn is_remote(&self) -> bool {
        matches!(self, ModelHandle::Remote(_))
    }

    pub fn n_ctx(&self) -> usize {
        match self {
            ModelHandle::Local(s) => s.n_ctx(),
            ModelHandle::Remote(p) => p.n_ctx(),
        }
    }

    pub fn n_vocab(&self) -> usize {
        match self {
            ModelHandle::Local(s) => s.model().hp.n_vocab,
            ModelHandle::Remote(p) => p.hparams().n_vocab,
        }
    }

    /// The tokens the session holds, in order.
    pub fn tokens(&self) -> &[u32] {
        match self {
            ModelHandle::Local(s) => &s.tokens()[..s.n_past().min(s.tokens().len())],
            ModelHandle::Remote(p) => p.tokens(),
        }
    }

    pub fn n_past(&self) -> usize {
        match self {
            ModelHandle::Local(s) => s.n_past(),
            ModelHandle::Remote(p) => p.n_past(),
        }
    }

    pub fn rewind(&mut self, n: usize) {
        match self {
            ModelHandle::Local(s) => s.rewind(n),
            ModelHandle::Remote(p) => p.rewind(n),
        }
    }

    /// Keeps the longest prefix of `tokens` the session holds; returns its length.
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> usize {
        match self {
            ModelHandle::Local(s) => s.reuse_prefix(tokens),
            ModelHandle::Remote(p) => p.reuse_prefix(tokens),
        }
    }

    /// Appends `tokens` (one batch or more) and tells about the token after them.
    pub fn eval(&mut self, tokens: &[u32]) -> Result<Next<'_>> {
        Ok(match self {
            ModelHandle::Local(s) => Next::Logits(s.eval(tokens)?),
            ModelHandle::Remote(p) => Next::Top(p.eval(tokens)?),
        })
    }

    /// Appends one generated token: [`ModelHandle::eval`] of one token, a decode step on a node.
    pub fn step(&mut self, token: u32) -> Result<Next<'_>> {
        Ok(match self {
            ModelHandle::Local(s) => Next::Logits(s.eval(&[token])?),
            ModelHandle::Remote(p) => Next::Top(p.decode_step(token)?),
        })
    }

    /// Appends `tokens` (one batch) and returns the logits after each, `[tokens.len(), n_vocab]`.
    pub fn all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        match self {
            ModelHandle::Local(s) => Ok(s.forward(Input::Tokens(tokens), Want::AllLogits)?.to_vec()),
            ModelHandle::Remote(p) => p.eval_all_logits(tokens),
        }
    }

    /// Changes the longest wait on a remote session (no effect on a local one).
    pub fn set_io_timeout(&mut self, t: Duration) {
        if let ModelHandle::Remote(p) = self {
            p.set_io_timeout(t);
        }
    }

    /// Names the request the following calls serve, so a remote node logs it (a local session logs nothing apart).
    pub fn set_request_id(&mut self, id: &str) {
        if let ModelHandle::Remote(p) = self {
            p.set_request_id(id);
        }
    }

    /// Per-stage wire statistics of a remote session (empty for a local one).
    pub fn stats(&self) -> Vec<StageStats> {
        match self {
            ModelHandle::Local(_) => Vec::new(),
            ModelHandle::Remote(p) => p.stats(),
        }
    }
}
