//! Building blocks shared by the architecture files (as llama.cpp's graph helpers): the scratch buffers of a
//! forward pass, the view of one layer's KV cache, and the attention steps. Each architecture file is then a short
//! script calling these in its own order.

use super::moe::{self, MoeScratch};
use super::{Ffn, Hparams, LayerWeights};
use crate::backend::{AttnShape, Backend, LayerKv, RowsKv, Scratch};
use crate::kernels::ops::RopeTable;
use crate::kernels::{Glu, Matrix, ThreadPool};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// At most how many rows of a batch go through one layer together. A longer batch goes through each layer in
/// slices of this many rows ([`for_each_slice`]): the per-layer scratch ([`Buffers`]) is then sized for a slice, and
/// the layer's weights, read again for each slice, are still in the caches (unlike smaller batches, which read every
/// layer's weights from memory again). A multiple of the matmuls' token blocks, so a slice gives the same bits as the
/// whole batch in one pass.
pub const LAYER_SLICE: usize = 128;

/// Scratch space for one layer's pass over up to [`LAYER_SLICE`] rows; allocated once per session so a decoded
/// token allocates nothing. The attention's Q, K, V and output and the feed-forward's hidden activations are never
/// live together, so they take turns in one working buffer (with the fused gate/up matmul this halves SmolLM2's
/// prefill scratch, see docs/performance.md).
pub struct Buffers {
    /// Rows one pass takes: the batch size, at most [`LAYER_SLICE`].
    pub n_rows: usize,
    /// Normalised input of the current sub-block, `[n_tok, n_embd]`. Once Q/K/V or gate/up are computed from it,
    /// the sub-block's output projection is written back into it.
    pub xn: Vec<f32>,
    /// The attention's Q, K, V and output, or a gated feed-forward's hidden activations (a dense layer's, or a
    /// mixture's shared experts').
    pub(super) work: Vec<f32>,
    /// Lengths of Q, K and V in `work` (the attention output follows them).
    pub(super) qkv_len: [usize; 3],
    /// Length of DeepSeek's latent attention's intermediates at the end of `work` ([`Buffers::mla_len`]).
    pub(super) mla_len: usize,
    /// The backend's working memory (matmul activations, attention partials).
    pub sc: Scratch,
    /// The mixture of experts' buffers (MoE models only).
    pub moe: Option<MoeScratch>,
}

/// The attention's views of the working buffer.
pub struct Attn<'a> {
    /// `[n_tok, n_head * head_dim_k]`
    pub q: &'a mut [f32],
    /// `[n_tok, n_head_kv * head_dim_k]`
    pub k: &'a mut [f32],
    /// `[n_tok, n_head_kv * head_dim_v]`
    pub v: &'a mut [f32],
    /// Attention output, `[n_tok, n_head * head_dim_v]`.
    pub att: &'a mut [f32],
}

impl Buffers {
    /// Rows, Q/K/V lengths and the working buffer's length for batches of up to `n_batch` rows.
    fn lens(hp: &Hparams, n_batch: usize) -> (usize, [usize; 3], usize) {
        let n_rows = n_batch.min(LAYER_SLICE);
        let qkv_len = [hp.n_embd_q(), hp.n_embd_k(), hp.n_embd_v()].map(|w| n_rows * w);
        let attn_len = qkv_len.iter().sum::<usize>() + n_rows * hp.n_head * hp.head_dim_v + Self::mla_len(hp, n_rows);
        // A mixture's routed experts' hidden activations live in its own buffers; its shared experts' and its
        // leading dense layers' use this one.
        let ffn_width = match &hp.moe {
            None => hp.n_ff,
            Some(m) => {
                let dense = if m.n_dense_lead > 0 { hp.n_ff } else { 0 };
                dense.max(m.routing.n_shared * m.n_ff_exp)
            }
        };
        let ffn_len = n_rows * ffn_width;
        (n_rows, qkv_len, attn_len.max(ffn_len))
    }

    /// Floats DeepSeek's latent attention keeps besides Q, K, V and the output, for `n_rows` rows: Q's low-rank
    /// intermediate, the `attn_kv_a_mqa` rows, the normalised compressed vectors, then the `attn_kv_b` rows, or (in
    /// the absorbed layout) Q as `attn_q_b` writes it (later the heads' outputs through `attn_v_b`) and one head's
    /// input and output of `attn_k_b`/`attn_v_b`.
    fn mla_len(hp: &Hparams, n_rows: usize) -> usize {
        hp.mla.as_ref().map_or(0, |m| {
            let r = m.kv_lora_rank;
            let last = if m.absorbed {
                Self::absorbed_widths(hp).iter().sum()
            } else {
                hp.n_head * (m.n_nope + m.v_head)
            };
            n_rows * (m.q_lora_rank + (r + hp.n_rot) + r + last)
        })
    }

    /// Floats per row of the absorbed layout's part of the latent attention's intermediates (after the compressed
    /// vectors), in order: Q as `attn_q_b` writes it (later the heads' outputs through `attn_v_b`), one head's input of
    /// `attn_k_b` or `attn_v_b`, and its output.
    pub(super) fn absorbed_widths(hp: &Hparams) -> [usize; 3] {
        let m = hp.mla.as_ref().expect("latent attention");
        let r = m.kv_lora_rank;
        [
            hp.n_head * m.q_head(hp.n_rot).max(m.v_head),
            m.n_nope.max(r),
            r.max(m.v_head),
        ]
    }

    /// Scratch for batches of up to `n_batch` rows.
    pub fn new(hp: &Hparams, n_batch: usize, n_ctx: usize, n_threads: usize) -> Buffers {
        let (n_rows, qkv_len, work_len) = Self::lens(hp, n_batch);
        Buffers {
            n_rows,
            xn: vec![0.0; n_rows * hp.n_embd],
            work: vec![0.0; work_len],
            qkv_len,
            mla_len: Self::mla_len(hp, n_rows),
            sc: Scratch::new(n_threads, n_ctx, hp.n_head / hp.n_head_kv, hp.head_dim_v),
            moe: hp.moe.as_ref().map(|m| MoeScratch::new(m, hp.n_embd, n_rows)),
        }
    }

    /// Bytes [`Buffers::new`] allocates for these arguments (the matmuls' scratch, which grows with use, aside):
    /// what a node counts against its budget before opening a session. Saturates instead of overflowing.
    pub fn bytes_for(hp: &Hparams, n_batch: usize, n_ctx: usize, n_threads: usize) -> usize {
        let (n_rows, _, work_len) = Self::lens(hp, n_batch);
        let floats = n_rows.saturating_mul(hp.n_embd).saturating_add(work_len);
        let moe = hp
            .moe
            .as_ref()
            .map_or(0, |m| MoeScratch::bytes_for(m, hp.n_embd, n_rows));
        floats
            .saturating_mul(4)
            .saturating_add(Scratch::bytes_for(
                n_threads,
                n_ctx,
                hp.n_head / hp.n_head_kv,
                hp.head_dim_v,
            ))
            .saturating_add(moe)
    }

    /// Q, K, V and the attention output.
    pub fn attn(&mut self) -> Attn<'_> {
        Attn::split(&mut self.work, self.qkv_len)
    }
}

impl<'a> Attn<'a> {
    /// A function of the two fields, not a method of [`Buffers`], so the other fields stay free to borrow.
    pub(super) fn split(work: &'a mut [f32], [nq, nk, nv]: [usize; 3]) -> Attn<'a> {
        let (q, rest) = work.split_at_mut(nq);
        let (k, rest) = rest.split_at_mut(nk);
        let (v, att) = rest.split_at_mut(nv);
        Attn { q, k, v, att }
    }
}

/// A batch of consecutive positions `pos0..` of one cache.
pub struct SeqKv<'a> {
    pub kv: LayerKv<'a>,
    pub pos0: usize,
}

impl RowsKv for SeqKv<'_> {
    fn pos(&self, t: usize) -> usize {
        self.pos0 + t
    }

    fn read(&self, _t: usize) -> (&[f16], &[f16], usize) {
        (&*self.kv.k, &*self.kv.v, self.kv.n_ctx)
    }

    fn write(&mut self, _t: usize) -> LayerKv<'_> {
        LayerKv {
            k: &mut *self.kv.k,
            v: &mut *self.kv.v,
            n_ctx: self.kv.n_ctx,
        }
    }
}

/// Rows `t0..` of another batch's rows: one slice of a batch ([`for_each_slice`]).
pub struct Slice<'a, R> {
    rows: &'a mut R,
    t0: usize,
}

impl<R: RowsKv> RowsKv for Slice<'_, R> {
    fn pos(&self, t: usize) -> usize {
        self.rows.pos(self.t0 + t)
    }

    fn read(&self, t: usize) -> (&[f16], &[f16], usize) {
        self.rows.read(self.t0 + t)
    }

    fn write(&mut self, t: usize) -> LayerKv<'_> {
        self.rows.write(self.t0 + t)
    }
}

/// Runs one layer `f` over the batch `x` (`[s.n_tok, n_embd]`) a slice of at most `b.n_rows` rows at a time, in
/// order: a row attends to the KV the slices before it stored in this layer, as in one pass.
pub fn for_each_slice<R: RowsKv>(
    s: &Step,
    x: &mut [f32],
    b: &mut Buffers,
    rows: &mut R,
    mut f: impl FnMut(&Step, &mut [f32], &mut Buffers, &mut Slice<'_, R>),
) {
    let e = s.hp.n_embd;
    for t0 in (0..s.n_tok).step_by(b.n_rows) {
        let n_tok = (s.n_tok - t0).min(b.n_rows);
        let slice = Step { n_tok, ..*s };
        f(&slice, &mut x[t0 * e..(t0 + n_tok) * e], b, &mut Slice { rows, t0 });
    }
}

/// What every step of one layer's forward needs to know.
pub struct Step<'a> {
    pub hp: &'a Hparams,
    pub pool: &'a ThreadPool,
    /// The RoPE table of this layer's frequency base.
    pub rope: &'a RopeTable,
    /// Global layer index.
    pub il: usize,
    /// Rows of the batch (tokens of one session, or one token of each session).
    pub n_tok: usize,
    /// Where the ops run: Baton's kernels, or llama.cpp's arithmetic reproduced (`crate::backend`).
    pub be: &'a dyn Backend,
    /// Another node that runs part of each mixture-of-experts layer's experts (`--experts-split`).
    pub experts: Option<&'a dyn moe::RemoteExperts>,
}

impl Step<'_> {
    fn attn_shape(&self) -> AttnShape {
        self.hp.attn_shape(self.il, self.n_tok)
    }
}

/// `y = x · Wᵀ` for the batch.
pub fn project(s: &Step, w: &Matrix, x: &[f32], y: &mut [f32], sc: &mut Scratch) {
    let n = s.n_tok;
    s.be.matmul(s.pool, w, &x[..n * w.cols], n, &mut y[..n * w.rows], sc);
}

/// RMS-normalises each row of `x` (`[n_tok, width]`) into `out`.
pub fn norm_rows(s: &Step, x: &[f32], w: &[f32], out: &mut [f32]) {
    let n = s.n_tok * w.len();
    s.be.rms_norm(&x[..n], w, s.hp.rms_eps, &mut out[..n]);
}

/// RMS-normalises each row of `x` (`[n_tok, width]`) in place.
pub fn norm_rows_inplace(s: &Step, x: &mut [f32], w: &[f32]) {
    s.be.rms_norm_inplace(&mut x[..s.n_tok * w.len()], w, s.hp.rms_eps);
}

/// RMS-normalises, in place, every head of `x` (`[n_tok, n_heads, head_dim]`) with the per-head weight `w`.
pub fn norm_heads(s: &Step, x: &mut [f32], w: &[f32], n_heads: usize) {
    s.be.rms_norm_inplace(&mut x[..s.n_tok * n_heads * w.len()], w, s.hp.rms_eps);
}

/// The residual add: `x += y` over the batch.
pub fn add(s: &Step, x: &mut [f32], y: &[f32]) {
    let n = s.n_tok * s.hp.n_embd;
    s.be.add(&mut x[..n], &y[..n]);
}

/// Computes Q, K and V of the batch from the normalised input `b.xn`, plus their biases where the layer has them
/// (llama.cpp adds them after the matmul, each row on its own, as here).
pub fn qkv(s: &Step, lw: &LayerWeights, b: &mut Buffers) {
    let a = Attn::split(&mut b.work, b.qkv_len);
    for (w, bias, y) in [(&lw.wq, &lw.bq, a.q), (&lw.wk, &lw.bk, a.k), (&lw.wv, &lw.bv, a.v)] {
        project(s, w, &b.xn, y, &mut b.sc);
        if let Some(bias) = bias {
            for row in y[..s.n_tok * bias.len()].chunks_exact_mut(bias.len()) {
                s.be.add(row, bias);
            }
        }
    }
}

/// RMS-normalises every head of Q and K with the layer's `attn_q_norm`/`attn_k_norm` (Gemma 3, Qwen 3), before
/// RoPE.
pub fn qk_norm(s: &Step, lw: &LayerWeights, b: &mut Buffers) {
    let hp = s.hp;
    let (q_norm, k_norm) = (lw.q_norm.as_deref().unwrap(), lw.k_norm.as_deref().unwrap());
    let a = b.attn();
    norm_heads(s, a.q, q_norm, hp.n_head);
    norm_heads(s, a.k, k_norm, hp.n_head_kv);
}

/// The attention's output projection, written to `b.xn` (the sub-block's input is no longer needed).
pub fn attn_output(s: &Step, lw: &LayerWeights, b: &mut Buffers) {
    let a = Attn::split(&mut b.work, b.qkv_len);
    project(s, &lw.wo, a.att, &mut b.xn, &mut b.sc);
}

/// The gated feed-forward of the normalised input: `b.xn = down(act(gate(b.xn)) · up(b.xn))`, or, in a layer of
/// experts, the sum of its rows' experts' feed-forwards weighted by the router ([`moe::ffn`], SwiGLU experts).
pub fn ffn(s: &Step, lw: &LayerWeights, b: &mut Buffers, glu: Glu) {
    let d = match &lw.ffn {
        Ffn::Dense(d) => d,
        Ffn::Moe(m) => {
            debug_assert_eq!(glu, Glu::Silu, "experts are SwiGLU");
            return moe::ffn(s, m, b);
        }
    };
    let h = &mut b.work[..s.n_tok * d.gate.rows];
    let x = &b.xn[..s.n_tok * d.gate.cols];
    s.be.matmul_glu(s.pool, &d.gate, &d.up, glu, x, s.n_tok, h, &mut b.sc);
    project(s, &d.down, h, &mut b.xn, &mut b.sc);
}

/// The attention sub-block up to its output projection, which it leaves in `b.xn`: pre-norm of `x`, Q/K/V (with
/// their biases where the layer has them), RMSNorm of each Q and K head where the layer has those norms, RoPE, the
/// KV store and the attention. Which of these tensors a layer may or must have is checked at load, per architecture.
pub fn self_attention(s: &Step, lw: &LayerWeights, x: &[f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    norm_rows(s, x, &lw.attn_norm, &mut b.xn);
    qkv(s, lw, b);
    if lw.q_norm.is_some() {
        qk_norm(s, lw, b);
    }
    rope_and_store(s, b, kv);
    attend(s, b, kv);
    attn_output(s, lw, b);
}

/// Rotates Q and K by position and writes each row's K and V into its cache at its position (rounded to f16, to
/// nearest, as ggml's F16 cache rounds them).
pub fn rope_and_store(s: &Step, b: &mut Buffers, rows: &mut impl RowsKv) {
    let hp = s.hp;
    let neox = hp.rope_type == super::RopeType::Neox;
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    let (nq, nk, nv) = (hp.n_head * hdk, hp.n_head_kv * hdk, hp.n_head_kv * hdv);
    let a = b.attn();
    for t in 0..s.n_tok {
        let pos = rows.pos(t);
        let (k, v) = (&mut a.k[t * nk..(t + 1) * nk], &a.v[t * nv..(t + 1) * nv]);
        s.be.rope(s.rope, &mut a.q[t * nq..(t + 1) * nq], hdk, pos, neox);
        s.be.rope(s.rope, k, hdk, pos, neox);
        store(hp, pos, k, v, rows.write(t));
    }
}

/// Writes one row's K and V (`[n_head_kv, head_dim]` each) into its cache at `pos`, rounded to f16 to nearest.
pub fn store(hp: &Hparams, pos: usize, k: &[f32], v: &[f32], kv: LayerKv<'_>) {
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    for h in 0..hp.n_head_kv {
        let dst = (h * kv.n_ctx + pos) * hdk;
        kv.k[dst..dst + hdk].convert_from_f32_slice(&k[h * hdk..(h + 1) * hdk]);
        let dst = (h * kv.n_ctx + pos) * hdv;
        kv.v[dst..dst + hdv].convert_from_f32_slice(&v[h * hdv..(h + 1) * hdv]);
    }
}

/// Causal attention of each row's query over its cache (positions `0..=pos` for a query at `pos`, or the last
/// `window` of them on sliding-window layers), written to the attention output.
pub fn attend(s: &Step, b: &mut Buffers, rows: &impl RowsKv) {
    let a = Attn::split(&mut b.work, b.qkv_len);
    s.be.attend(s.pool, &s.attn_shape(), a.q, rows, a.att, &mut b.sc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn hp(name: &str) -> Hparams {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/{name}.gguf"));
        Hparams::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
    }

    /// What a node counts against its budget at OPEN is what a session's buffers hold, for dense and MoE models;
    /// dots1's working buffer holds its dense layer's hidden activations (128 wide, wider than its shared experts).
    #[test]
    fn scratch_bytes_are_what_new_allocates() {
        for name in ["llama3", "qwen3moe", "dots1", "deepseek2", "deepseek2-mla"] {
            let hp = hp(name);
            for (n_batch, n_ctx, threads) in [(1, 16, 1), (32, 256, 2), (4096, 1000, 3)] {
                let b = Buffers::new(&hp, n_batch, n_ctx, threads);
                if name == "dots1" {
                    assert!(b.work.len() >= b.n_rows * 128, "{n_batch}");
                }
                let moe = hp
                    .moe
                    .as_ref()
                    .map_or(0, |m| MoeScratch::bytes_for(m, hp.n_embd, b.n_rows));
                let held = 4 * (b.xn.len() + b.work.len() + b.sc.scores.len() + b.sc.parts.len()) + moe;
                assert_eq!(
                    Buffers::bytes_for(&hp, n_batch, n_ctx, threads),
                    held,
                    "{name} {n_batch} {n_ctx}"
                );
            }
        }
        // Proportional to the batch (up to the layer slice), and it saturates rather than overflows.
        let hp = hp("llama3");
        assert!(Buffers::bytes_for(&hp, 64, 256, 1) > 2 * Buffers::bytes_for(&hp, 16, 256, 1));
        assert_eq!(Buffers::bytes_for(&hp, 1, usize::MAX, 1), usize::MAX);
    }
}
