//! The few coarse ops a forward pass needs. Quantized matmul (GEMV for decode, tiled GEMM for prefill) lives in
//! the per-format files; element-wise and attention helpers in [`ops`]. SIMD paths are chosen at run time and each
//! has a scalar reference it is tested against.
//!
//! A matmul goes as in ggml's CPU backend, so numbers match llama.cpp closely: the activation rows are quantized
//! once per call into the weight type's "vec-dot type" (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the
//! K-quants), then every output is an integer dot per block, scaled per block. Float weights are dotted in f32.

pub mod attention;
pub mod attention_tiles;
pub mod blocks32;
pub mod float;
pub mod ggml;
pub mod interleaved;
pub mod iquants;
pub mod kquants;
pub mod matrix;
#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod ops;
pub mod pool;
pub mod table;
#[cfg(test)]
pub(crate) mod testutil;
#[cfg(target_arch = "x86_64")]
pub mod x86;

pub use matrix::Matrix;
pub use pool::{SyncPtr, ThreadPool};

use crate::gguf::GgmlType;
use pool::split_range;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use blocks32::{
    quantize_row_q4_0, quantize_row_q4_1, quantize_row_q5_0, quantize_row_q5_1, quantize_row_q8_0, quantize_row_q8_1,
};
pub use kquants::quantize_row_q8_k;

/// Dequantizes one row: `src` holds `dst.len() / ty.block_size()` blocks of `ty`. Panics if the lengths disagree
/// (a caller bug: row lengths are checked when a model is loaded).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q4_0 => blocks32::dequantize_q4_0(src, dst),
        Q4_1 => blocks32::dequantize_q4_1(src, dst),
        Q5_0 => blocks32::dequantize_q5_0(src, dst),
        Q5_1 => blocks32::dequantize_q5_1(src, dst),
        Q8_0 => blocks32::dequantize_q8_0(src, dst),
        Q8_1 => blocks32::dequantize_q8_1(src, dst),
        Q2K => kquants::dequantize_q2_k(src, dst),
        Q3K => kquants::dequantize_q3_k(src, dst),
        Q4K => kquants::dequantize_q4_k(src, dst),
        Q5K => kquants::dequantize_q5_k(src, dst),
        Q6K => kquants::dequantize_q6_k(src, dst),
        Q8K => kquants::dequantize_q8_k(src, dst),
        IQ4NL => iquants::dequantize_iq4_nl(src, dst),
        IQ4XS => iquants::dequantize_iq4_xs(src, dst),
        IQ2XXS => iquants::dequantize_iq2_xxs(src, dst),
        IQ2XS => iquants::dequantize_iq2_xs(src, dst),
        IQ2S => iquants::dequantize_iq2_s(src, dst),
        IQ3XXS => iquants::dequantize_iq3_xxs(src, dst),
        IQ3S => iquants::dequantize_iq3_s(src, dst),
        IQ1S => iquants::dequantize_iq1_s(src, dst),
    }
}

/// Quantizes one row of activations into a vec-dot type (Q8_0, Q8_1 or Q8_K) with the dispatched kernel.
/// Returns false for other types.
pub fn quantize_activations(ty: GgmlType, x: &[f32], out: &mut [u8]) -> bool {
    let k = kernels();
    match ty {
        GgmlType::Q8_0 => (k.quant_q8_0)(x, out),
        GgmlType::Q8_1 => (k.quant_q8_1)(x, out),
        GgmlType::Q8K => (k.quant_q8_k)(x, out),
        _ => return false,
    }
    true
}

pub use table::{DotFn, Kernels, MULTI, MultiDotFn, QKernel, QuantFn};

impl Kernels {
    /// The best table this CPU supports. `BATON_ISA=scalar|avx2|avx512` (x86-64; `avx512` without VNNI) or
    /// `BATON_ISA=scalar|neon` (AArch64, `neon` without the dot-product instructions) picks a lower one (benchmarks,
    /// debugging).
    pub fn detect() -> Kernels {
        let want = std::env::var("BATON_ISA").unwrap_or_default();
        #[cfg(target_arch = "x86_64")]
        {
            if want != "scalar" && want != "avx2" && x86::has_avx512() {
                return x86::table_avx512();
            }
            if want != "scalar" && x86::has_avx2() {
                return x86::table_avx2();
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if want != "scalar" && want != "neon" && neon::has_dotprod() {
                return neon::table_neon_dotprod();
            }
            if want != "scalar" {
                return neon::table_neon();
            }
        }
        let _ = want;
        Kernels::scalar()
    }
}

/// The dispatch table for this CPU, detected on first use.
pub fn kernels() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(Kernels::detect)
}

/// The kernel level in use, as benchmarks and logs name it: the table's ISA (`scalar`, `avx2`, `avx512`, `neon`,
/// `neon-dotprod`), with `+vnni` where the AVX-512 kernels use VNNI.
pub fn isa_label() -> String {
    let isa = kernels().isa;
    if interleaved::vnni() {
        format!("{isa}+vnni")
    } else {
        isa.to_string()
    }
}

/// Reusable buffers for [`matmul`] (quantized activations), so a decoded token allocates nothing.
#[derive(Default)]
pub struct Scratch {
    /// Activation rows quantized to the weight type's vec-dot type.
    xq: Vec<u8>,
    /// Per thread: a dequantized weight row (weights without an integer kernel), or a tile of up-projection values
    /// ([`matmul_glu`]).
    rows: Vec<f32>,
    /// The up projection when [`matmul_glu`] cannot fuse (gate and up stored differently).
    up: Vec<f32>,
}

/// Tokens whose quantized activations are kept hot while a thread walks its weight rows.
const TOKEN_BLOCK: usize = 64;

/// Rows per work item: small enough for the threads to balance (the box is shared), big enough that fetching the
/// next item is noise.
fn row_chunk(rows: usize, n_tok: usize, n_threads: usize) -> usize {
    let target = if n_tok == 1 { 8 } else { 16 } * n_threads;
    (rows.div_ceil(target)).clamp(4, 1024).next_multiple_of(4)
}

/// The activation of a gated feed-forward, `act(gate) · up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// SwiGLU (Llama): `silu(gate) · up`.
    Silu,
    /// GeGLU (Gemma): `gelu_tanh(gate) · up`.
    Gelu,
}

impl Glu {
    /// `g = act(g) · u` element by element; any slicing gives the same bits (the SIMD paths mask their tails).
    pub fn apply(self, g: &mut [f32], u: &[f32]) {
        match self {
            Glu::Silu => ops::silu_mul(g, u),
            Glu::Gelu => ops::gelu_mul(g, u),
        }
    }
}

/// `y[t * w.rows + r] = Σ_k W[r, k] · x[t * w.cols + k]` for each of the `n_tok` input rows.
pub fn matmul(pool: &ThreadPool, w: &Matrix, x: &[f32], n_tok: usize, y: &mut [f32], scratch: &mut Scratch) {
    matmul_with(kernels(), pool, w, x, n_tok, y, scratch)
}

/// [`matmul`] with an explicit kernel table (tests compare tables).
pub fn matmul_with(
    k: &Kernels,
    pool: &ThreadPool,
    w: &Matrix,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    scratch: &mut Scratch,
) {
    matmul_impl(k, pool, w, None, x, n_tok, y, scratch)
}

/// The two input projections of a gated feed-forward in one pass: `y[t, r] = act((x·Gᵀ)[t, r]) · (x·Uᵀ)[t, r]`,
/// `y` being `[n_tok, gate.rows]`. Each work item keeps its rows' up values in a small per-thread tile and combines
/// them as soon as the gate values are done, so the `[n_tok, n_ff]` up buffer (1.5 MiB of SmolLM2's prefill at
/// 256 tokens) never exists and the separate element-wise pass over both is saved. The same bits as two
/// [`matmul`]s and [`Glu::apply`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_glu(
    pool: &ThreadPool,
    gate: &Matrix,
    up: &Matrix,
    glu: Glu,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    scratch: &mut Scratch,
) {
    matmul_glu_with(kernels(), pool, gate, up, glu, x, n_tok, y, scratch)
}

/// [`matmul_glu`] with an explicit kernel table.
#[allow(clippy::too_many_arguments)]
pub fn matmul_glu_with(
    k: &Kernels,
    pool: &ThreadPool,
    gate: &Matrix,
    up: &Matrix,
    glu: Glu,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    scratch: &mut Scratch,
) {
    assert_eq!(
        (gate.rows, gate.cols),
        (up.rows, up.cols),
        "gate and up projections differ in shape"
    );
    if gate.ty == up.ty && gate.layout == up.layout {
        return matmul_impl(k, pool, gate, Some((up, glu)), x, n_tok, y, scratch);
    }
    // Stored differently (a mixed quantization): two passes through a buffer kept for the next call.
    let n = n_tok * gate.rows;
    let mut u = std::mem::take(&mut scratch.up);
    if u.len() < n {
        u.resize(n, 0.0);
    }
    matmul_impl(k, pool, gate, None, x, n_tok, y, scratch);
    matmul_impl(k, pool, up, None, x, n_tok, &mut u, scratch);
    glu.apply(&mut y[..n], &u[..n]);
    scratch.up = u;
}

/// [`matmul_with`], or with `up` the fused [`matmul_glu_with`] (`up` stored like `w`).
#[allow(clippy::too_many_arguments)]
fn matmul_impl(
    k: &Kernels,
    pool: &ThreadPool,
    w: &Matrix,
    up: Option<(&Matrix, Glu)>,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    scratch: &mut Scratch,
) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(
        x.len() >= n_tok * cols,
        "matmul: {} activations for {n_tok} rows of {cols}",
        x.len()
    );
    assert!(
        y.len() >= n_tok * rows,
        "matmul: output of {} for {n_tok} rows of {rows}",
        y.len()
    );
    if n_tok == 0 || rows == 0 {
        return;
    }
    let yp = SyncPtr::new(y.as_mut_ptr());
    let Some(qk) = k.for_type(w.ty) else {
        return matmul_float(k, pool, w, up, x, n_tok, yp, scratch);
    };

    let xrb = qk.vec_dot_type.row_bytes(cols).expect("weight rows are whole blocks");
    if scratch.xq.len() < n_tok * xrb {
        scratch.xq.resize(n_tok * xrb, 0);
    }
    let quant = k.quant(qk.vec_dot_type);
    if n_tok >= 4 && pool.n_threads() > 1 {
        let xq = SyncPtr::new(scratch.xq.as_mut_ptr());
        pool.run(|i, n| {
            for t in split_range(n_tok, i, n) {
                // SAFETY: each thread quantizes its own token rows.
                let out = unsafe { std::slice::from_raw_parts_mut(xq.get().add(t * xrb), xrb) };
                quant(&x[t * cols..(t + 1) * cols], out);
            }
        });
    } else {
        for t in 0..n_tok {
            quant(&x[t * cols..(t + 1) * cols], &mut scratch.xq[t * xrb..(t + 1) * xrb]);
        }
    }
    let xq = &scratch.xq[..n_tok * xrb];
    if w.layout == matrix::Layout::X16 {
        return matmul_interleaved(pool, w, up, xq, xrb, n_tok, yp, qk.dot, interleaved::Level::of(k));
    }

    let chunk = row_chunk(rows, n_tok, pool.n_threads());
    let tile_len = if up.is_some() {
        TOKEN_BLOCK.min(n_tok) * chunk
    } else {
        0
    };
    if scratch.rows.len() < pool.n_threads() * tile_len {
        scratch.rows.resize(pool.n_threads() * tile_len, 0.0);
    }
    let tiles = SyncPtr::new(scratch.rows.as_mut_ptr());
    let next = AtomicUsize::new(0);
    let rows_of = |m| RowDots::new(m, xq, xrb, qk, n_tok == 1);
    let (gate, up) = (rows_of(w), up.map(|(u, glu)| (rows_of(u), glu)));
    pool.run(|ith, _| {
        loop {
            let r0 = next.fetch_add(1, Ordering::Relaxed) * chunk;
            if r0 >= rows {
                break;
            }
            let r1 = (r0 + chunk).min(rows);
            for t0 in (0..n_tok).step_by(TOKEN_BLOCK) {
                let t1 = (t0 + TOKEN_BLOCK).min(n_tok);
                // SAFETY (both calls): rows r0..r1 of every token belong to this work item, and thread `ith`
                // owns tile `ith`.
                unsafe { gate.run(r0..r1, t0..t1, yp.get().add(t0 * rows), rows, 0) };
                let Some((u, glu)) = &up else { continue };
                let (tile, cw) = (unsafe { tiles.get().add(ith * tile_len) }, r1 - r0);
                unsafe { u.run(r0..r1, t0..t1, tile, cw, r0) };
                for t in t0..t1 {
                    let (g, u) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(yp.get().add(t * rows + r0), cw),
                            std::slice::from_raw_parts(tile.add((t - t0) * cw), cw),
                        )
                    };
                    glu.apply(g, u);
                }
            }
        }
    });
}

/// The quantized dots of row-major weight rows against quantized activation rows.
struct RowDots<'a> {
    w: &'a [u8],
    wrb: usize,
    nb: usize,
    xq: &'a [u8],
    xrb: usize,
    dot: DotFn,
    multi: Option<MultiDotFn>,
    /// One token: the plain dot per row (the decode path), not the multi-token kernel.
    single: bool,
}

impl<'a> RowDots<'a> {
    fn new(m: &'a Matrix, xq: &'a [u8], xrb: usize, qk: QKernel, single: bool) -> Self {
        RowDots {
            w: &m.bytes()[..m.rows * m.row_bytes()],
            wrb: m.row_bytes(),
            nb: m.cols / m.ty.block_size(),
            xq,
            xrb,
            dot: qk.dot,
            multi: qk.multi,
            single,
        }
    }

    /// Writes the dot of weight row `r` with token `t` to `out[(t - tokens.start) * ld + r - r_base]`.
    ///
    /// # Safety
    /// Those elements of `out` must be valid and written by no one else meanwhile.
    unsafe fn run(
        &self,
        rows: std::ops::Range<usize>,
        tokens: std::ops::Range<usize>,
        out: *mut f32,
        ld: usize,
        r_base: usize,
    ) {
        let (xq, xrb, nb) = (self.xq, self.xrb, self.nb);
        let at = |t: usize, r: usize| (t - tokens.start) * ld + r - r_base;
        if self.single {
            for r in rows {
                let v = (self.dot)(nb, &self.w[r * self.wrb..(r + 1) * self.wrb], xq);
                unsafe { *out.add(at(0, r)) = v };
            }
            return;
        }
        let mut vals = [0.0f32; MULTI];
        for r in rows {
            let wr = &self.w[r * self.wrb..(r + 1) * self.wrb];
            for t in tokens.clone().step_by(MULTI) {
                let m = (tokens.end - t).min(MULTI);
                match self.multi {
                    Some(f) => f(nb, wr, &xq[t * xrb..], xrb, &mut vals[..m]),
                    None => {
                        for (j, o) in vals[..m].iter_mut().enumerate() {
                            *o = (self.dot)(nb, wr, &xq[(t + j) * xrb..(t + j + 1) * xrb]);
                        }
                    }
                }
                for (j, v) in vals[..m].iter().enumerate() {
                    unsafe { *out.add(at(t + j, r)) = *v };
                }
            }
        }
    }
}

/// [`matmul_impl`] for float (and exotic) weights: each row is dequantized once and dotted with every token in f32.
#[allow(clippy::too_many_arguments)]
fn matmul_float(
    k: &Kernels,
    pool: &ThreadPool,
    w: &Matrix,
    up: Option<(&Matrix, Glu)>,
    x: &[f32],
    n_tok: usize,
    yp: SyncPtr<f32>,
    scratch: &mut Scratch,
) {
    let (rows, cols) = (w.rows, w.cols);
    let nth = pool.n_threads();
    // Per thread: one dequantized row, and with `up` the gate and up values of one row for every token.
    let per = cols + if up.is_some() { 2 * n_tok } else { 0 };
    if scratch.rows.len() < nth * per {
        scratch.rows.resize(nth * per, 0.0);
    }
    let bufs = SyncPtr::new(scratch.rows.as_mut_ptr());
    let chunk = row_chunk(rows, n_tok, nth);
    let next = AtomicUsize::new(0);
    let dot = k.dot_f32;
    let row_dots = |m: &Matrix, r: usize, buf: &mut [f32], out: &mut dyn FnMut(usize, f32)| {
        let rb = m.row_bytes();
        let row = &m.bytes()[r * rb..(r + 1) * rb];
        // A row dotted with one or two tokens (decode's F16 output head) is converted in registers: writing it out
        // as f32 first cost more than the dot.
        if let (GgmlType::F16, Some(dot_f16), 1..=2) = (m.ty, k.dot_f16, n_tok) {
            for t in 0..n_tok {
                out(t, dot_f16(row, &x[t * cols..(t + 1) * cols]));
            }
            return;
        }
        dequantize_row(m.ty, row, buf);
        for t in 0..n_tok {
            out(t, dot(buf, &x[t * cols..(t + 1) * cols]));
        }
    };
    pool.run(|i, _| {
        // SAFETY: thread `i` owns buffer `i`.
        let buf = unsafe { std::slice::from_raw_parts_mut(bufs.get().add(i * per), per) };
        let (row, gu) = buf.split_at_mut(cols);
        loop {
            let r0 = next.fetch_add(1, Ordering::Relaxed) * chunk;
            if r0 >= rows {
                break;
            }
            for r in r0..(r0 + chunk).min(rows) {
                // SAFETY (all writes): element (t, r) is written by the one thread that took row r.
                let Some((u, glu)) = up else {
                    row_dots(w, r, row, &mut |t, v| unsafe { *yp.get().add(t * rows + r) = v });
                    continue;
                };
                let (g, uv) = gu.split_at_mut(n_tok);
                row_dots(w, r, row, &mut |t, v| g[t] = v);
                row_dots(u, r, row, &mut |t, v| uv[t] = v);
                glu.apply(g, uv);
                for (t, v) in g.iter().enumerate() {
                    unsafe { *yp.get().add(t * rows + r) = *v };
                }
            }
        }
    });
}

/// [`matmul_impl`] for weights repacked in groups of 16 rows: threads take groups; each group's weights (a few KB)
/// stay in L1 while every token, a tile at a time, goes past them. Rows after the last group are row-major. The group
/// kernels are those of the table's level (`lvl`), like the tail rows' `dot`.
#[allow(clippy::too_many_arguments)]
fn matmul_interleaved<'a>(
    pool: &ThreadPool,
    w: &'a Matrix,
    up: Option<(&'a Matrix, Glu)>,
    xq: &[u8],
    xrb: usize,
    n_tok: usize,
    yp: SyncPtr<f32>,
    dot: DotFn,
    lvl: interleaved::Level,
) {
    let (rows, nb) = (w.rows, w.cols / w.ty.block_size());
    let groups = rows / interleaved::ROWS;
    let gbytes = nb * interleaved::group_block(w.ty);
    let per_item = groups.div_ceil(8 * pool.n_threads()).max(1);
    let next = AtomicUsize::new(0);
    pool.run(|_, _| {
        let mut out = [[0.0f32; interleaved::ROWS]; interleaved::TILE];
        let mut out_up = [[0.0f32; interleaved::ROWS]; interleaved::TILE];
        loop {
            let g0 = next.fetch_add(1, Ordering::Relaxed) * per_item;
            if g0 >= groups {
                break;
            }
            for g in g0..(g0 + per_item).min(groups) {
                let group = |m: &'a Matrix| &m.bytes()[g * gbytes..(g + 1) * gbytes];
                for t in (0..n_tok).step_by(interleaved::TILE) {
                    let n = (n_tok - t).min(interleaved::TILE);
                    interleaved::dot_group_with(lvl, w.ty, nb, group(w), &xq[t * xrb..], xrb, n, &mut out);
                    if let Some((u, glu)) = up {
                        interleaved::dot_group_with(lvl, u.ty, nb, group(u), &xq[t * xrb..], xrb, n, &mut out_up);
                        for (o, v) in out[..n].iter_mut().zip(&out_up) {
                            glu.apply(o, v);
                        }
                    }
                    for (j, o) in out[..n].iter().enumerate() {
                        // SAFETY: the rows of group g belong to this work item.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                o.as_ptr(),
                                yp.get().add((t + j) * rows + g * interleaved::ROWS),
                                interleaved::ROWS,
                            )
                        };
                    }
                }
            }
        }
    });
    // Rows past the last group follow the groups, row-major (a group may take more bytes than its 16 rows did).
    let rb = w.row_bytes();
    let tail_dot = |m: &Matrix, r: usize, t: usize| {
        let off = m.interleaved_tail_offset(r);
        dot(nb, &m.bytes()[off..off + rb], &xq[t * xrb..(t + 1) * xrb])
    };
    for r in groups * interleaved::ROWS..rows {
        for t in 0..n_tok {
            let mut v = [tail_dot(w, r, t)];
            if let Some((u, glu)) = up {
                glu.apply(&mut v, &[tail_dot(u, r, t)]);
            }
            // SAFETY: tail rows are written here only, after the pool job.
            unsafe { *yp.get().add(t * rows + r) = v[0] };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::matrix::Bytes;
    use super::testutil::{Rng, random_blocks};
    use super::*;

    /// Offsets of the f16 scales of each quantized type (kept sane in random blocks).
    pub(crate) fn f16_offsets(ty: GgmlType) -> &'static [usize] {
        use GgmlType::*;
        match ty {
            Q4_0 | Q5_0 | Q8_0 => &[0],
            Q4_1 | Q5_1 => &[0, 2],
            Q2K => &[80, 82],
            Q3K => &[108],
            Q4K | Q5K => &[0, 2],
            Q6K => &[208],
            IQ4NL | IQ4XS | IQ2XXS | IQ2XS | IQ2S | IQ3XXS | IQ3S | IQ1S => &[0],
            _ => &[],
        }
    }

    pub(crate) fn random_matrix(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Matrix {
        let data = match ty {
            GgmlType::F32 => (0..rows * cols).flat_map(|_| rng.normal().to_le_bytes()).collect(),
            GgmlType::F16 => (0..rows * cols)
                .flat_map(|_| half::f16::from_f32(rng.normal()).to_le_bytes())
                .collect(),
            GgmlType::BF16 => (0..rows * cols)
                .flat_map(|_| half::bf16::from_f32(rng.normal()).to_le_bytes())
                .collect(),
            _ => random_blocks(rng, rows * cols / ty.block_size(), ty.type_size(), f16_offsets(ty)),
        };
        Matrix {
            ty,
            rows,
            cols,
            data: Bytes::Owned(data),
            layout: matrix::Layout::Rows,
        }
    }

    /// The matmul of each type equals, per output, the scalar dot of the weight row with the quantized token row,
    /// and is close to the f32 product of the dequantized weights with the unquantized activations.
    #[test]
    fn matmul_matches_reference_all_types() {
        use GgmlType::*;
        let mut rng = Rng(21);
        let pool = ThreadPool::new(3);
        let mut scratch = Scratch::default();
        let iquants = [IQ4NL, IQ4XS, IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S];
        for ty in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K]
            .into_iter()
            .chain(iquants)
        {
            for (rows, cols, n_tok) in [(1, 256, 1), (37, 512, 1), (70, 256, 5), (9, 768, 9)] {
                let w = random_matrix(&mut rng, ty, rows, cols);
                let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.normal()).collect();
                let mut y = vec![f32::NAN; n_tok * rows];
                matmul_with(&Kernels::scalar(), &pool, &w, &x, n_tok, &mut y, &mut scratch);
                let wf = w.to_f32();
                for t in 0..n_tok {
                    for r in 0..rows {
                        let xr = &x[t * cols..(t + 1) * cols];
                        let wr = &wf[r * cols..(r + 1) * cols];
                        let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = wr.iter().zip(xr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                        let got = y[t * rows + r] as f64;
                        // Activation quantization error is ~1/254 of each product's magnitude at most.
                        assert!(
                            (got - exact).abs() <= 0.01 * mag + 1e-6,
                            "{ty} {rows}x{cols} t{t} r{r}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    /// Every table this CPU can run, scalar first.
    fn all_tables() -> Vec<Kernels> {
        #[allow(unused_mut)]
        let mut v = vec![Kernels::scalar()];
        #[cfg(target_arch = "x86_64")]
        {
            if x86::has_avx2() {
                v.push(x86::table_avx2());
            }
            if x86::has_avx512() {
                v.push(x86::table_avx512());
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            v.push(neon::table_neon());
            if neon::has_dotprod() {
                v.push(neon::table_neon_dotprod());
            }
        }
        v
    }

    /// Whole matmuls through each SIMD table agree with the scalar table: ragged row counts (not multiples of the
    /// work chunk), one token and several (not multiples of the 4-token tile), one and many threads, the weights
    /// row-major and (where this CPU has an interleaved kernel) repacked, each table then running its own group
    /// kernels. Tables sum the scaled block sums in different orders, so an output that cancels to near zero may
    /// differ by a few f32 roundings of its terms: besides a share of the largest output, a millionth of `Σ|w·x|` is
    /// allowed.
    #[test]
    fn matmul_tables_agree() {
        use GgmlType::*;
        let mut rng = Rng(33);
        let tables = all_tables();
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            let mut scratch = Scratch::default();
            for ty in [F32, Q4_1, Q5_0, Q8_0, Q4K, Q6K, IQ4NL, IQ4XS, IQ2XXS] {
                for (rows, cols, n_tok) in [(1, 256, 1), (61, 512, 1), (130, 256, 7), (5, 1024, 70), (35, 512, 21)] {
                    let w = random_matrix(&mut rng, ty, rows, cols);
                    let mut packed = Matrix {
                        data: Bytes::Owned(w.bytes().to_vec()),
                        ..w
                    };
                    packed.repack_for_kernels();
                    let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.normal()).collect();
                    let mut want = vec![0.0; n_tok * rows];
                    matmul_with(&tables[0], &pool, &w, &x, n_tok, &mut want, &mut scratch);
                    let wf = w.to_f32();
                    let abs_dot: Vec<f32> = (0..n_tok * rows)
                        .map(|i| {
                            let (t, r) = (i / rows, i % rows);
                            let xr = &x[t * cols..(t + 1) * cols];
                            wf[r * cols..(r + 1) * cols]
                                .iter()
                                .zip(xr)
                                .map(|(a, b)| (a * b).abs())
                                .sum()
                        })
                        .collect();
                    for (ki, k) in tables.iter().enumerate() {
                        for m in [&w, &packed] {
                            if ki == 0 && m.layout == w.layout {
                                continue;
                            }
                            let mut got = vec![f32::NAN; n_tok * rows];
                            matmul_with(k, &pool, m, &x, n_tok, &mut got, &mut scratch);
                            if ki == 0 {
                                // The scalar group dot is the scalar row dot of the unpacked rows.
                                assert_eq!(got, want, "scalar {ty} {rows}x{cols}x{n_tok} repacked");
                            }
                            let mag = want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                                assert!(
                                    (a - b).abs() <= 3e-5 * mag + 1e-6 * abs_dot[i],
                                    "{} {ty} {rows}x{cols}x{n_tok} {:?} [{i}]: {a} vs {b}",
                                    k.isa,
                                    m.layout
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fused gate/up matmul gives the bits of two matmuls and the activation, with every table, in both
    /// layouts (row-major and, where the CPU has it, the 16-row interleave), for ragged row counts, one token and
    /// many; gate and up of different types take the unfused path and agree too.
    #[test]
    fn matmul_glu_matches_two_matmuls() {
        use GgmlType::*;
        let mut rng = Rng(45);
        let pool = ThreadPool::new(2);
        let mut scratch = Scratch::default();
        for k in all_tables() {
            for ty in [F32, F16, Q4_1, Q5_0, Q8_0, Q4K, Q6K] {
                for (rows, cols, n_tok) in [(37, 256, 1), (64, 512, 1), (130, 256, 7), (48, 512, 70)] {
                    for (glu, repack) in [(Glu::Silu, false), (Glu::Gelu, false), (Glu::Silu, true)] {
                        let mut gate = random_matrix(&mut rng, ty, rows, cols);
                        let mut up = random_matrix(&mut rng, ty, rows, cols);
                        if repack {
                            gate.repack_for_kernels();
                            up.repack_for_kernels();
                        }
                        let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.normal()).collect();
                        let mut want = vec![0.0; n_tok * rows];
                        let mut u = vec![0.0; n_tok * rows];
                        matmul_with(&k, &pool, &gate, &x, n_tok, &mut want, &mut scratch);
                        matmul_with(&k, &pool, &up, &x, n_tok, &mut u, &mut scratch);
                        glu.apply(&mut want, &u);
                        let mut got = vec![f32::NAN; n_tok * rows];
                        matmul_glu_with(&k, &pool, &gate, &up, glu, &x, n_tok, &mut got, &mut scratch);
                        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{} {ty} {rows}x{cols}x{n_tok} {glu:?} repack {repack}", k.isa);
                    }
                }
            }
            // Mixed storage: a Q4_K gate with a Q6_K up.
            let (gate, up) = (
                random_matrix(&mut rng, Q4K, 40, 256),
                random_matrix(&mut rng, Q6K, 40, 256),
            );
            let x: Vec<f32> = (0..3 * 256).map(|_| rng.normal()).collect();
            let (mut want, mut u, mut got) = (vec![0.0; 120], vec![0.0; 120], vec![f32::NAN; 120]);
            matmul_with(&k, &pool, &gate, &x, 3, &mut want, &mut scratch);
            matmul_with(&k, &pool, &up, &x, 3, &mut u, &mut scratch);
            Glu::Silu.apply(&mut want, &u);
            matmul_glu_with(&k, &pool, &gate, &up, Glu::Silu, &x, 3, &mut got, &mut scratch);
            assert_eq!(got, want, "{} mixed types", k.isa);
        }
    }

    #[test]
    fn scratch_does_not_regrow() {
        let mut rng = Rng(1);
        let pool = ThreadPool::new(2);
        let mut scratch = Scratch::default();
        let w = random_matrix(&mut rng, GgmlType::Q4_1, 64, 576);
        let x: Vec<f32> = (0..4 * 576).map(|_| rng.normal()).collect();
        let mut y = vec![0.0; 4 * 64];
        matmul(&pool, &w, &x, 4, &mut y, &mut scratch);
        let p = scratch.xq.as_ptr();
        for n in [1, 2, 4] {
            matmul(&pool, &w, &x, n, &mut y, &mut scratch);
        }
        assert_eq!(p, scratch.xq.as_ptr());
    }

    /// Compares Baton's dequantization with gguf-py's on real model tensors and synthetic blocks of every type.
    /// Run `python3 src/kernels/testdata/dequant_ref.py MODEL.gguf DIR` first, then
    /// `BATON_DEQ_REF=DIR BATON_DEQ_MODEL=MODEL.gguf cargo test --release -- --ignored real_model_dequant`.
    #[test]
    #[ignore]
    fn real_model_dequant_matches_gguf_py() {
        use crate::gguf::GgufFile;
        use std::path::Path;
        let dir = std::env::var("BATON_DEQ_REF").expect("BATON_DEQ_REF");
        let model = std::env::var("BATON_DEQ_MODEL").expect("BATON_DEQ_MODEL");
        let read_f32 = |p: &Path| -> Vec<f32> {
            std::fs::read(p)
                .unwrap()
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let check = |what: &str, ty: GgmlType, got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len(), "{what}");
            let bad = got.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            let maxd = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            println!(
                "{what} {ty}: {} values, {bad} not bit-identical, max |diff| {maxd:e}",
                got.len()
            );
            assert!(maxd <= 1e-6 * want.iter().fold(0.0f32, |a, v| a.max(v.abs())), "{what}");
        };
        let g = GgufFile::open(Path::new(&model)).unwrap();
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let Some(name) = p.file_name().unwrap().to_str().unwrap().strip_suffix(".f32") else {
                continue;
            };
            let info = g.tensor_info(name).unwrap();
            let want = read_f32(&p);
            let (ty, cols) = (info.ty, info.ne0());
            let rb = ty.row_bytes(cols).unwrap();
            let data = g.tensor_data(info);
            let mut got = vec![0.0; want.len()];
            for (r, out) in got.chunks_mut(cols).enumerate() {
                dequantize_row(ty, &data[r * rb..(r + 1) * rb], out);
            }
            check(name, ty, &got, &want);
            n += 1;
        }
        let syn = Path::new(&dir).join("synthetic");
        for e in std::fs::read_dir(&syn).unwrap() {
            let p = e.unwrap().path();
            let Some(name) = p.file_name().unwrap().to_str().unwrap().strip_suffix(".bin") else {
                continue;
            };
            let ty = [
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q5_0,
                GgmlType::Q5_1,
                GgmlType::Q8_0,
                GgmlType::Q2K,
                GgmlType::Q3K,
                GgmlType::Q4K,
                GgmlType::Q5K,
                GgmlType::Q6K,
            ]
            .into_iter()
            .find(|t| t.name() == name)
            .unwrap();
            let bytes = std::fs::read(&p).unwrap();
            let want = read_f32(&syn.join(format!("{name}.f32")));
            let mut got = vec![0.0; want.len()];
            dequantize_row(ty, &bytes, &mut got);
            check(&format!("synthetic {name}"), ty, &got, &want);
            n += 1;
        }
        assert!(n > 10);
    }
}
