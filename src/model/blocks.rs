//! Building blocks shared by the architecture files (as llama.cpp's graph helpers): the scratch buffers of a
//! forward pass, the view of one layer's KV cache, and the attention steps. Each architecture file is then a short
//! script calling these in its own order.

use super::{Hparams, LayerWeights};
use crate::kernels::ggml::{self, Numerics};
use crate::kernels::ops::{self, RopeTable};
use crate::kernels::{self, Matrix, ThreadPool, attention};

/// Scratch space for a forward pass over up to `n_batch` tokens; allocated once per session so a decoded token
/// allocates nothing.
pub struct Buffers {
    pub n_batch: usize,
    /// Normalised input of the current sub-block, `[n_tok, n_embd]`.
    pub xn: Vec<f32>,
    /// `[n_tok, n_head * head_dim_k]`
    pub q: Vec<f32>,
    /// `[n_tok, n_head_kv * head_dim_k]`
    pub k: Vec<f32>,
    /// `[n_tok, n_head_kv * head_dim_v]`
    pub v: Vec<f32>,
    /// Attention output, `[n_tok, n_head * head_dim_v]`.
    pub att: Vec<f32>,
    /// Output of a projection back to the residual width, `[n_tok, n_embd]`.
    pub o: Vec<f32>,
    /// Feed-forward gate and up projections, `[n_tok, n_ff]`.
    pub g: Vec<f32>,
    pub u: Vec<f32>,
    /// Attention scores: one row per query head of a GQA group, per thread.
    pub scores: Vec<f32>,
    pub n_ctx: usize,
    pub mm: kernels::Scratch,
}

impl Buffers {
    pub fn new(hp: &Hparams, n_batch: usize, n_ctx: usize, n_threads: usize) -> Buffers {
        Buffers {
            n_batch,
            xn: vec![0.0; n_batch * hp.n_embd],
            q: vec![0.0; n_batch * hp.n_embd_q()],
            k: vec![0.0; n_batch * hp.n_embd_k()],
            v: vec![0.0; n_batch * hp.n_embd_v()],
            att: vec![0.0; n_batch * hp.n_head * hp.head_dim_v],
            o: vec![0.0; n_batch * hp.n_embd],
            g: vec![0.0; n_batch * hp.n_ff],
            u: vec![0.0; n_batch * hp.n_ff],
            scores: vec![0.0; n_threads * (hp.n_head / hp.n_head_kv) * n_ctx],
            n_ctx,
            mm: kernels::Scratch::default(),
        }
    }
}

/// One layer's KV cache: K is `[n_head_kv, n_ctx, head_dim_k]`, V `[n_head_kv, n_ctx, head_dim_v]`, positions in
/// order. K is stored after RoPE.
pub struct LayerKv<'a> {
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    pub n_ctx: usize,
}

/// Where the rows of a batch keep their KV in one layer, and at which positions: one cache's consecutive positions
/// ([`SeqKv`]: prefill, one session's decode), or each row its own session's cache at its own position (batched
/// decode across sessions, `engine::batch`). The layer code is the same for both.
pub trait RowsKv: Sync {
    /// Position of row `t`.
    fn pos(&self, t: usize) -> usize;
    /// Row `t`'s cache of this layer to read: K, V and the positions each head's run holds.
    fn read(&self, t: usize) -> (&[f32], &[f32], usize);
    /// Row `t`'s cache of this layer to write.
    fn write(&mut self, t: usize) -> LayerKv<'_>;
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

    fn read(&self, _t: usize) -> (&[f32], &[f32], usize) {
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
    /// Baton's kernels, or llama.cpp's arithmetic reproduced ([`ggml`]).
    pub numerics: Numerics,
}

impl Step<'_> {
    fn ggml(&self) -> bool {
        self.numerics == Numerics::Ggml
    }
}

/// A raw pointer that threads of the pool may share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not the raw field).
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

/// `y = x · Wᵀ` for the batch.
pub fn project(s: &Step, w: &Matrix, x: &[f32], y: &mut [f32], mm: &mut kernels::Scratch) {
    if s.ggml() && ggml::matmul::supports(w.ty) {
        let n = s.n_tok;
        ggml::matmul::matmul(s.pool, w, &x[..n * w.cols], n, &mut y[..n * w.rows]);
        return;
    }
    kernels::matmul(
        s.pool,
        w,
        &x[..s.n_tok * w.cols],
        s.n_tok,
        &mut y[..s.n_tok * w.rows],
        mm,
    );
}

/// RMS-normalises each row of `x` (`[n_tok, width]`) into `out`.
pub fn norm_rows(s: &Step, x: &[f32], w: &[f32], out: &mut [f32]) {
    let width = w.len();
    let norm = if s.ggml() { ggml::ops::rms_norm } else { ops::rms_norm };
    for t in 0..s.n_tok {
        norm(
            &x[t * width..(t + 1) * width],
            w,
            s.hp.rms_eps,
            &mut out[t * width..(t + 1) * width],
        );
    }
}

/// RMS-normalises each row of `x` (`[n_tok, width]`) in place.
pub fn norm_rows_inplace(s: &Step, x: &mut [f32], w: &[f32]) {
    let width = w.len();
    let norm = if s.ggml() {
        ggml::ops::rms_norm_inplace
    } else {
        ops::rms_norm_inplace
    };
    for row in x[..s.n_tok * width].chunks_mut(width) {
        norm(row, w, s.hp.rms_eps);
    }
}

/// RMS-normalises, in place, every head of `x` (`[n_tok, n_heads, head_dim]`) with the per-head weight `w`.
pub fn norm_heads(s: &Step, x: &mut [f32], w: &[f32], n_heads: usize) {
    let hd = w.len();
    let norm = if s.ggml() {
        ggml::ops::rms_norm_inplace
    } else {
        ops::rms_norm_inplace
    };
    for head in x[..s.n_tok * n_heads * hd].chunks_mut(hd) {
        norm(head, w, s.hp.rms_eps);
    }
}

/// Computes Q, K and V of the batch from the normalised input `b.xn`.
pub fn qkv(s: &Step, lw: &LayerWeights, b: &mut Buffers) {
    project(s, &lw.wq, &b.xn, &mut b.q, &mut b.mm);
    project(s, &lw.wk, &b.xn, &mut b.k, &mut b.mm);
    project(s, &lw.wv, &b.xn, &mut b.v, &mut b.mm);
}

/// Rotates Q and K by position and writes each row's K and V into its cache at its position.
pub fn rope_and_store(s: &Step, b: &mut Buffers, rows: &mut impl RowsKv) {
    if s.ggml() {
        return ggml_rope_and_store(s, b, rows);
    }
    let hp = s.hp;
    let neox = hp.rope_type == super::RopeType::Neox;
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    for t in 0..s.n_tok {
        let pos = rows.pos(t);
        let kv = rows.write(t);
        for h in 0..hp.n_head {
            let o = (t * hp.n_head + h) * hdk;
            s.rope.apply(&mut b.q[o..o + hdk], pos, neox);
        }
        for h in 0..hp.n_head_kv {
            let o = (t * hp.n_head_kv + h) * hdk;
            s.rope.apply(&mut b.k[o..o + hdk], pos, neox);
            let dst = (h * kv.n_ctx + pos) * hdk;
            kv.k[dst..dst + hdk].copy_from_slice(&b.k[o..o + hdk]);
            let ov = (t * hp.n_head_kv + h) * hdv;
            let dst = (h * kv.n_ctx + pos) * hdv;
            kv.v[dst..dst + hdv].copy_from_slice(&b.v[ov..ov + hdv]);
        }
    }
}

/// [`rope_and_store`] with ggml's arithmetic: its RoPE rotation, and K and V rounded to f16 as they enter the cache
/// (llama.cpp's F16 KV cache; the f32 cache then holds exactly the f16 values).
fn ggml_rope_and_store(s: &Step, b: &mut Buffers, rows: &mut impl RowsKv) {
    let hp = s.hp;
    let neox = hp.rope_type == super::RopeType::Neox;
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    for t in 0..s.n_tok {
        let pos = rows.pos(t);
        let kv = rows.write(t);
        let (cos, sin) = s.rope.cos_sin(pos);
        for h in 0..hp.n_head {
            let o = (t * hp.n_head + h) * hdk;
            ggml::ops::rope(&mut b.q[o..o + hdk], cos, sin, neox);
        }
        for h in 0..hp.n_head_kv {
            let o = (t * hp.n_head_kv + h) * hdk;
            ggml::ops::rope(&mut b.k[o..o + hdk], cos, sin, neox);
            let dst = (h * kv.n_ctx + pos) * hdk;
            for (d, &x) in kv.k[dst..dst + hdk].iter_mut().zip(&b.k[o..o + hdk]) {
                *d = ggml::round_f16(x);
            }
            let ov = (t * hp.n_head_kv + h) * hdv;
            let dst = (h * kv.n_ctx + pos) * hdv;
            for (d, &x) in kv.v[dst..dst + hdv].iter_mut().zip(&b.v[ov..ov + hdv]) {
                *d = ggml::round_f16(x);
            }
        }
    }
}

/// [`attend`] with ggml's flash attention ([`ggml::attention`]): parallel over (row, query head).
fn ggml_attend(s: &Step, b: &mut Buffers, rows: &impl RowsKv) {
    let hp = s.hp;
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    let group = hp.n_head / hp.n_head_kv;
    let window = hp.window(s.il);
    let n_tasks = s.n_tok * hp.n_head;
    let q = &b.q;
    let att = SyncPtr(b.att.as_mut_ptr());
    let scale = hp.attn_scale;
    s.pool.run(|ith, nth| {
        let mut sc = ggml::attention::Scratch::new(hdk);
        let mut task = ith;
        while task < n_tasks {
            let (t, h) = (task / hp.n_head, task % hp.n_head);
            let pos = rows.pos(t);
            let (kc, vc, kv_ctx) = rows.read(t);
            let kvh = h / group;
            let o = (t * hp.n_head + h) * hdv;
            // SAFETY: each task writes its own head's output.
            let out = unsafe { std::slice::from_raw_parts_mut(att.get().add(o), hdv) };
            ggml::attention::attend_row(
                &q[(t * hp.n_head + h) * hdk..(t * hp.n_head + h + 1) * hdk],
                &kc[kvh * kv_ctx * hdk..(kvh + 1) * kv_ctx * hdk],
                &vc[kvh * kv_ctx * hdv..(kvh + 1) * kv_ctx * hdv],
                hdk,
                hdv,
                window.map_or(0, |w| (pos + 1).saturating_sub(w)),
                pos + 1,
                scale,
                &mut sc,
                out,
            );
            task += nth;
        }
    });
}

/// SwiGLU `g = silu(g) * u` over the batch's feed-forward rows.
pub fn swiglu(s: &Step, g: &mut [f32], u: &[f32]) {
    if s.ggml() {
        ggml::ops::swiglu(g, u)
    } else {
        ops::silu_mul(g, u)
    }
}

/// GeGLU `g = gelu(g) * u` over the batch's feed-forward rows.
pub fn geglu(s: &Step, g: &mut [f32], u: &[f32]) {
    if s.ggml() {
        ggml::ops::geglu(g, u)
    } else {
        ops::gelu_mul(g, u)
    }
}

/// Causal attention of each row's query over its cache (positions `0..=pos` for a query at `pos`, or the last
/// `window` of them on sliding-window layers), written to `b.att`. Parallel over (row, KV head): the query heads of
/// one GQA group share the K and V rows they read (`kernels::attention`).
pub fn attend(s: &Step, b: &mut Buffers, rows: &impl RowsKv) {
    if s.ggml() {
        return ggml_attend(s, b, rows);
    }
    let hp = s.hp;
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    let group = hp.n_head / hp.n_head_kv;
    let window = hp.window(s.il);
    let n_tasks = s.n_tok * hp.n_head_kv;
    let per_thread = group * b.n_ctx;
    let q = &b.q;
    let att = SyncPtr(b.att.as_mut_ptr());
    let scores = SyncPtr(b.scores.as_mut_ptr());
    let scale = hp.attn_scale;
    s.pool.run(|ith, nth| {
        // SAFETY: each thread owns its own score rows, and writes only the att rows of its own tasks.
        let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ith * per_thread), per_thread) };
        let mut task = ith;
        while task < n_tasks {
            let (t, kvh) = (task / hp.n_head_kv, task % hp.n_head_kv);
            let pos = rows.pos(t);
            let (kc, vc, kv_ctx) = rows.read(t);
            let g = attention::Group {
                n_q: group,
                hdk,
                hdv,
                lo: window.map_or(0, |w| (pos + 1).saturating_sub(w)),
                hi: pos + 1,
                scale,
            };
            let h0 = t * hp.n_head + kvh * group;
            let qg = &q[h0 * hdk..(h0 + group) * hdk];
            let out = unsafe { std::slice::from_raw_parts_mut(att.get().add(h0 * hdv), group * hdv) };
            attention::attend(
                &g,
                qg,
                &kc[kvh * kv_ctx * hdk..(kvh + 1) * kv_ctx * hdk],
                &vc[kvh * kv_ctx * hdv..(kvh + 1) * kv_ctx * hdv],
                sc,
                out,
            );
            task += nth;
        }
    });
}
