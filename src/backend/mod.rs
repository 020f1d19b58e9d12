//! Where a model's ops run. The architecture scripts (`model/llama.rs`, `model/gemma3.rs`) say what one layer
//! computes, through the steps of `model/blocks.rs`; every number those steps produce comes from a [`Backend`]:
//! matmul (plain and gated), RMSNorm, RoPE, attention over the KV cache, the residual add. The KV cache is seen
//! through one backend-neutral view ([`RowsKv`], [`LayerKv`]: rows of one layer, f16), which snapshots, the wire
//! and the handoff read and write.
//!
//! Two backends run on the CPU: [`cpu::Cpu`] (Baton's kernels, the default) and [`ggml::CpuGgml`] (llama.cpp's CPU
//! arithmetic reproduced, `--numerics ggml`). A GPU backend is a third file here implementing the same trait.
//! The seam is as wide as our architectures need, no wider: candle's `BackendStorage` and ggml's backend interface
//! separate "what a model computes" from "where it runs" the same way, for far more ops.

pub mod cpu;
pub mod ggml;
pub mod gpu;

use crate::kernels::ggml::Numerics;
use crate::kernels::ops::RopeTable;
use crate::kernels::{self, Glu, Matrix, ThreadPool, attention};
use half::f16;

/// The ops a layer is made of. Each takes whole batches of rows (`n` rows of the input's width), so a backend that
/// launches work elsewhere pays its overhead once per op, not per row.
pub trait Backend: Sync {
    /// What `baton bench` and the logs call it.
    fn name(&self) -> &'static str;

    /// `y[t] = W · x[t]` for the `n` rows of `x` (`[n, w.cols]`) into `y` (`[n, w.rows]`).
    fn matmul(&self, pool: &ThreadPool, w: &Matrix, x: &[f32], n: usize, y: &mut [f32], sc: &mut Scratch);

    /// The gated feed-forward's first half: `h[t] = act(gate · x[t]) * (up · x[t])`, `h` `[n, gate.rows]`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_glu(
        &self,
        pool: &ThreadPool,
        gate: &Matrix,
        up: &Matrix,
        glu: Glu,
        x: &[f32],
        n: usize,
        h: &mut [f32],
        sc: &mut Scratch,
    );

    /// RMS-normalises each row of `x` (rows of `w.len()`) into `out`, scaled by `w`.
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]);

    /// [`Backend::rms_norm`] in place.
    fn rms_norm_inplace(&self, x: &mut [f32], w: &[f32], eps: f32);

    /// Rotates each head of `x` (heads of `head_dim` values) by position `pos`; `neox` rotates the halves of a head
    /// instead of adjacent pairs.
    fn rope(&self, table: &RopeTable, x: &mut [f32], head_dim: usize, pos: usize, neox: bool);

    /// Causal attention of each row's query heads in `q` (`[a.n_tok, a.n_head, a.hdk]`) over that row's KV cache,
    /// into `out` (`[a.n_tok, a.n_head, a.hdv]`).
    fn attend(&self, pool: &ThreadPool, a: &AttnShape, q: &[f32], rows: &dyn RowsKv, out: &mut [f32], sc: &mut Scratch);

    /// `x += y`, element-wise (the residual add).
    fn add(&self, x: &mut [f32], y: &[f32]);
}

/// The backend a session's [`Numerics`] asks for.
pub fn for_numerics(n: Numerics) -> &'static dyn Backend {
    static CPU: cpu::Cpu = cpu::Cpu;
    static CPU_GGML: ggml::CpuGgml = ggml::CpuGgml;
    match n {
        Numerics::Fast => &CPU,
        Numerics::Ggml => &CPU_GGML,
    }
}

/// The shape of one attention op.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Rows of the batch.
    pub n_tok: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub hdk: usize,
    pub hdv: usize,
    /// Sliding window: a row at `pos` attends to the last `window` positions up to `pos`.
    pub window: Option<usize>,
    pub scale: f32,
}

impl AttnShape {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }

    /// Values of one row's Q, K and V side by side (the GPU's stacked projections).
    pub fn qkv_width(&self) -> usize {
        self.n_head * self.hdk + self.n_head_kv * (self.hdk + self.hdv)
    }

    /// First position a row at `pos` attends to.
    pub fn lo(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// The CPU backends' working memory for one session, allocated once so a decoded token allocates nothing.
pub struct Scratch {
    /// The matmuls' quantized activations and tiles.
    pub mm: kernels::Scratch,
    /// The up projection where gate and up are not fused (the ggml arithmetic), grown on first use.
    pub(crate) up: Vec<f32>,
    /// Attention scratch of each thread: one chunk of scores per query head of a GQA group, and two partials.
    pub(crate) scores: Vec<f32>,
    /// Partial attention results of the chunks of a decode step spread over the threads.
    pub(crate) parts: Vec<f32>,
    /// Each thread's scratch and output of prefill attention in tiles (`kernels::attention_tiles`), grown on first
    /// use: decode never needs it.
    pub(crate) tiles: Vec<f32>,
    /// Positions the session's cache holds (sizes `parts`).
    pub(crate) n_ctx: usize,
}

impl Scratch {
    /// For `n_threads` threads, caches of `n_ctx` positions and GQA groups of `group` heads of `hdv` values.
    pub fn new(n_threads: usize, n_ctx: usize, group: usize, hdv: usize) -> Scratch {
        let (scores, parts) = Self::lens(n_threads, n_ctx, group, hdv);
        Scratch {
            mm: kernels::Scratch::default(),
            up: Vec::new(),
            scores: vec![0.0; scores],
            parts: vec![0.0; parts],
            tiles: Vec::new(),
            n_ctx,
        }
    }

    /// Lengths of `scores` and `parts`.
    fn lens(n_threads: usize, n_ctx: usize, group: usize, hdv: usize) -> (usize, usize) {
        let scores = n_threads.saturating_mul(attention::scratch_len(group, hdv));
        let parts = [n_ctx.div_ceil(attention::CHUNK), attention::partial_len(group, hdv)]
            .iter()
            .fold(cpu::split_rows(n_threads), |n, &f| n.saturating_mul(f));
        (scores, parts)
    }

    /// Bytes [`Scratch::new`] allocates (the buffers that grow with use aside).
    pub fn bytes_for(n_threads: usize, n_ctx: usize, group: usize, hdv: usize) -> usize {
        let (scores, parts) = Self::lens(n_threads, n_ctx, group, hdv);
        scores.saturating_add(parts).saturating_mul(4)
    }
}

/// One layer's KV cache: K is `[n_head_kv, n_ctx, head_dim_k]`, V `[n_head_kv, n_ctx, head_dim_v]`, positions in
/// order. K is stored after RoPE.
pub struct LayerKv<'a> {
    pub k: &'a mut [f16],
    pub v: &'a mut [f16],
    pub n_ctx: usize,
}

impl LayerKv<'_> {
    /// Bytes of K and V (f16) for `n_layers` layers of `n_ctx` positions. Saturates instead of overflowing: memory
    /// checks compare it with what a machine has.
    pub fn bytes_for(n_layers: usize, n_head_kv: usize, n_ctx: usize, head_dim_k: usize, head_dim_v: usize) -> usize {
        [n_head_kv, n_ctx, head_dim_k.saturating_add(head_dim_v), 2]
            .iter()
            .fold(n_layers, |b, &f| b.saturating_mul(f))
    }
}

/// A layer range's KV cache as layers in the layout of [`LayerKv`], by global layer index: what a device's layers
/// (`gpu::layers`) copy the rows they write into, and upload imported rows from, without knowing the engine's cache.
pub trait KvLayers {
    /// Layer `il`'s K and V to read, and the positions each head's run holds.
    fn kv_layer(&self, il: usize) -> (&[f16], &[f16], usize);
    /// Layer `il`'s K and V to write.
    fn kv_layer_mut(&mut self, il: usize) -> LayerKv<'_>;
}

/// Where the rows of a batch keep their KV in one layer, and at which positions: one cache's consecutive positions
/// (prefill, one session's decode), or each row its own session's cache at its own position (batched decode across
/// sessions, `engine::batch`). The layer code is the same for both.
pub trait RowsKv: Sync {
    /// Position of row `t`.
    fn pos(&self, t: usize) -> usize;
    /// Row `t`'s cache of this layer to read: K, V and the positions each head's run holds.
    fn read(&self, t: usize) -> (&[f16], &[f16], usize);
    /// Row `t`'s cache of this layer to write.
    fn write(&mut self, t: usize) -> LayerKv<'_>;
}
