//! Building blocks shared by the architecture files (as llama.cpp's graph helpers): the scratch buffers of a
//! forward pass, the view of one layer's KV cache, and the attention steps. Each architecture file is then a short
//! script calling these in its own order.

use super::{Hparams, LayerWeights};
use crate::kernels::ggml::{self, Numerics};
use crate::kernels::ops::{self, RopeTable};
use crate::kernels::{self, Glu, Matrix, ThreadPool, attention};
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
    work: Vec<f32>,
    /// Lengths of Q, K and V in `work` (the attention output follows them).
    qkv_len: [usize; 3],
    n_ff: usize,
    /// The up projection, apart from the gate only in the `ggml` numerics mode (allocated on its first use).
    up: Vec<f32>,
    /// Attention scratch of each thread: one chunk of scores per query head of a GQA group, and two partials.
    pub scores: Vec<f32>,
    /// Partial attention results of the chunks of a decode step spread over the threads ([`attend`]).
    pub parts: Vec<f32>,
    pub n_ctx: usize,
    pub mm: kernels::Scratch,
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
    /// Scratch for batches of up to `n_batch` rows.
    pub fn new(hp: &Hparams, n_batch: usize, n_ctx: usize, n_threads: usize) -> Buffers {
        let n_rows = n_batch.min(LAYER_SLICE);
        let qkv_len = [hp.n_embd_q(), hp.n_embd_k(), hp.n_embd_v()].map(|w| n_rows * w);
        let attn_len = qkv_len.iter().sum::<usize>() + n_rows * hp.n_head * hp.head_dim_v;
        Buffers {
            n_rows,
            xn: vec![0.0; n_rows * hp.n_embd],
            work: vec![0.0; attn_len.max(n_rows * hp.n_ff)],
            qkv_len,
            n_ff: hp.n_ff,
            up: Vec::new(),
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

    /// Q, K, V and the attention output.
    pub fn attn(&mut self) -> Attn<'_> {
        Attn::split(&mut self.work, self.qkv_len)
    }
}

impl<'a> Attn<'a> {
    /// A function of the two fields, not a method of [`Buffers`], so the other fields stay free to borrow.
    fn split(work: &'a mut [f32], [nq, nk, nv]: [usize; 3]) -> Attn<'a> {
        let (q, rest) = work.split_at_mut(nq);
        let (k, rest) = rest.split_at_mut(nk);
        let (v, att) = rest.split_at_mut(nv);
        Attn { q, k, v, att }
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
    let a = Attn::split(&mut b.work, b.qkv_len);
    project(s, &lw.wq, &b.xn, a.q, &mut b.mm);
    project(s, &lw.wk, &b.xn, a.k, &mut b.mm);
    project(s, &lw.wv, &b.xn, a.v, &mut b.mm);
}

/// The attention's output projection, written to `b.xn` (the sub-block's input is no longer needed).
pub fn attn_output(s: &Step, lw: &LayerWeights, b: &mut Buffers) {
    let a = Attn::split(&mut b.work, b.qkv_len);
    project(s, &lw.wo, a.att, &mut b.xn, &mut b.mm);
}

/// The gated feed-forward of the normalised input: `b.xn = down(act(gate(b.xn)) · up(b.xn))`, gate and up fused
/// ([`kernels::matmul_glu`]) except in the `ggml` mode, which reproduces llama.cpp's separate ops.
pub fn ffn(s: &Step, lw: &LayerWeights, b: &mut Buffers, glu: Glu) {
    let nf = s.n_tok * b.n_ff;
    let h = &mut b.work[..nf];
    if s.ggml() {
        if b.up.len() < nf {
            b.up.resize(b.n_rows * b.n_ff, 0.0);
        }
        project(s, &lw.ffn_gate, &b.xn, h, &mut b.mm);
        project(s, &lw.ffn_up, &b.xn, &mut b.up, &mut b.mm);
        match glu {
            Glu::Silu => ggml::ops::swiglu(h, &b.up[..nf]),
            Glu::Gelu => ggml::ops::geglu(h, &b.up[..nf]),
        }
    } else {
        let x = &b.xn[..s.n_tok * lw.ffn_gate.cols];
        kernels::matmul_glu(s.pool, &lw.ffn_gate, &lw.ffn_up, glu, x, s.n_tok, h, &mut b.mm);
    }
    project(s, &lw.ffn_down, h, &mut b.xn, &mut b.mm);
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
    let a = b.attn();
    for t in 0..s.n_tok {
        let pos = rows.pos(t);
        let kv = rows.write(t);
        for h in 0..hp.n_head {
            let o = (t * hp.n_head + h) * hdk;
            rotate(&mut a.q[o..o + hdk], pos);
        }
        for h in 0..hp.n_head_kv {
            let o = (t * hp.n_head_kv + h) * hdk;
            rotate(&mut a.k[o..o + hdk], pos);
            let dst = (h * kv.n_ctx + pos) * hdk;
            kv.k[dst..dst + hdk].convert_from_f32_slice(&a.k[o..o + hdk]);
            let ov = (t * hp.n_head_kv + h) * hdv;
            let dst = (h * kv.n_ctx + pos) * hdv;
            kv.v[dst..dst + hdv].convert_from_f32_slice(&a.v[ov..ov + hdv]);
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
    let a = Attn::split(&mut b.work, b.qkv_len);
    let q = &*a.q;
    let att = SyncPtr(a.att.as_mut_ptr());
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

/// Up to how many (row, KV head) pairs a step spreads each pair's chunks of positions over the threads, rather than
/// giving each pair to one thread: a decode step has one row, and Gemma 3 one KV head.
fn split_rows(n_threads: usize) -> usize {
    4 * n_threads
}

/// Causal attention of each row's query over its cache (positions `0..=pos` for a query at `pos`, or the last
/// `window` of them on sliding-window layers), written to the attention output. The query heads of one GQA group share the K and
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
    let a = Attn::split(&mut b.work, b.qkv_len);
    let q = &*a.q;
    let att = SyncPtr(a.att.as_mut_ptr());
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
        attention::finish(&g, acc, &mut a.att[o..o + group * hdv]);
    }
}
