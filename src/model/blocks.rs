//! Building blocks shared by the architecture files (as llama.cpp's graph helpers): the scratch buffers of a
//! forward pass, the view of one layer's KV cache, and the attention steps. Each architecture file is then a short
//! script calling these in its own order.

use super::{Hparams, LayerWeights};
use crate::kernels::ggml::{self, Numerics};
use crate::kernels::ops::{self, RopeTable};
use crate::kernels::{self, Matrix, ThreadPool, attention};
use half::f16;
use half::slice::HalfFloatSliceExt;

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
    /// Attention scratch of each thread: one chunk of scores per query head of a GQA group, and two partials.
    pub scores: Vec<f32>,
    /// Partial attention results of the chunks of a decode step spread over the threads ([`attend`]).
    pub parts: Vec<f32>,
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
            scores: vec![0.0; n_threads * attention::scratch_len(hp.n_head / hp.n_head_kv, hp.head_dim_v)],
            parts: vec![
                0.0;
                split_rows(n_threads)
                    * n_ctx.div_ceil(attention::CHUNK)
                    * attention::partial_len(hp.n_head / hp.n_head_kv, hp.head_dim_v)
            ],
            n_ctx,
            mm: kernels::Scratch::default(),
        }
    }
}

/// One layer's KV cache: K is `[n_head_kv, n_ctx, head_dim_k]`, V `[n_head_kv, n_ctx, head_dim_v]`, positions in
/// order. K is stored after RoPE.
pub struct LayerKv<'a> {
    pub k: &'a mut [f16],
    pub v: &'a mut [f16],
    pub n_ctx: usize,
}

/// Where the rows of a batch keep their KV in one layer, and at which positions: one cache's consecutive positions
/// ([`SeqKv`]: prefill, one session's decode), or each row its own session's cache at its own position (batched
/// decode across sessions, `engine::batch`). The layer code is the same for both.
pub trait RowsKv: Sync {
    /// Position of row `t`.
    fn pos(&self, t: usize) -> usize;
    /// Row `t`'s cache of this layer to read: K, V and the positions each head's run holds.
    fn read(&self, t: usize) -> (&[f16], &[f16], usize);
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

/// Rotates Q and K by position and writes each row's K and V into its cache at its position (rounded to f16, to
/// nearest, as ggml's F16 cache rounds them). The ggml mode rotates with ggml's arithmetic.
pub fn rope_and_store(s: &Step, b: &mut Buffers, rows: &mut impl RowsKv) {
    let hp = s.hp;
    let neox = hp.rope_type == super::RopeType::Neox;
    let ggml = s.ggml();
    let rotate = |x: &mut [f32], pos: usize| {
        if ggml {
            let (cos, sin) = s.rope.cos_sin(pos);
            ggml::ops::rope(x, cos, sin, neox);
        } else {
            s.rope.apply(x, pos, neox);
        }
    };
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    for t in 0..s.n_tok {
        let pos = rows.pos(t);
        let kv = rows.write(t);
        for h in 0..hp.n_head {
            let o = (t * hp.n_head + h) * hdk;
            rotate(&mut b.q[o..o + hdk], pos);
        }
        for h in 0..hp.n_head_kv {
            let o = (t * hp.n_head_kv + h) * hdk;
            rotate(&mut b.k[o..o + hdk], pos);
            let dst = (h * kv.n_ctx + pos) * hdk;
            kv.k[dst..dst + hdk].convert_from_f32_slice(&b.k[o..o + hdk]);
            let ov = (t * hp.n_head_kv + h) * hdv;
            let dst = (h * kv.n_ctx + pos) * hdv;
            kv.v[dst..dst + hdv].convert_from_f32_slice(&b.v[ov..ov + hdv]);
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

/// Up to how many (row, KV head) pairs a step spreads each pair's chunks of positions over the threads, rather than
/// giving each pair to one thread: a decode step has one row, and Gemma 3 one KV head.
fn split_rows(n_threads: usize) -> usize {
    4 * n_threads
}

/// Causal attention of each row's query over its cache (positions `0..=pos` for a query at `pos`, or the last
/// `window` of them on sliding-window layers), written to `b.att`. The query heads of one GQA group share the K and
/// V rows they read (`kernels::attention`). With many (row, KV head) pairs (prefill, large batches) each thread takes
/// whole pairs; with few (decode) the pairs' chunks of positions are spread over the threads and folded after. A
/// row gets the same bits either way.
pub fn attend(s: &Step, b: &mut Buffers, rows: &impl RowsKv) {
    if s.ggml() {
        return ggml_attend(s, b, rows);
    }
    let hp = s.hp;
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    let group = hp.n_head / hp.n_head_kv;
    let window = hp.window(s.il);
    let n_tasks = s.n_tok * hp.n_head_kv;
    let per_thread = attention::scratch_len(group, hdv);
    let q = &b.q;
    let att = SyncPtr(b.att.as_mut_ptr());
    let scores = SyncPtr(b.scores.as_mut_ptr());
    let scale = hp.attn_scale;
    // Task `task` is row `t`, KV head `kvh`: its group of query heads, its slice of the cache and its output.
    let task = |task: usize| {
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
        (
            g,
            &q[h0 * hdk..(h0 + group) * hdk],
            &kc[kvh * kv_ctx * hdk..(kvh + 1) * kv_ctx * hdk],
            &vc[kvh * kv_ctx * hdv..(kvh + 1) * kv_ctx * hdv],
            h0 * hdv,
        )
    };

    if n_tasks > split_rows(s.pool.n_threads()) {
        s.pool.run(|ith, nth| {
            // SAFETY: each thread owns its own scratch, and writes only the att rows of its own tasks.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ith * per_thread), per_thread) };
            let mut i = ith;
            while i < n_tasks {
                let (g, qg, k, v, o) = task(i);
                let out = unsafe { std::slice::from_raw_parts_mut(att.get().add(o), group * hdv) };
                attention::attend(&g, qg, k, v, sc, out);
                i += nth;
            }
        });
        return;
    }

    // Few tasks: every chunk of every task is one work item, dealt round-robin; task `i`'s partials are at
    // `parts[(i * max_chunks + c) * pl]`.
    let pl = attention::partial_len(group, hdv);
    let max_chunks = b.n_ctx.div_ceil(attention::CHUNK);
    assert!(b.parts.len() >= n_tasks * max_chunks * pl);
    let parts = SyncPtr(b.parts.as_mut_ptr());
    s.pool.run(|ith, nth| {
        // SAFETY: each thread owns its own scratch and writes only the partials of its own work items.
        let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ith * per_thread), per_thread) };
        let mut item = 0;
        for i in 0..n_tasks {
            let (g, qg, k, v, _) = task(i);
            for c in 0..g.n_chunks() {
                if item % nth == ith {
                    let p = unsafe { std::slice::from_raw_parts_mut(parts.get().add((i * max_chunks + c) * pl), pl) };
                    attention::partial(&g, c, qg, k, v, sc, p);
                }
                item += 1;
            }
        }
    });
    for i in 0..n_tasks {
        let (g, _, _, _, o) = task(i);
        let (acc, rest) = b.parts[i * max_chunks * pl..].split_at_mut(pl);
        for c in 1..g.n_chunks() {
            attention::fold(&g, acc, &rest[(c - 1) * pl..c * pl]);
        }
        attention::finish(&g, acc, &mut b.att[o..o + group * hdv]);
    }
}
