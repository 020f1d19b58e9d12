//! One conversation's timeline on one node: the tokens seen so far and the KV cache of the model's layer range.
//!
//! [`Session::forward`] is the layer-range forward pass: tokens (first range) or a hidden state (any other range) in,
//! a hidden state (not the last range) or logits (last range) out. Running `0..k` then `k..n` with the hidden state
//! handed over computes exactly the same operations as `0..n` at once, so the logits are bit-identical.

use super::kv_cache::{KvBlock, KvCache};
use super::placement::Placement;
use crate::backend::gpu::layers::{GpuLayers, Out};
use crate::backend::{self, Backend, RowsKv, Scratch};
use crate::kernels::ThreadPool;
use crate::kernels::ggml::Numerics;
use crate::kernels::ops;
use crate::model::blocks::{self, Buffers, SeqKv, Step};
use crate::model::moe::{self, Pick, RemoteExperts};
use crate::model::rope::RopeTables;
use crate::model::{Arch, Ffn, Hparams, Model, deepseek2, gemma3, llama};
use anyhow::{Result, bail};
use std::sync::Arc;

/// The input of a forward pass.
pub enum Input<'a> {
    /// Token ids; only for a range that starts at layer 0.
    Tokens(&'a [u32]),
    /// The residual stream entering the range's first layer, `[n_tok, n_embd]`.
    Hidden(&'a [f32]),
}

/// What a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// The residual stream leaving the range's last layer, `[n_tok, n_embd]`.
    Hidden,
    /// Logits of the batch's last token, `[n_vocab]` (last range only).
    LastLogits,
    /// Logits of every token of the batch, `[n_tok, n_vocab]` (last range only; perplexity, speculative verify).
    AllLogits,
}

pub struct Session {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    /// Positions `0..kv.n_pos()` are valid; `tokens` is empty or names exactly those positions.
    kv: KvCache,
    /// Token ids whose KV the cache holds, when known (always, for a range fed with tokens).
    tokens: Vec<u32>,
    /// Most tokens one forward pass takes.
    n_batch: usize,
    bufs: Buffers,
    /// The RoPE tables of the range's layers.
    ropes: RopeTables,
    /// Residual stream of the current batch.
    x: Vec<f32>,
    /// Output logits (grown on demand for `AllLogits`).
    logits: Vec<f32>,
    /// Normalised hidden state feeding the output head.
    head_in: Vec<f32>,
    /// Baton's kernels or llama.cpp's arithmetic (`BATON_NUMERICS`, [`Session::set_numerics`]).
    numerics: Numerics,
    /// The first layers of the range on a GPU (`--backend gpu`, `--gpu-layers`); the CPU runs the rest. `kv` keeps a
    /// copy of every row the GPU writes, so readers of the cache see all layers.
    gpu: Option<GpuLayers>,
    /// The node running part of each MoE layer's experts (`--experts-split`).
    experts: Option<Arc<dyn RemoteExperts>>,
}

impl Session {
    /// A session of `n_ctx` positions that runs batches of at most `n_batch` tokens, its layers where the process
    /// places them ([`Placement::process`]: the CPU unless `--backend` says otherwise).
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, n_ctx: usize, n_batch: usize) -> Result<Session> {
        Session::placed(model, pool, n_ctx, n_batch, Placement::process()?)
    }

    /// Bytes of scratch a session allocates beside its KV, for batches of `n_batch` (and the logits where it ends
    /// with the output layer): what a node counts against its budget at OPEN. Saturates instead of overflowing.
    pub fn scratch_bytes(hp: &Hparams, n_ctx: usize, n_batch: usize, n_threads: usize, is_last: bool) -> usize {
        let floats = n_batch
            .saturating_add(1)
            .saturating_mul(hp.n_embd)
            .saturating_add(if is_last { hp.n_vocab } else { 0 });
        floats
            .saturating_mul(4)
            .saturating_add(Buffers::bytes_for(hp, n_batch, n_ctx, n_threads))
    }

    /// [`Session::new`] with its layers placed by `placement`.
    pub fn placed(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        n_ctx: usize,
        n_batch: usize,
        placement: &Placement,
    ) -> Result<Session> {
        let hp = &model.hp;
        if n_ctx == 0 || n_batch == 0 {
            bail!("context and batch sizes must be positive");
        }
        let numerics = Numerics::from_env();
        let gpu = match placement.gpu_weights(&model)? {
            Some(_) if numerics == Numerics::Ggml => {
                bail!("--numerics ggml reproduces llama.cpp's CPU arithmetic: it runs with --backend cpu only")
            }
            Some(w) => Some(GpuLayers::new(w, n_ctx, n_batch)?),
            None => None,
        };
        let experts = match hp.moe {
            Some(_) => super::placement::experts_peer(&model)?,
            None => None,
        };
        let ropes = RopeTables::new(hp, model.range.clone(), n_ctx);
        let bufs = Buffers::new(hp, n_batch, n_ctx, pool.n_threads());
        Ok(Session {
            kv: KvCache::new(hp, model.range.clone(), n_ctx),
            tokens: Vec::new(),
            n_batch,
            x: vec![0.0; n_batch * hp.n_embd],
            logits: vec![0.0; if model.is_last() { hp.n_vocab } else { 0 }],
            head_in: vec![0.0; hp.n_embd],
            bufs,
            ropes,
            model,
            pool,
            numerics,
            gpu,
            experts,
        })
    }

    /// Chooses the arithmetic of the following forward passes (`fast` by default, or `BATON_NUMERICS`). Switch
    /// only on an empty cache: the `ggml` mode keeps K/V at f16 precision. The GPU's layers keep their own.
    pub fn set_numerics(&mut self, n: Numerics) {
        self.numerics = n;
    }

    /// The layers of the range that run on a GPU (empty when all run on the CPU).
    pub fn gpu_layers(&self) -> std::ops::Range<usize> {
        match &self.gpu {
            Some(g) => g.layers(),
            None => self.model.range.start..self.model.range.start,
        }
    }

    /// Sends part of each MoE layer's experts to `peer` from the next forward pass on (`None`: all run here). Sessions
    /// of a process with `--experts-split` get theirs when made; this is for callers that hold a peer themselves.
    pub fn set_remote_experts(&mut self, peer: Option<Arc<dyn RemoteExperts>>) {
        self.experts = peer;
    }

    /// The node running part of this session's experts, if any.
    pub fn remote_experts(&self) -> Option<&Arc<dyn RemoteExperts>> {
        self.experts.as_ref()
    }

    /// Runs picks of layer `il`'s experts that another node sent (it holds this model too and runs its attention
    /// itself; `--experts-split`): their weighted outputs, `[picks.len(), n_embd]`. `x` is the rows they index.
    pub fn serve_experts(&mut self, il: usize, x: &[f32], picks: &[Pick]) -> Result<Vec<f32>> {
        let model = self.model.clone();
        if !model.range.contains(&il) {
            bail!("layer {il} is outside this session's layers {:?}", model.range);
        }
        let Ffn::Moe(w) = &model.layer(il).ffn else {
            bail!("layer {il} has no experts");
        };
        let step = Step {
            hp: &model.hp,
            pool: &self.pool,
            rope: self.ropes.of(il),
            il,
            n_tok: x.len() / model.hp.n_embd,
            be: backend::for_numerics(self.numerics),
            experts: None,
        };
        moe::serve_picks(&step, w, x, picks, &mut self.bufs)
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn pool(&self) -> &Arc<ThreadPool> {
        &self.pool
    }

    /// The cache, to read (snapshots, KV streaming); writes go through [`Session::import_kv`].
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// The cache of a session stepped by [`super::Batch`], which writes each row's new position.
    pub(super) fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// Writes KV rows computed elsewhere (a snapshot, a prefill node's stream) into the cache. The positions count
    /// as held only after [`Session::hold_positions`], once every layer is in.
    pub fn import_kv(&mut self, block: &KvBlock) -> Result<()> {
        block.write_into(&mut self.kv)?;
        if let Some(g) = &self.gpu {
            g.upload_kv(&self.kv, block.pos.clone())?;
        }
        Ok(())
    }

    /// Marks positions `0..n` as held, with the token ids behind them (`tokens` of length `n`, or empty when
    /// unknown).
    pub fn hold_positions(&mut self, n: usize, tokens: &[u32]) -> Result<()> {
        if n > self.n_ctx() {
            bail!("{n} positions do not fit a context of {}", self.n_ctx());
        }
        if !tokens.is_empty() && tokens.len() != n {
            bail!("{} token ids for {n} positions", tokens.len());
        }
        self.kv.set_n_pos(n);
        self.set_tokens(tokens);
        Ok(())
    }

    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx
    }

    pub fn n_batch(&self) -> usize {
        self.n_batch
    }

    /// Positions held in the cache.
    pub fn n_past(&self) -> usize {
        self.kv.n_pos()
    }

    /// Tokens whose KV the cache holds (empty for a range fed with hidden states unless set by the caller).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Records the token ids behind the positions held (a later range learns them from its peer).
    pub fn set_tokens(&mut self, tokens: &[u32]) {
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
    }

    /// Records the token ids of a batch fed as a hidden state at `pos` (a later range learns them from its peer), when
    /// the ids before it are known.
    pub fn note_tokens(&mut self, pos: usize, tokens: &[u32]) {
        if self.tokens.len() == pos {
            self.tokens.extend_from_slice(tokens);
        }
    }

    /// Forgets every position from `n` on.
    pub fn rewind(&mut self, n: usize) {
        self.kv.rewind(n);
        self.tokens.truncate(n);
    }

    /// Keeps the longest prefix of the cache that `tokens` starts with and returns its length; the caller then feeds
    /// only `tokens[kept..]`. At least one token is always left to feed, so the caller gets fresh logits.
    pub fn reuse_prefix(&mut self, tokens: &[u32]) -> usize {
        let held = &self.tokens[..self.tokens.len().min(self.n_past())];
        let mut n = held.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        if n == tokens.len() && n > 0 {
            n -= 1;
        }
        self.rewind(n);
        n
    }

    /// Runs the model's layer range over one batch appended at position `n_past()`.
    pub fn forward(&mut self, input: Input, want: Want) -> Result<&[f32]> {
        let first = self.model.range.start;
        self.forward_layers(input, first, want, &mut |_, _, _| {})
    }

    /// [`Session::forward`] over layers `first..` of the range only, calling `on_layer(il, cache, positions)` as soon
    /// as each layer has written its KV for the batch (disaggregated prefill streams it from there). With `first`
    /// past the range start the input must be the hidden state entering `first`, and the caller provides the KV of
    /// the skipped layers for these positions itself (partial offload: it arrives from the prefill node).
    pub fn forward_layers(
        &mut self,
        input: Input,
        first: usize,
        want: Want,
        on_layer: &mut dyn FnMut(usize, &KvCache, std::ops::Range<usize>),
    ) -> Result<&[f32]> {
        let model = self.model.clone();
        if first < model.range.start || first > model.range.end {
            bail!("layer {first} is outside this session's layers {:?}", model.range);
        }
        if first > model.range.start && matches!(input, Input::Tokens(_)) {
            bail!("a forward pass from layer {first} takes the hidden state entering it, not tokens");
        }
        let hp = &model.hp;
        let e = hp.n_embd;
        let n_tok = match input {
            Input::Tokens(t) => t.len(),
            Input::Hidden(h) => {
                if h.len() % e != 0 {
                    bail!(
                        "hidden state of {} values is not a whole number of {e}-wide rows",
                        h.len()
                    );
                }
                h.len() / e
            }
        };
        if n_tok == 0 {
            bail!("empty batch");
        }
        if n_tok > self.n_batch() {
            bail!(
                "batch of {n_tok} tokens exceeds the session's batch size {}",
                self.n_batch()
            );
        }
        let pos0 = self.n_past();
        if pos0 + n_tok > self.n_ctx() {
            bail!(
                "context full: {pos0} positions held + {n_tok} new exceed the context size {} (use a larger -c)",
                self.n_ctx()
            );
        }
        if want != Want::Hidden && !model.is_last() {
            bail!("this session holds layers {:?}, not the output head", model.range);
        }

        // Input: embed the tokens (on the GPU where its layers start the model), or take the hidden state as is.
        let mut gpu_tokens = None;
        match input {
            Input::Tokens(toks) => {
                if self.gpu.as_ref().is_some_and(|g| g.embeds()) {
                    check_tokens(&model, toks)?;
                    gpu_tokens = Some(toks);
                } else {
                    embed(&model, toks, &mut self.x)?;
                }
                if self.tokens.len() == pos0 {
                    self.tokens.extend_from_slice(toks);
                }
            }
            Input::Hidden(h) => {
                self.x[..h.len()].copy_from_slice(h);
                self.tokens.truncate(pos0);
            }
        }

        // The layers on the GPU, then the rest on the CPU.
        let mut cpu_first = first;
        if let Some(g) = self.gpu.as_mut().filter(|g| first < g.layers().end) {
            let to_head = want != Want::Hidden && g.has_head();
            let out = match want {
                _ if !to_head => Out::Hidden,
                Want::LastLogits => Out::Logits {
                    rows: n_tok - 1..n_tok,
                    logits: grown(&mut self.logits, hp.n_vocab),
                },
                _ => Out::Logits {
                    rows: 0..n_tok,
                    logits: grown(&mut self.logits, n_tok * hp.n_vocab),
                },
            };
            g.forward(&mut self.x, gpu_tokens, n_tok, pos0, first, &mut self.kv, out)?;
            for il in first..g.layers().end {
                on_layer(il, &self.kv, pos0..pos0 + n_tok);
            }
            cpu_first = g.layers().end;
            if to_head {
                self.kv.set_n_pos(pos0 + n_tok);
                let n = if want == Want::LastLogits { 1 } else { n_tok };
                return Ok(&self.logits[..n * hp.n_vocab]);
            }
        }
        for il in cpu_first..model.range.end {
            let mut rows = SeqKv {
                kv: self.kv.layer_mut(il),
                pos0,
            };
            let step = Step {
                hp,
                pool: &self.pool,
                rope: self.ropes.of(il),
                il,
                n_tok,
                be: backend::for_numerics(self.numerics),
                experts: self.experts.as_deref(),
            };
            layer(&step, &model, &mut self.x, &mut self.bufs, &mut rows);
            on_layer(il, &self.kv, pos0..pos0 + n_tok);
        }
        self.kv.set_n_pos(pos0 + n_tok);

        // Output: the hidden state, or the final norm and the head.
        match want {
            Want::Hidden => Ok(&self.x[..n_tok * e]),
            Want::LastLogits => {
                self.head(n_tok - 1..n_tok)?;
                Ok(&self.logits[..hp.n_vocab])
            }
            Want::AllLogits => {
                self.head(0..n_tok)?;
                Ok(&self.logits[..n_tok * hp.n_vocab])
            }
        }
    }

    /// Logits of one hidden state row leaving the last layer (final norm and head), e.g. the last prompt token's
    /// row computed by a prefill node. Changes no position.
    pub fn logits_of_hidden(&mut self, row: &[f32]) -> Result<&[f32]> {
        let hp = &self.model.hp;
        if !self.model.is_last() {
            bail!("this session holds layers {:?}, not the output head", self.model.range);
        }
        if row.len() != hp.n_embd {
            bail!("hidden row of {} values, expected {}", row.len(), hp.n_embd);
        }
        let n_vocab = hp.n_vocab;
        self.x[..row.len()].copy_from_slice(row);
        self.head(0..1)?;
        Ok(&self.logits[..n_vocab])
    }

    /// Final norm and output head for the given rows of the batch, into `self.logits`.
    fn head(&mut self, rows: std::ops::Range<usize>) -> Result<()> {
        let (model, pool) = (&self.model, &self.pool);
        head(
            model,
            pool,
            backend::for_numerics(self.numerics),
            &self.x,
            rows,
            &mut self.head_in,
            &mut self.logits,
            &mut self.bufs.sc,
        );
        Ok(())
    }

    /// The logits of the last forward pass with [`Want::LastLogits`] or batched step (`engine::batcher`), `[n_vocab]`
    /// (last range only): a caller whose step ran on another thread reads them here.
    pub fn last_logits(&self) -> &[f32] {
        &self.logits[..self.logits.len().min(self.model.hp.n_vocab)]
    }

    /// Keeps a batched step's logits row as this session's own, where [`Session::last_logits`] finds it.
    pub(super) fn keep_logits(&mut self, row: &[f32]) {
        self.logits[..row.len()].copy_from_slice(row);
    }

    /// Marks the token fed at position `n_past()` by a batched step (`engine::batch`) as held.
    pub(super) fn push_decoded(&mut self, token: u32) {
        let pos = self.n_past();
        if self.tokens.len() == pos {
            self.tokens.push(token);
        }
        self.kv.set_n_pos(pos + 1);
    }

    /// The mean over `tokens` of the hidden state after the final norm (what the output head reads), evaluated
    /// from position 0: llama.cpp's mean pooling, unnormalised. Whole-model sessions only; the session then holds
    /// `tokens`.
    pub fn mean_pooled(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let model = self.model.clone();
        if model.range.start != 0 || !model.is_last() {
            bail!("this session holds layers {:?}, not the whole model", model.range);
        }
        if tokens.is_empty() {
            bail!("nothing to embed");
        }
        if tokens.len() > self.n_ctx() {
            bail!(
                "{} tokens do not fit the context of {} positions",
                tokens.len(),
                self.n_ctx()
            );
        }
        let norm = model.output_norm.as_deref().unwrap();
        let (e, eps) = (model.hp.n_embd, model.hp.rms_eps);
        let be = backend::for_numerics(self.numerics);
        let mut sum = vec![0f64; e];
        let mut normed = Vec::new();
        self.rewind(0);
        for chunk in tokens.chunks(self.n_batch()) {
            let hidden = self.forward(Input::Tokens(chunk), Want::Hidden)?;
            normed.resize(hidden.len(), 0.0);
            be.rms_norm(hidden, norm, eps, &mut normed);
            for row in normed.chunks_exact(e) {
                for (s, &v) in sum.iter_mut().zip(row) {
                    *s += v as f64;
                }
            }
        }
        let n = tokens.len() as f64;
        Ok(sum.iter().map(|&s| (s / n) as f32).collect())
    }

    /// Feeds `tokens` in batches and returns the logits of the last one (full-model sessions).
    pub fn eval(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.eval_reporting(tokens, &mut |_| {})
    }

    /// [`Session::eval`], calling `done(n)` after each batch with the `n` tokens it fed (progress bars).
    pub fn eval_reporting(&mut self, tokens: &[u32], done: &mut dyn FnMut(usize)) -> Result<&[f32]> {
        if tokens.is_empty() {
            bail!("nothing to evaluate");
        }
        let nb = self.n_batch();
        let n_chunks = tokens.len().div_ceil(nb);
        for (i, chunk) in tokens.chunks(nb).enumerate() {
            let want = if i + 1 == n_chunks {
                Want::LastLogits
            } else {
                Want::Hidden
            };
            self.forward(Input::Tokens(chunk), want)?;
            done(chunk.len());
        }
        Ok(&self.logits[..self.model.hp.n_vocab])
    }
}

/// `v` at least `n` long, its first `n` values to overwrite.
fn grown(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// One RoPE table per frequency base the model's layer range uses, for `n_ctx` positions.
/// Errors unless `model` embeds tokens (its range starts the model) and every id of `tokens` is in its vocabulary.
fn check_tokens(model: &Model, tokens: &[u32]) -> Result<()> {
    if model.embeddings().is_none() {
        bail!(
            "this session holds layers {:?}, it takes hidden states, not tokens",
            model.range
        );
    }
    if let Some(id) = tokens.iter().find(|&&id| id as usize >= model.hp.n_vocab) {
        bail!("token id {id} is outside the vocabulary of {}", model.hp.n_vocab);
    }
    Ok(())
}

/// Embeds `tokens` into the first rows of `x` (scaled where the architecture asks).
pub(super) fn embed(model: &Model, tokens: &[u32], x: &mut [f32]) -> Result<()> {
    let hp = &model.hp;
    let e = hp.n_embd;
    check_tokens(model, tokens)?;
    let embd = model.embeddings().expect("checked");
    for (t, &id) in tokens.iter().enumerate() {
        let row = &mut x[t * e..(t + 1) * e];
        embd.dequantize_row_into(id as usize, row);
        if hp.embd_scale != 1.0 {
            ops::scale_inplace(row, hp.embd_scale);
        }
    }
    Ok(())
}

/// Layer `step.il` of the model's architecture over the batch in `x`.
pub(super) fn layer(step: &Step, model: &Model, x: &mut [f32], bufs: &mut Buffers, kv: &mut impl RowsKv) {
    let lw = model.layer(step.il);
    blocks::for_each_slice(step, x, bufs, kv, |s, x, b, kv| match model.hp.arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Dots1 | Arch::Phi3 | Arch::Glm4Moe => {
            llama::layer(s, lw, x, b, kv)
        }
        Arch::Gemma3 => gemma3::layer(s, lw, x, b, kv),
        Arch::Deepseek2 => deepseek2::layer(s, lw, x, b, kv),
    });
}

/// Final norm and output head for `rows` of the residual stream `x`, into `logits` (`[rows.len(), n_vocab]`);
/// `head_in` and `logits` grow when too small.
#[allow(clippy::too_many_arguments)]
pub(super) fn head(
    model: &Model,
    pool: &ThreadPool,
    be: &dyn Backend,
    x: &[f32],
    rows: std::ops::Range<usize>,
    head_in: &mut Vec<f32>,
    logits: &mut Vec<f32>,
    sc: &mut Scratch,
) {
    let hp = &model.hp;
    let (norm, out) = (model.output_norm.as_ref().unwrap(), model.output.as_ref().unwrap());
    let e = hp.n_embd;
    let n = rows.len();
    if head_in.len() < n * e {
        head_in.resize(n * e, 0.0);
    }
    if logits.len() < n * hp.n_vocab {
        logits.resize(n * hp.n_vocab, 0.0);
    }
    be.rms_norm(
        &x[rows.start * e..rows.end * e],
        norm,
        hp.rms_eps,
        &mut head_in[..n * e],
    );
    be.matmul(pool, out, &head_in[..n * e], n, &mut logits[..n * hp.n_vocab], sc);
}
