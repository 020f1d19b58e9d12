//! Quantized mat-vec (decode, one token) and mat-mul (prefill, a batch of tokens), and the fused gate/up
//! projection of the gated feed-forward (`shaders/matmul.wgsl` over `shaders/quant.wgsl`).
//!
//! The weights stay in their GGUF blocks; activations stay f32 (the CPU kernels quantize them to 8 bits first, so
//! the GPU's sums are the closer of the two to the exact product). Three kernels: `matvec` (`matmul.wgsl`) dots
//! each 32-weight unit straight from its block with one token's activations (`dot.wgsl`: decode); `matmul` there
//! dequantizes a unit once into registers and dots it with up to 8 tokens (small batches); `matmul_tiled.wgsl`
//! dequantizes a tile of rows into workgroup memory and reuses it across 64 tokens (prefill); [`TILED_MIN`] picks
//! (on a software adapter [`TILED_MIN_SOFTWARE`]). Where the adapter has matrix units, the tiled matmuls take
//! `matmul_coop.wgsl` instead (coop.rs).

use super::buffers::{GpuExperts, GpuMatrix, Tensor, UNIT};
use super::device::grid;
use super::moe::Picks;
use super::{Pass, act8, env_number, module, u32_of, wgsl};
use crate::gguf::GgmlType;
use crate::kernels::Glu;
use anyhow::{Result, ensure};

/// Threads per workgroup and tokens per workgroup (`TT` in the shader).
const WG: usize = 64;
const TT: usize = 8;

/// Batches of this many tokens or more take the tiled kernel on a hardware GPU. Measured on an H200 (`cargo bench
/// --bench kernels -- --gpu`, docs/gpu.md) with the 64 × 64 tile and naga's checks all on: at 32 tokens the tiled
/// kernel was faster on Llama 3 8B's wide matrices (ffn_up, the head; 2.6–3.3×) and slower on the narrow ones
/// (attn_v, ffn_down, attn_q; 1.1–4.8×), at 64 faster on 8 of 9; dropping loop bounding speeds the tiled kernel
/// about 1.6× and the per-row one little, which moves the crossover down, not measured yet.
pub(super) const TILED_MIN: usize = 32;

/// The same on a software adapter, where from 9 tokens on the per-row kernel would dequantize every weight once
/// per 8 tokens and the tiled one once per 32 (and both take the same time on lavapipe; the tests run both).
pub(super) const TILED_MIN_SOFTWARE: usize = TT + 1;

/// The tiled kernel's tile: weight rows of the plain matmul, of each matrix of the fused gate/up one, and tokens
/// (`matmul_tiled.wgsl`).
const TILE_ROWS: usize = 64;
const TILE_ROWS_GLU: usize = 32;
const TILE_TOKENS: usize = 64;

/// `BATON_GPU_PROBE`, a measuring aid for the tiled kernel (docs/gpu.md): 0 (default) the whole kernel; 1 without
/// dequantizing the weights, 2 with one column's products of each unit instead of 32, 3 without loading the
/// activations. Every value but 0 gives wrong sums; `cargo bench --bench kernels -- --gpu` times each part so.
/// Read once: a prefill calls it for every matmul.
fn tiled_probe() -> u32 {
    static PROBE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *PROBE.get_or_init(|| env_number("BATON_GPU_PROBE", |&v| v <= 3, 0))
}

/// Workgroups a plain tiled matmul should have at least on a GPU: below, it splits its columns into slices, each a
/// workgroup of its own (up to 16, at least a unit each), and adds their partial products in a second dispatch.
/// `BATON_GPU_KSPLIT` sets it (0: never split), to compare; else 1024. Read once.
pub(super) fn ksplit_target() -> usize {
    static TARGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *TARGET.get_or_init(|| env_number("BATON_GPU_KSPLIT", |_| true, 1024))
}

/// Slices of the columns a tiled matmul of `tiles` workgroups over `units` 32-weight units takes to reach `target`
/// workgroups: 1 (no split) where it has enough, or too few units to share.
fn k_slices(tiles: usize, units: usize, target: usize) -> usize {
    if target == 0 || tiles >= target {
        return 1;
    }
    target.div_ceil(tiles).min(16).min(units).max(1)
}

/// Whether a decode step folds its RMSNorms into the mat-vecs after them and its residual adds into those before
/// (`Pass::folds`): `BATON_GPU_FOLD=0` keeps them dispatches of their own (`add_rms_norm`), to compare; else on.
/// Each saves a dispatch, and costs each workgroup of a mat-vec that folds a norm the row's sum of squares (a
/// read of the residual row); the dot products read one activation each as before. Read once.
pub(super) fn fold_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_number("BATON_GPU_FOLD", |v| *v <= 1, 1) == 1)
}

/// Threads a weight row in the per-row matmuls: `BATON_GPU_LANES` (16, 32 or 64) where set, to compare them on a
/// model, or to run a GPU's layout on a software adapter and check it end to end; else 32 on a GPU (on an H200 the
/// 1B's decode ran at 237, 294 and 293 tokens/s with 16, 32 and 64) and 1 on a software adapter (llvmpipe runs
/// barriers in software, and a row's work costs less than one). Read once.
pub(super) fn lanes(software: bool) -> u32 {
    static SET: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    match *SET.get_or_init(|| env_number("BATON_GPU_LANES", |v| [16, 32, 64].contains(v), 0)) {
        0 if software => 1,
        0 => 32,
        set => set,
    }
}

/// Rows each thread of a decode mat-vec takes on a GPU, dotting each block's activations, loaded once, with all of
/// them (`MROWS` in `matmul.wgsl`, the types with a part walk): `BATON_GPU_MV_ROWS` (1, 2 or 4) to compare, else 2,
/// as llama.cpp's Vulkan mat-vecs take 2 rows of these types on NVIDIA. Read once.
pub(super) fn gpu_mv_rows() -> u32 {
    static ROWS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| env_number("BATON_GPU_MV_ROWS", |v| [1, 2, 4].contains(v), 2))
}

/// The name of `ty`'s dequantizer in `quant.wgsl`.
pub(super) fn wgsl_type(ty: GgmlType) -> &'static str {
    use GgmlType::*;
    match ty {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q4K => "q4_k",
        Q5K => "q5_k",
        Q6K => "q6_k",
        Q2K => "q2_k",
        Q3K => "q3_k",
        IQ4NL => "iq4_nl",
        IQ4XS => "iq4_xs",
        IQ2XXS => "iq2_xxs",
        IQ2XS => "iq2_xs",
        IQ2S => "iq2_s",
        IQ3XXS => "iq3_xxs",
        IQ3S => "iq3_s",
        IQ1S => "iq1_s",
        // Activation types only: `upload_matrix` refuses them.
        Q8_1 | Q8K => "unsupported",
    }
}

/// The grid i-quants' codebooks (`kernels::iquants`) as one table of u32 words (an 8-byte entry is two, low word
/// first), and where each begins: `GRID_<NAME>` in WGSL.
fn grid_tables() -> (Vec<u32>, Vec<(&'static str, usize)>) {
    use crate::kernels::iquants::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
    let wide = |t: &[u64]| -> Vec<u32> { t.iter().flat_map(|&e| [e as u32, (e >> 32) as u32]).collect() };
    let tables = [
        ("IQ2XXS", wide(&IQ2XXS_GRID)),
        ("IQ2XS", wide(&IQ2XS_GRID)),
        ("IQ2S", wide(&IQ2S_GRID)),
        ("IQ3XXS", IQ3XXS_GRID.to_vec()),
        ("IQ3S", IQ3S_GRID.to_vec()),
        ("IQ1S", wide(&IQ1S_GRID)),
    ];
    let (mut words, mut offsets) = (Vec::new(), Vec::new());
    for (name, t) in tables {
        offsets.push((name, words.len()));
        words.extend(t);
    }
    (words, offsets)
}

/// Whether `ty`'s dequantizer reads the codebooks (binding 5 of the matmuls).
fn uses_grid(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, IQ2XXS | IQ2XS | IQ2S | IQ3XXS | IQ3S | IQ1S)
}

impl super::Gpu {
    /// The codebooks on this device, uploaded once (34 KiB).
    fn grid_buffer(&self) -> Result<&wgpu::Buffer> {
        if let Some(b) = self.iq_grid.get() {
            return Ok(b);
        }
        let t = self.upload_u32(&grid_tables().0)?;
        Ok(self.iq_grid.get_or_init(|| t.buf))
    }
}

impl<'g> Pass<'g> {
    /// The codebooks at binding 5, for a module over weights of type `ty` that reads them; none for the others
    /// (a binding the entry point does not use is not in its layout).
    pub(super) fn grid_binding(&self, ty: GgmlType) -> Result<Option<(u32, &'g wgpu::Buffer)>> {
        if !uses_grid(ty) {
            return Ok(None);
        }
        Ok(Some((5, self.gpu().grid_buffer()?)))
    }
}

/// `quant.wgsl` with only `ty`'s dequantizer (and the shared readers): a driver then compiles one type, not eleven.
fn quant_of(ty: GgmlType) -> String {
    let own = format!("fn dq_{}_$F(", wgsl_type(ty));
    wgsl::QUANT
        .split("\n\n")
        .filter(|item| !item.contains("fn dq_") || item.contains(&own) || item.contains("fn dequant_"))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// `ty`'s dequantizer instantiated for each weight buffer (name, suffix) of a module, after the codebooks' offsets
/// (`GRID_*`). The module declares the buffers, and `iq_grid` at binding 5 ([`Pass::grid_binding`]).
pub(super) fn dequantizers(ty: GgmlType, bufs: &[(&str, &str)]) -> String {
    let grid: String = grid_tables()
        .1
        .iter()
        .map(|(name, at)| format!("const GRID_{name}: u32 = {at}u;\n"))
        .collect();
    grid + &per_buffer(&quant_of(ty).replace("$T", wgsl_type(ty)), bufs)
}

/// A template of `quant.wgsl` or `dot.wgsl` once per weight buffer of a module: `$W` its name, `$F` its suffix.
fn per_buffer(text: &str, bufs: &[(&str, &str)]) -> String {
    bufs.iter()
        .map(|(buf, suffix)| text.replace("$W", buf).replace("$F", suffix) + "\n")
        .collect()
}

/// Whether `dot.wgsl` has a dot product straight from `ty`'s blocks (the others dequantize first).
fn has_dot(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4K | Q5K | Q6K
    )
}

/// A type whose blocks `dot.wgsl` dots with several lanes each (`pdot_<type>`): the lanes a block takes
/// (`PARTS`), the block's weights and bytes, and the `acts_*` that loads a part's activations.
struct Parts {
    parts: u32,
    block_w: u32,
    block_bytes: u32,
    acts: &'static str,
}

fn parts(ty: GgmlType) -> Option<Parts> {
    use GgmlType::*;
    let (parts, block_w, block_bytes, acts) = match ty {
        Q4K => (16, 256, 144, "k4"),
        Q5K => (16, 256, 176, "k4"),
        Q6K => (16, 256, 210, "q6_k"),
        Q8_0 => (4, 32, 34, "b32"),
        Q4_0 => (4, 32, 18, "b32"),
        Q4_1 => (4, 32, 20, "b32"),
        Q5_0 => (4, 32, 22, "b32"),
        Q5_1 => (4, 32, 24, "b32"),
        _ => return None,
    };
    Some(Parts {
        parts,
        block_w,
        block_bytes,
        acts,
    })
}

/// `dot.wgsl` for weights of type `ty`: the shared helpers, `ty`'s own dot product only (`dot_dq` for a type
/// without one) and unit walk, instantiated for each weight buffer as [`dequantizers`] is; for a type with a part
/// dot ([`parts`]) its part dots and the rows' part walk, which `rows_dot` takes where there are lanes enough.
/// Items that name no buffer (`$F`) are written once.
fn dots(ty: GgmlType, bufs: &[(&str, &str)]) -> String {
    let own = own_name(ty);
    let decl = format!("fn dot_{own}_$F(");
    let pdecl = format!("fn pdot_{}_$F(", wgsl_type(ty));
    let blocks = parts(ty);
    let (mut each, mut once) = (Vec::new(), Vec::new());
    for item in wgsl::DOT.split("\n\n") {
        let keep = if item.contains("fn dot_") {
            item.contains(&decl) || item.contains("fn dot_$F(")
        } else if item.contains("fn pdot_") {
            blocks.is_some() && item.contains(&pdecl)
        } else if item.contains("Acts") || item.contains("fn rows_dot_parts(") {
            // The part walk's activations, and what takes them.
            blocks.is_some()
        } else {
            true
        };
        if keep {
            if item.contains("$F") { &mut each } else { &mut once }.push(item);
        }
    }
    // The part walk's constants, and rows_dot taking it where the row's lanes are enough for a block.
    let (consts, parts_first) = match &blocks {
        Some(b) => (
            format!(
                "const PARTS: u32 = {}u;\nconst BLOCK_W: u32 = {}u;\nconst BLOCK_BYTES: u32 = {}u;\n",
                b.parts, b.block_w, b.block_bytes
            ),
            "if (LANES >= PARTS && (p.cols % BLOCK_W) == 0u) {
        return rows_dot_parts(rb, xr, lane, nr, both);
    }
    ",
        ),
        None => (String::new(), ""),
    };
    let acts = blocks.as_ref().map_or("", |b| b.acts);
    let once = once.join("\n\n").replace("$A", acts).replace("$P", wgsl_type(ty));
    let rows_dot = format!(
        "fn rows_dot(rb: u32, xr: u32, lane: u32, nr: u32, both: bool) -> mat2x4<f32> {{
    {parts_first}return rows_dot_units(rb, xr, lane, nr, both);
}}
"
    );
    let text = each.join("\n\n").replace("$D", own).replace("$P", wgsl_type(ty));
    consts + &per_buffer(&text, bufs) + "\n" + &once + "\n" + &rows_dot
}

/// The name `dot_$F` calls for `ty`: its own dot product or the dequantizing one.
fn own_name(ty: GgmlType) -> &'static str {
    if has_dot(ty) { wgsl_type(ty) } else { "dq" }
}

/// The matmul module (`kernel`: per-row, tiled or matrix-unit) for weights of type `ty`: the dequantizer
/// instantiated for both weight buffers, and for the per-row kernel the dot products.
pub(super) fn source(ty: GgmlType, kernel: &str) -> String {
    let weights = [("wa", "a"), ("wb", "b")];
    // The per-row kernels' dot products, and the reductions of the mat-vecs' folded norm.
    let (dot, reduce) = if kernel == wgsl::MATMUL {
        (dots(ty, &weights), wgsl::REDUCE)
    } else {
        (String::new(), "")
    };
    module(&[
        wgsl::F16,
        wgsl::ACT,
        wgsl::MATMUL_IO,
        &dequantizers(ty, &weights),
        &dot,
        kernel,
        reduce,
    ])
}

/// Which tokens the tiled kernels' tiles take (`tiled_span.wgsl`): a batch's in order (`tiled_batch.wgsl`), or a
/// mixture's picks grouped by expert (`tiled_picks.wgsl`).
#[derive(Clone, Copy)]
pub(super) enum Rows {
    Batch,
    Picks,
}

impl Rows {
    /// The pipeline key's mark of a module over these rows.
    pub(super) fn key(self) -> &'static str {
        match self {
            Rows::Batch => "",
            Rows::Picks => "_picks",
        }
    }
}

/// A tiled kernel's module (`matmul_tiled.wgsl`, or the matrix units' `matmul_coop.wgsl`) for weights of type
/// `ty`, over `rows`.
pub(super) fn tiled_source(ty: GgmlType, kernel: &str, rows: Rows) -> String {
    let rows = match rows {
        Rows::Batch => wgsl::TILED_BATCH,
        Rows::Picks => wgsl::TILED_PICKS,
    };
    source(ty, &module(&[kernel, wgsl::TILED_SPAN, rows]))
}

/// The activation's code in `act.wgsl`.
pub(super) fn act_code(glu: Glu) -> u32 {
    match glu {
        Glu::Silu => 0,
        Glu::Gelu => 1,
    }
}

/// A matmul's input as its kernel reads it: f32 rows (a batch's rounded as the CPU's, act8.rs) and, for the
/// matrix-unit kernel, their halves (coop.rs).
#[derive(Clone)]
struct Input {
    x: Tensor,
    halves: Option<Tensor>,
}

/// The last input made in an op, by the activation grid it was rounded to (`None`: not rounded), which a matmul of
/// the same grid takes again.
type Memo = Option<(Option<GgmlType>, Input)>;

/// The RMSNorm a decode step's mat-vec folds in: `res`, the residual stream whose row's 1 / rms scales the
/// products, and its epsilon. The mat-vec's input is that row times the norm's weights, which the mat-vec before
/// wrote ([`Pass::matvec_add`] with them): so the norm is not a dispatch of its own, and the dot products read one
/// activation each as before.
#[derive(Clone, Copy)]
pub struct Norm<'a> {
    pub res: &'a Tensor,
    pub eps: f32,
}

/// What a mat-vec does around its dot products (`FUSE` in `matmul.wgsl`).
#[derive(Clone, Copy)]
enum Fuse<'a> {
    None,
    /// The products scaled by the row's 1 / rms.
    Norm(Norm<'a>),
    /// The products added into the output (the residual stream) rather than written, and with `Some((w, out))`
    /// the new residual times `w` written into `out`.
    Add(Option<(&'a Tensor, &'a Tensor)>),
}

impl Fuse<'_> {
    fn code(self) -> u32 {
        match self {
            Fuse::None => 0,
            Fuse::Norm(_) => 1,
            Fuse::Add(None) => 2,
            Fuse::Add(Some(_)) => 3,
        }
    }

    /// The pipeline's name suffix, which the profile shows.
    fn suffix(self) -> &'static str {
        ["", "+norm", "+add", "+add+weigh"][self.code() as usize]
    }
}

impl Pass<'_> {
    /// `y[t] = W · x[t]` for the `n` rows of `x` (`[n, w.cols]`) into `y` (`[n, w.rows]`).
    pub fn matmul(&mut self, w: &GpuMatrix, x: &Tensor, n: usize, y: &Tensor) -> Result<()> {
        self.matmuls_at([(w, 0)], x, n, y, w.rows)
    }

    /// Matmuls of several matrices over one input, each `(matrix, at)` into columns `at..at + rows` of `y`, whose
    /// rows are `stride` values: a layer's stacked Q, K and V projections write one row of the three side by side.
    /// The input is rounded once per activation grid, not once per matrix (a Q/K stack of Q4_K and a V of Q6_K
    /// share Q8_K).
    pub fn matmuls_at<'w>(
        &mut self,
        ws: impl IntoIterator<Item = (&'w GpuMatrix, usize)>,
        x: &Tensor,
        n: usize,
        y: &Tensor,
        stride: usize,
    ) -> Result<()> {
        let mut memo = None;
        for (w, at) in ws {
            self.check_mm(w, x, n, y, (at, stride))?;
            let xr = self.input_for(w, x, n, &mut memo)?;
            self.mm(w, None, Glu::Silu, &xr, n, y, (at, stride), Fuse::None)?;
        }
        Ok(())
    }

    /// Whether a forward of `n` rows folds its norms and residual adds into its mat-vecs: one row (a decode step)
    /// that takes the mat-vec kernel, which can fold in the RMSNorm before it ([`Pass::matvecs_normed_at`],
    /// [`Pass::matvec_glu_normed`]) and the residual add after it ([`Pass::matvec_add`]), unless
    /// `BATON_GPU_FOLD=0` ([`fold_on`]).
    pub fn folds(&self, n: usize) -> bool {
        fold_on() && n == 1 && n < self.tiled_min
    }

    /// [`Pass::matmuls_at`] of one row (a decode step) RMS-normalised on the way in: `xw` is the residual stream
    /// `norm.res` times the norm's weights, and each matrix's mat-vec takes the row's 1 / rms itself, so the norm
    /// is not a dispatch of its own.
    pub fn matvecs_normed_at<'w>(
        &mut self,
        ws: impl IntoIterator<Item = (&'w GpuMatrix, usize)>,
        xw: &Tensor,
        norm: Norm,
        y: &Tensor,
        stride: usize,
    ) -> Result<()> {
        for (w, at) in ws {
            self.check_fold(w, Some(norm.res))?;
            self.check_mm(w, xw, 1, y, (at, stride))?;
            let input = self.input_for(w, xw, 1, &mut None)?;
            self.mm(w, None, Glu::Silu, &input, 1, y, (at, stride), Fuse::Norm(norm))?;
        }
        Ok(())
    }

    /// `res += W · x` for one row (a decode step): the residual add after a mat-vec in the mat-vec itself; with
    /// `weigh = Some((w, xw))`, also `xw = res · w`, the input of a mat-vec that folds the norm of weights `w`
    /// ([`Pass::matvecs_normed_at`]).
    pub fn matvec_add(
        &mut self,
        w: &GpuMatrix,
        x: &Tensor,
        res: &Tensor,
        weigh: Option<(&Tensor, &Tensor)>,
    ) -> Result<()> {
        self.check_fold(w, None)?;
        self.check_mm(w, x, 1, res, (0, w.rows))?;
        if let Some((nw, xw)) = weigh {
            ensure!(
                nw.len() == w.rows && xw.len() >= w.rows,
                "a mat-vec of {} rows weighing by a norm of {} into {}",
                w.rows,
                nw.len(),
                xw.len()
            );
        }
        let input = self.input_for(w, x, 1, &mut None)?;
        self.mm(w, None, Glu::Silu, &input, 1, res, (0, w.rows), Fuse::Add(weigh))
    }

    /// [`Pass::matmul_glu`] of one row RMS-normalised on the way in, as [`Pass::matvecs_normed_at`].
    pub fn matvec_glu_normed(
        &mut self,
        gate: &GpuMatrix,
        up: &GpuMatrix,
        glu: Glu,
        xw: &Tensor,
        norm: Norm,
        h: &Tensor,
    ) -> Result<()> {
        self.check_fold(gate, Some(norm.res))?;
        self.glu_pair(gate, up, glu, xw, 1, h, Fuse::Norm(norm))
    }

    /// A folding mat-vec is one row on the mat-vec kernel; a folded norm's residual row spans the matrix's columns.
    fn check_fold(&self, w: &GpuMatrix, res: Option<&Tensor>) -> Result<()> {
        ensure!(
            1 < self.tiled_min,
            "a folded mat-vec on a pass whose one-row matmuls are tiled"
        );
        if let Some(res) = res {
            ensure!(
                res.len() >= w.cols,
                "a mat-vec over {} columns folding the norm of a residual of {}",
                w.cols,
                res.len()
            );
        }
        Ok(())
    }

    /// `h[t] = act(gate · x[t]) * (up · x[t])`, `h` `[n, gate.rows]`: one pass over both matrices where they are
    /// of one type (and split alike), else two matmuls and the activation.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_glu(
        &mut self,
        gate: &GpuMatrix,
        up: &GpuMatrix,
        glu: Glu,
        x: &Tensor,
        n: usize,
        h: &Tensor,
    ) -> Result<()> {
        self.glu_pair(gate, up, glu, x, n, h, Fuse::None)
    }

    /// [`Pass::matmul_glu`], its mat-vecs folding `fuse` (a one-row pass's input is `x` as it is).
    #[allow(clippy::too_many_arguments)]
    fn glu_pair(
        &mut self,
        gate: &GpuMatrix,
        up: &GpuMatrix,
        glu: Glu,
        x: &Tensor,
        n: usize,
        h: &Tensor,
        fuse: Fuse,
    ) -> Result<()> {
        ensure!(
            (gate.rows, gate.cols) == (up.rows, up.cols),
            "gate {}×{} and up {}×{} projections differ in shape",
            gate.rows,
            gate.cols,
            up.rows,
            up.cols
        );
        let out = (0, gate.rows);
        self.check_mm(gate, x, n, h, out)?;
        if gate.ty == up.ty && same_parts(gate, up) {
            let x = self.input_for(gate, x, n, &mut None)?;
            return self.mm(gate, Some(up), glu, &x, n, h, out, fuse);
        }
        let u = self.scratch(n * up.rows)?;
        let mut memo = None;
        let xg = self.input_for(gate, x, n, &mut memo)?;
        self.mm(gate, None, glu, &xg, n, h, out, fuse)?;
        let xu = self.input_for(up, x, n, &mut memo)?;
        self.mm(up, None, glu, &xu, n, &u, out, fuse)?;
        self.glu_mul(h, &u, glu, n * up.rows)
    }

    fn check_mm(&self, w: &GpuMatrix, x: &Tensor, n: usize, y: &Tensor, (at, stride): (usize, usize)) -> Result<()> {
        ensure!(n > 0, "a matmul over no rows");
        ensure!(
            at + w.rows <= stride,
            "a matmul's {} outputs from column {at} overrun rows of {stride}",
            w.rows
        );
        ensure!(
            x.len() >= n * w.cols,
            "matmul input holds {} values, {n} rows of {} need {}",
            x.len(),
            w.cols,
            n * w.cols
        );
        ensure!(
            y.len() >= n * stride,
            "matmul output holds {} values, {n} rows of {stride} need {}",
            y.len(),
            n * stride
        );
        Ok(())
    }

    /// What a matmul of `w` over `n` rows of `x` reads: a batch rounded as the CPU's (act8.rs), a decode step's
    /// row as it is, and the halves of either where the matrix-unit kernel takes the batch (coop.rs). `memo` holds
    /// the last input made from `x` in this op, which a matmul of the same activation grid takes again (Q4_K_M's
    /// Q4_K and Q6_K both round to Q8_K) instead of dispatches of its own.
    fn input_for(&mut self, w: &GpuMatrix, x: &Tensor, n: usize, memo: &mut Memo) -> Result<Input> {
        let act = act8::act_type(w.ty).filter(|_| n > 1);
        let mut input = match memo.take() {
            Some((done, input)) if done == act => input,
            _ => Input {
                x: self.rounded_for(w, x, n)?,
                halves: None,
            },
        };
        if input.halves.is_none() && self.takes_coop(w, n) {
            input.halves = Some(self.halves(&input.x, n, w.cols)?);
        }
        *memo = Some((act, input.clone()));
        Ok(input)
    }

    /// The `n` rows of `x` as a matmul of `w` reads them in f32: a batch rounded as the CPU's (act8.rs), a decode
    /// step's row as it is.
    fn rounded_for(&mut self, w: &GpuMatrix, x: &Tensor, n: usize) -> Result<Tensor> {
        match act8::act_type(w.ty).filter(|_| n > 1) {
            Some(act) => self.act8(act, x, n * w.cols),
            None => Ok(x.clone()),
        }
    }

    /// The matmul of `w` (with `up`, the fused GLU) over `x` as [`Pass::input_for`] gives it, outputs into columns
    /// `out.0..out.0 + w.rows` of rows of `out.1` values; `fuse` only for a mat-vec ([`Pass::folds`]).
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &mut self,
        w: &GpuMatrix,
        up: Option<&GpuMatrix>,
        glu: Glu,
        x: &Input,
        n: usize,
        y: &Tensor,
        (at, stride): (usize, usize),
        fuse: Fuse,
    ) -> Result<()> {
        let tiled = n >= self.tiled_min;
        let entry = match (up.is_some(), n == 1 && !tiled) {
            (false, true) => "matvec",
            (true, true) => "matvec_glu",
            (false, false) => "matmul",
            (true, false) => "matmul_glu",
        };
        // The kernel, its rows and tokens per workgroup, and the activations' bindings: f32 (at 2, and at 7 as
        // the kernels' vector view), or the matrix-unit kernel's halves at 7.
        // (Only a batch the tiled kernels take has halves; a pass that gave up the units no longer takes them.)
        let halves = x.halves.as_ref().filter(|_| self.takes_coop(w, n));
        let coop = halves.and_then(|h| Some((self.coop_or_off(w.ty, entry, Rows::Batch)?, h)));
        let rows = if up.is_some() { TILE_ROWS_GLU } else { TILE_ROWS };
        let (pipeline, rpw, tt, xb) = match coop {
            Some((pipeline, h)) => (pipeline, rows, TILE_TOKENS, vec![(7, &h.buf)]),
            None if tiled => (
                self.tiled_pipeline(w.ty, entry, Rows::Batch)?,
                rows,
                TILE_TOKENS,
                vec![(2, &x.x.buf), (7, &x.x.buf)],
            ),
            None => {
                let (pipeline, rpw) = self.row_pipeline(w.ty, entry, fuse)?;
                // The mat-vecs' residual or norm weights at 8 and weighed output at 9: the activations and the
                // output again where they fold nothing, unread and unwritten.
                let (aux, weighed) = match fuse {
                    Fuse::Norm(norm) => (&norm.res.buf, &y.buf),
                    Fuse::Add(Some((nw, xw))) => (&nw.buf, &xw.buf),
                    _ => (&x.x.buf, &y.buf),
                };
                let mut xb = vec![(2, &x.x.buf), (7, &x.x.buf)];
                if entry.starts_with("matvec") {
                    xb.extend([(8, aux), (9, weighed)]);
                }
                (pipeline, rpw, TT, xb)
            }
        };
        let tiles = u32_of(n.div_ceil(tt), "matmul tokens")?;
        ensure!(
            tiles <= 65535,
            "{n} tokens in one matmul is more than the GPU grid takes"
        );
        if tiled && up.is_none() && w.parts.len() == 1 {
            let units = w.cols.div_ceil(UNIT);
            let slices = k_slices(w.rows.div_ceil(rpw) * tiles as usize, units, self.ksplit_target);
            if slices > 1 && tiles as usize * slices <= 65535 {
                return self.mm_split(w, &pipeline, &xb, n, y, (at, stride), (tiles, slices));
            }
        }
        for (i, part) in w.parts.iter().enumerate() {
            let (gx, gy) = grid(u32_of(part.rows.div_ceil(rpw), "matmul rows")?);
            let mut params = mm_params(w, (at + part.row0, part.rows), n, gx, glu, stride, 0)?;
            if let Fuse::Norm(norm) = fuse {
                params[PARAM_EPS] = norm.eps.to_bits();
            }
            let mut bufs = vec![(1, &part.buf), (3, &y.buf)];
            if let Some(u) = up {
                bufs.push((4, &u.parts[i].buf));
            } else if tiled || entry == "matvec" {
                // The tiled kernels and the mat-vecs share one body with their gate/up forms, which names both
                // matrices; the plain ones never read the second.
                bufs.push((4, &part.buf));
            }
            bufs.extend(xb.iter().copied());
            bufs.extend(self.grid_binding(w.ty)?);
            self.dispatch(&pipeline, &params, &bufs, (gx, gy, tiles));
        }
        Ok(())
    }
}

impl Pass<'_> {
    /// The entry point `entry` of the per-row matmul module (`matmul.wgsl`) for weights of type `ty`, at this
    /// pass's lanes a row and subgroups, and the rows a workgroup takes: several a thread (`MROWS`) in the
    /// mat-vecs (a decode step's, and the experts' per-pick ones) of a type whose part walk the lanes take, one
    /// elsewhere.
    fn row_pipeline(
        &self,
        ty: GgmlType,
        entry: &'static str,
        fuse: Fuse,
    ) -> Result<(std::sync::Arc<wgpu::ComputePipeline>, usize)> {
        let key = format!("matmul_{}{}", wgsl_type(ty), fuse.suffix());
        let walks_parts = parts(ty).is_some_and(|b| self.lanes >= b.parts);
        let one_token = entry.starts_with("matvec") || entry.ends_with("_ids");
        let mrows = if one_token && walks_parts { self.mv_rows } else { 1 };
        let rpw = WG / self.lanes as usize * mrows as usize;
        let constants = [
            ("LANES", self.lanes as f64),
            ("MROWS", mrows as f64),
            ("RPW", rpw as f64),
            ("FUSE", fuse.code() as f64),
        ];
        let pipeline = self.reducing_pipeline(&key, entry, &constants, || source(ty, wgsl::MATMUL))?;
        Ok((pipeline, rpw))
    }

    /// The matrix-unit kernel's entry point `entry` for weights of type `ty` over `rows`, or none where the driver
    /// does not compile it: then this pass and the device leave the units for the f32 tiled kernel, for good.
    fn coop_or_off(
        &mut self,
        ty: GgmlType,
        entry: &'static str,
        rows: Rows,
    ) -> Option<std::sync::Arc<wgpu::ComputePipeline>> {
        match self.coop_pipeline(ty, entry, rows) {
            Ok(pipeline) => Some(pipeline),
            Err(e) => {
                self.gpu().stop_coop(&e);
                self.coop = 0;
                None
            }
        }
    }

    /// The entry point `entry` of the tiled matmul module for weights of type `ty`, over `rows`.
    fn tiled_pipeline(
        &self,
        ty: GgmlType,
        entry: &'static str,
        rows: Rows,
    ) -> Result<std::sync::Arc<wgpu::ComputePipeline>> {
        let key = format!("matmul_tiled{}_{}", rows.key(), wgsl_type(ty));
        let constants = [("PROBE", tiled_probe() as f64)];
        self.gpu()
            .pipeline(&key, entry, &constants, || tiled_source(ty, wgsl::MATMUL_TILED, rows))
    }

    /// A tiled (or matrix-unit) matmul of a one-part matrix with its columns in `slices`, the activations bound as
    /// `xb`: each slice's partial products into [`Pass::partials`] (`[slice, token, row]`), then the tiled module's
    /// `reduce_k` adds them into `y`.
    #[allow(clippy::too_many_arguments)]
    fn mm_split(
        &mut self,
        w: &GpuMatrix,
        pipeline: &wgpu::ComputePipeline,
        xb: &[(u32, &wgpu::Buffer)],
        n: usize,
        y: &Tensor,
        (at, stride): (usize, usize),
        (tiles, slices): (u32, usize),
    ) -> Result<()> {
        let part = &w.parts[0];
        // The partial products are laid out as the output: rows of `stride`, this matrix's from column `at`.
        let parts = self.partials(slices * n * stride)?;
        let k_split = u32_of(slices, "column slices")?;
        // Both dispatches take the matrix's parameters with the slices; only their grids differ.
        let params = |nx: u32| -> Result<[u32; 12]> {
            let mut p = mm_params(w, (at, w.rows), n, nx, Glu::Silu, stride, 0)?;
            p[PARAM_K_SPLIT] = k_split;
            Ok(p)
        };
        let (gx, gy) = grid(u32_of(w.rows.div_ceil(TILE_ROWS), "matmul rows")?);
        let mut bufs = vec![(1, &part.buf), (3, &parts.buf), (4, &part.buf)];
        bufs.extend(xb.iter().copied());
        bufs.extend(self.grid_binding(w.ty)?);
        self.dispatch(pipeline, &params(gx)?, &bufs, (gx, gy, tiles * k_split));
        let reduce = self.tiled_pipeline(w.ty, "reduce_k", Rows::Batch)?;
        let (rx, ry) = grid(u32_of((n * w.rows).div_ceil(256), "matmul outputs")?);
        self.dispatch(&reduce, &params(rx)?, &[(2, &parts.buf), (3, &y.buf)], (rx, ry, 1));
        Ok(())
    }

    /// The indexed matmuls of a mixture of experts: for each pick z of `picks`, `y[z] = W_e · x[z / x_div]` with
    /// `e = ids[z]`, read on the device (written there by [`Pass::route`]), `y` `[picks.n, w.rows]`. `x_div` is k
    /// where the picks of a row share its input (gate and up), 1 where each pick has its own (down).
    pub fn matmul_ids(&mut self, w: &GpuExperts, x: &Tensor, x_div: usize, picks: &Picks, y: &Tensor) -> Result<()> {
        self.check_ids(w, x, x_div, picks, y)?;
        let x = self.picks_input(&w.mat, x, x_div, picks, &mut None)?;
        self.mm_ids(w, None, Glu::Silu, &x, x_div, picks, y)
    }

    /// `y[z] = act(G_e · x[z / x_div]) * (U_e · x[z / x_div])`, the experts' gate and up projections: one pass over
    /// both where they are of one type (and split alike), else two indexed matmuls and the activation.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_glu_ids(
        &mut self,
        gate: &GpuExperts,
        up: &GpuExperts,
        glu: Glu,
        x: &Tensor,
        x_div: usize,
        picks: &Picks,
        y: &Tensor,
    ) -> Result<()> {
        ensure!(
            (gate.n_expert, gate.rows, gate.mat.cols) == (up.n_expert, up.rows, up.mat.cols),
            "gate and up experts differ in shape"
        );
        self.check_ids(gate, x, x_div, picks, y)?;
        if gate.mat.ty == up.mat.ty && same_parts(&gate.mat, &up.mat) {
            let x = self.picks_input(&gate.mat, x, x_div, picks, &mut None)?;
            return self.mm_ids(gate, Some(up), glu, &x, x_div, picks, y);
        }
        let u = self.scratch(picks.n * up.rows)?;
        let mut memo = None;
        let xg = self.picks_input(&gate.mat, x, x_div, picks, &mut memo)?;
        self.mm_ids(gate, None, glu, &xg, x_div, picks, y)?;
        let xu = self.picks_input(&up.mat, x, x_div, picks, &mut memo)?;
        self.mm_ids(up, None, glu, &xu, x_div, picks, &u)?;
        self.glu_mul(y, &u, glu, picks.n * up.rows)
    }

    fn check_ids(&self, w: &GpuExperts, x: &Tensor, x_div: usize, picks: &Picks, y: &Tensor) -> Result<()> {
        let n_picks = picks.n;
        ensure!(n_picks > 0 && x_div > 0, "an indexed matmul over no picks");
        ensure!(
            picks.ids.len() >= n_picks,
            "{n_picks} picks with {} expert ids",
            picks.ids.len()
        );
        ensure!(
            x.len() >= n_picks.div_ceil(x_div) * w.mat.cols,
            "indexed matmul input holds {} values, {n_picks} picks of {x_div} a row of {} need more",
            x.len(),
            w.mat.cols
        );
        ensure!(
            y.len() >= n_picks * w.rows,
            "indexed matmul output holds {} values, {n_picks} picks of {} rows need {}",
            y.len(),
            w.rows,
            n_picks * w.rows
        );
        ensure!(
            n_picks <= 65535,
            "{n_picks} expert picks in one matmul is more than the GPU grid takes"
        );
        Ok(())
    }

    /// What the indexed matmuls of `w` over `picks` read from the `picks.n / x_div` rows of `x`: for grouped picks
    /// (a batch the tiled kernels take) [`Pass::input_for`]'s, so the unfused gate and up share one rounding (and
    /// one set of halves) where their grids match; for the per-pick kernel the rows rounded, no halves.
    fn picks_input(
        &mut self,
        w: &GpuMatrix,
        x: &Tensor,
        x_div: usize,
        picks: &Picks,
        memo: &mut Memo,
    ) -> Result<Input> {
        let n_rows = picks.n / x_div.max(1);
        match picks.grouped {
            Some(_) => self.input_for(w, x, n_rows, memo),
            None => Ok(Input {
                x: self.rounded_for(w, x, n_rows)?,
                halves: None,
            }),
        }
    }

    /// One dispatch per part of the experts' buffer. Picks grouped by expert ([`Pass::picks`]) take the tiled
    /// kernel over `tiled_picks.wgsl`: a workgroup per (tile of an expert's rows, tile of up to 64 of its picks);
    /// others the per-row kernel: a workgroup per (group of an expert's rows, pick). In each part, the picks whose
    /// expert it does not hold do nothing.
    #[allow(clippy::too_many_arguments)]
    fn mm_ids(
        &mut self,
        w: &GpuExperts,
        up: Option<&GpuExperts>,
        glu: Glu,
        x: &Input,
        x_div: usize,
        picks: &Picks,
        y: &Tensor,
    ) -> Result<()> {
        let m = &w.mat;
        // As `mm`: the halves where the matrix units take the batch and their kernel compiles.
        let n_rows = picks.n / x_div.max(1);
        let (pipeline, rpw, tiles, grouped, halves) = match picks.grouped {
            Some(g) => {
                let entry = if up.is_some() { "matmul_glu" } else { "matmul" };
                let rows = if up.is_some() { TILE_ROWS_GLU } else { TILE_ROWS };
                let bufs = [(6, &g.groups.order().buf), (8, &g.groups.tiles().buf)];
                let halves = x.halves.as_ref().filter(|_| self.takes_coop(m, n_rows));
                let coop = halves.and_then(|h| Some((self.coop_or_off(m.ty, entry, Rows::Picks)?, h)));
                let (pipeline, halves) = match coop {
                    Some((pipeline, h)) => (pipeline, Some(h)),
                    None => (self.tiled_pipeline(m.ty, entry, Rows::Picks)?, None),
                };
                (pipeline, rows, g.tiles, Some(bufs), halves)
            }
            None => {
                let entry = if up.is_some() { "matmul_glu_ids" } else { "matmul_ids" };
                let (pipeline, rpw) = self.row_pipeline(m.ty, entry, Fuse::None)?;
                (pipeline, rpw, picks.n, None, None)
            }
        };
        // The activations: f32 at 2 and as vectors at 7, or the matrix units' halves at 7.
        let xb = match halves {
            Some(h) => vec![(7, &h.buf)],
            None => vec![(2, &x.x.buf), (7, &x.x.buf)],
        };
        let (gx, gy) = grid(u32_of(w.rows.div_ceil(rpw), "matmul rows")?);
        let tiles = u32_of(tiles, "expert picks")?;
        for (i, part) in m.parts.iter().enumerate() {
            let params = mm_params(m, (part.row0, part.rows), picks.n, gx, glu, w.rows, x_div)?;
            let mut bufs = vec![(1, &part.buf), (3, &y.buf)];
            bufs.extend(xb.iter().copied());
            // The plain kernels share their rows' walk with the gate/up ones, which name the second matrix.
            let second = up.map_or(&part.buf, |u| &u.mat.parts[i].buf);
            bufs.push((4, second));
            match grouped {
                Some(g) => bufs.extend(g),
                None => bufs.push((6, &picks.ids.buf)),
            }
            bufs.extend(self.grid_binding(m.ty)?);
            self.dispatch(&pipeline, &params, &bufs, (gx, gy, tiles));
        }
        Ok(())
    }
}

/// Where `k_split` sits in [`mm_params`]' words: only the split tiled matmul sets it.
const PARAM_K_SPLIT: usize = 10;

/// Where a folded norm's epsilon sits: only the mat-vecs that fold one set it.
const PARAM_EPS: usize = 11;

/// The matmul kernels' parameters (`Params` in `matmul_io.wgsl`) for the part of `w` holding rows `row0..row0 +
/// rows`, over `n` tokens (or picks), `nx` workgroups a grid row, outputs `y_stride` apart, and `x_div` picks a row
/// of the input (the indexed matmuls; 0 for the others).
fn mm_params(
    w: &GpuMatrix,
    (row0, rows): (usize, usize),
    n: usize,
    nx: u32,
    glu: Glu,
    y_stride: usize,
    x_div: usize,
) -> Result<[u32; 12]> {
    Ok([
        u32_of(rows, "rows")?,
        u32_of(w.cols, "cols")?,
        u32_of(n, "tokens")?,
        u32_of(w.row_bytes, "row bytes")?,
        u32_of(w.cols.div_ceil(UNIT), "units")?,
        nx,
        act_code(glu),
        u32_of(y_stride, "rows")?,
        u32_of(row0, "rows")?,
        u32_of(x_div, "picks a row")?,
        0,
        0,
    ])
}

/// Whether `a` and `b` are split into the same parts (so a fused gate/up pass can walk them together).
fn same_parts(a: &GpuMatrix, b: &GpuMatrix) -> bool {
    a.parts.len() == b.parts.len()
        && a.parts
            .iter()
            .zip(&b.parts)
            .all(|(p, q)| (p.row0, p.rows) == (q.row0, q.rows))
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::test_gpu;
    use crate::gguf::GgmlType::{self, *};
    use crate::kernels::tests::random_matrix;
    use crate::kernels::testutil::Rng;
    use crate::kernels::{self, Glu, Matrix, ThreadPool};

    /// The exact product (f64) of the dequantized weights with `x` (a batch's rounded as the CPU's, act8.rs), and
    /// the sum of the products' magnitudes.
    fn reference(w: &Matrix, x: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
        let wf = w.to_f32();
        let x = if n > 1 {
            super::super::act8::cpu_rounded(w.ty, &x[..n * w.cols])
        } else {
            x.to_vec()
        };
        let (mut exact, mut mag) = (Vec::new(), Vec::new());
        for t in 0..n {
            for r in 0..w.rows {
                let xr = &x[t * w.cols..(t + 1) * w.cols];
                let wr = &wf[r * w.cols..(r + 1) * w.cols];
                exact.push(wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum());
                mag.push(wr.iter().zip(xr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum());
            }
        }
        (exact, mag)
    }

    /// Tolerance against the exact product: f32 sums in another order than the reference's (32-weight units, then
    /// 16 lanes, then a tree) lose at most a few ulps of the products' magnitude per addition level; 1e-5 of it
    /// (≈ 170 ulps) is far above that yet far below any wrong weight or scale, which moves a sum by ~1e-2 of it.
    const TOL: f64 = 1e-5;

    /// Every weight type: the float types, the 32-weight blocks, the K-quants and the i-quants.
    const TYPES: [GgmlType; 21] = [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, IQ4NL, IQ4XS, IQ2XXS, IQ2XS, IQ2S,
        IQ3XXS, IQ3S, IQ1S,
    ];

    /// The kernels a test runs on one batch, as a pass would pick them (lanes, tiled from, split-K below, rows a
    /// thread of a mat-vec): the per-row kernel in the software adapter's layout (a thread per row), with fewer
    /// lanes a row than a K-quant block has parts (the unit walk; a 32-weight block's part walk), as many, and more
    /// (the block walk striding), its mat-vec taking 1, 2 and 4 rows a thread; then the tiled one whole and with
    /// its columns split (a target no test matrix reaches: as many slices as its units allow, up to 16).
    const KERNELS: [(u32, usize, usize, u32); 7] = [
        (1, usize::MAX, 0, 1),
        (4, usize::MAX, 0, 2),
        (16, usize::MAX, 0, 1),
        (16, usize::MAX, 0, 4),
        (64, usize::MAX, 0, 2),
        (16, 1, 0, 2),
        (16, 1, 1 << 20, 2),
    ];

    /// Each type's matmul equals the exact product of its dequantized weights (the CPU's scalar dequantization)
    /// within [`TOL`], for one token (mat-vec) and for batches across token tiles, through both kernels; rows not a
    /// multiple of either kernel's (4, 64), tokens not a multiple of its (8, 64) and an odd number of blocks per
    /// row put rows at every alignment the 18-, 22- and 34-byte blocks give and leave the last tiles partial. Then the
    /// CPU kernel (8-bit activations) is within its quantization error of both.
    #[test]
    fn matmul_matches_cpu_every_type() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2100);
        let pool = ThreadPool::new(2);
        let mut sc = kernels::Scratch::default();
        for ty in TYPES {
            let cols = if ty.block_size() == 256 { 768 } else { 96 };
            // (rows, tokens, rows per part): the batches in parts, as a matrix larger than one buffer is split.
            for (rows, n, part) in [(37, 1, 0), (6, 11, 2), (70, 37, 48), (131, 70, 0)] {
                let w = random_matrix(&mut rng, ty, rows, cols);
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
                let gw = match part {
                    0 => gpu.upload_matrix(&w).unwrap(),
                    _ => gpu.upload_matrix_in_parts(&w, part * w.row_bytes() + 8).unwrap(),
                };
                assert_eq!(gw.parts.len(), if part == 0 { 1 } else { rows.div_ceil(part) });
                let gx = gpu.upload(&x).unwrap();
                let mut got = Vec::new();
                for (lanes, tiled_min, split, mv_rows) in KERNELS {
                    let gy = gpu.zeros(n * rows).unwrap();
                    let mut pass = gpu
                        .pass()
                        .with_lanes(lanes)
                        .with_tiled_min(tiled_min)
                        .with_ksplit(split)
                        .with_mv_rows(mv_rows);
                    pass.matmul(&gw, &gx, n, &gy).unwrap();
                    pass.finish().unwrap();
                    got.extend(gpu.read(&gy).unwrap());
                }
                let (exact, mag) = reference(&w, &x, n);
                let mut cpu = vec![0.0; n * rows];
                kernels::matmul(&pool, &w, &x, n, &mut cpu, &mut sc);
                let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                let wf = w.to_f32();
                for (j, &g) in got.iter().enumerate() {
                    let i = j % (n * rows);
                    let (g, e) = (g as f64, exact[i]);
                    assert!(
                        (g - e).abs() <= TOL * mag[i] + 1e-6,
                        "{ty} {rows}x{cols} n {n} kernel {:?} out {i}: GPU {g} vs exact {e} (magnitude {})",
                        KERNELS[j / (n * rows)],
                        mag[i]
                    );
                    // The CPU kernel rounds each activation to 8 bits: off by at most amax/254 per weight.
                    let r = i % rows;
                    let wsum: f64 = wf[r * cols..(r + 1) * cols].iter().map(|v| v.abs() as f64).sum();
                    let bound = wsum * amax / 127.0 + TOL * mag[i] + 1e-6;
                    assert!(
                        (g - cpu[i] as f64).abs() <= bound,
                        "{ty} out {i}: GPU {g} vs CPU kernel {}",
                        cpu[i]
                    );
                }
            }
        }
    }

    /// The float types' matmuls on rows that are not a whole number of units (the last one padded, buffers.rs) or
    /// not whole vec4s: the tail takes the scalar loop, in the mat-vec (one token; and, as the picks of a mixture
    /// do, for rows of `x` past the first) and in the tiled kernel's activation loads (3 tokens). The mat-vec's
    /// lanes add up every way `lanes_sum` has.
    #[test]
    fn matvec_rows_of_any_length() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2107);
        for ty in [F32, F16, BF16] {
            for cols in [70, 100, 31] {
                let rows = 9;
                for (n, tiled_min) in [(1, usize::MAX), (3, 1)] {
                    let w = random_matrix(&mut rng, ty, rows, cols);
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
                    let (exact, mag) = reference(&w, &x, n);
                    let (gw, gx) = (gpu.upload_matrix(&w).unwrap(), gpu.upload(&x).unwrap());
                    // The lanes' sums by subgroup shuffles alone (8 lanes, lavapipe's subgroups), by shuffles and
                    // workgroup memory (16), and by workgroup memory alone.
                    for (lanes, sg) in [(1, true), (8, true), (16, true), (16, false)] {
                        let gy = gpu.zeros(n * rows).unwrap();
                        let mut pass = gpu
                            .pass()
                            .with_lanes(lanes)
                            .with_tiled_min(tiled_min)
                            .with_subgroups(sg);
                        pass.matmul(&gw, &gx, n, &gy).unwrap();
                        pass.finish().unwrap();
                        for (i, g) in gpu.read(&gy).unwrap().into_iter().enumerate() {
                            assert!(
                                (g as f64 - exact[i]).abs() <= TOL * mag[i] + 1e-6,
                                "{ty} {rows}x{cols} n {n} lanes {lanes} subgroups {sg} out {i}: GPU {g} vs exact {}",
                                exact[i]
                            );
                        }
                    }
                }
            }
        }
    }

    /// `got` is act(gate·x)·(up·x) of the exact sums `ge` and `ue` (magnitudes `gm`, `um`), each sum within `tol`
    /// of its magnitude: through an activation of slope ≤ 1.13, plus GeGLU's f16 rounding.
    pub(in crate::backend::gpu) fn assert_glu(
        got: &[f32],
        glu: Glu,
        (ge, gm): (&[f64], &[f64]),
        (ue, um): (&[f64], &[f64]),
        tol: f64,
        what: &str,
    ) {
        for (i, &g) in got.iter().enumerate() {
            let mut want = [ge[i] as f32];
            glu.apply(&mut want, &[ue[i] as f32]);
            let err = tol * (gm[i] * (ue[i].abs() + 1.0) + um[i] * (ge[i].abs() + 1.0));
            let f16 = if glu == Glu::Gelu {
                2e-3 * (ge[i].abs() + 0.2) * ue[i].abs()
            } else {
                0.0
            };
            assert!(
                (g as f64 - want[0] as f64).abs() <= 1.2 * err + f16 + 1e-6,
                "{what} out {i}: {g} vs {}",
                want[0]
            );
        }
    }

    /// The fused gate/up projection gives act(gate·x)·(up·x) for both activations, fused (one type, whole or split
    /// alike into parts; a grid i-quant, whose two dequantizers share the codebooks) and not (gate and up of different types, or split differently), through both kernels, on
    /// a small batch and one of partial tiles (45 rows: 32 + 13; 67 tokens: 64 + 3); the activations are checked
    /// on their own in `elementwise.rs`.
    #[test]
    fn matmul_glu_matches_reference() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2101);
        let cols = 256;
        // split: 0 whole, 1 both in parts of 5 rows, 2 only the gate (so not fused).
        let cases = [
            (Q8_0, Q8_0, 0),
            (Q4K, Q6K, 0),
            (Q4_0, Q4_0, 1),
            (Q4_0, Q4_0, 2),
            (Q3K, Q3K, 0),
            (IQ2S, IQ2S, 1),
        ];
        for ((tg, tu, split), (rows, n)) in cases
            .into_iter()
            .flat_map(|c| [(c, (21, 1)), (c, (21, 3)), (c, (45, 67))])
        {
            let gate = random_matrix(&mut rng, tg, rows, cols);
            let up = random_matrix(&mut rng, tu, rows, cols);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal() * 0.3).collect();
            let (ge, gm) = reference(&gate, &x, n);
            let (ue, um) = reference(&up, &x, n);
            let part = 5 * gate.row_bytes() + 8;
            let gg = match split {
                0 => gpu.upload_matrix(&gate).unwrap(),
                _ => gpu.upload_matrix_in_parts(&gate, part).unwrap(),
            };
            let gu = match split {
                1 => gpu.upload_matrix_in_parts(&up, part).unwrap(),
                _ => gpu.upload_matrix(&up).unwrap(),
            };
            let gx = gpu.upload(&x).unwrap();
            for (glu, (lanes, tiled_min, ksplit, mv_rows)) in
                [Glu::Silu, Glu::Gelu].into_iter().flat_map(|g| KERNELS.map(|k| (g, k)))
            {
                let h = gpu.zeros(n * rows).unwrap();
                let mut pass = gpu
                    .pass()
                    .with_lanes(lanes)
                    .with_tiled_min(tiled_min)
                    .with_ksplit(ksplit)
                    .with_mv_rows(mv_rows);
                pass.matmul_glu(&gg, &gu, glu, &gx, n, &h).unwrap();
                pass.finish().unwrap();
                let what = format!("{tg}/{tu} {rows}x{cols} n {n} {glu:?} kernel {lanes}/{tiled_min}/{mv_rows}");
                assert_glu(&gpu.read(&h).unwrap(), glu, (&ge, &gm), (&ue, &um), TOL, &what);
            }
        }
    }

    /// A decode step's mat-vecs with the RMSNorm before them folded in (`matvecs_normed_at`, `matvec_glu_normed`:
    /// the residual row times the norm's weights in, the row's 1 / rms taken on the device) against the exact
    /// product of the CPU's normalised row (`ops::rms_norm`), and with the residual add after them (`matvec_add`)
    /// against the residual plus the exact product, the new residual times the next norm's weights written beside
    /// it: every type, whole and in parts; a float row not a whole number of units (the scalar tail); the lanes and
    /// reductions as in `matvec_rows_of_any_length`; the gate/up fused and not. Within [`TOL`] plus the norm's f32
    /// sum of squares (2e-6 of the products); the weighed row is the new residual times its weight, exactly. A
    /// one-row pass whose matmuls are tiled refuses to fold.
    #[test]
    fn folded_norm_and_add_match_the_ops() {
        use super::Norm;
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2108);
        let eps = 1e-5;
        let tol = TOL + 2e-6;
        let widths = TYPES
            .into_iter()
            .map(|ty| (ty, if ty.block_size() == 256 { 768 } else { 96 }))
            .chain([(F32, 100), (F16, 70)]);
        for (ty, cols) in widths {
            let rows = 37;
            let w = random_matrix(&mut rng, ty, rows, cols);
            let x: Vec<f32> = (0..cols).map(|_| rng.normal() * 3.0).collect();
            let nw: Vec<f32> = (0..cols).map(|_| 1.0 + rng.normal() * 0.2).collect();
            let xw: Vec<f32> = x.iter().zip(&nw).map(|(a, b)| a * b).collect();
            let res: Vec<f32> = (0..rows).map(|_| rng.normal()).collect();
            let next: Vec<f32> = (0..rows).map(|_| 1.0 + rng.normal() * 0.2).collect();
            let mut xn = vec![0.0; cols];
            crate::kernels::ops::rms_norm(&x, &nw, eps, &mut xn);
            let (exact_n, mag_n) = reference(&w, &xn, 1);
            let (exact, mag) = reference(&w, &x, 1);
            let (gx, gxw, gnext) = (
                gpu.upload(&x).unwrap(),
                gpu.upload(&xw).unwrap(),
                gpu.upload(&next).unwrap(),
            );
            let norm = Norm { res: &gx, eps };
            // Every type at a GPU's 32 lanes and 2 rows a thread; a few (a K-quant's and a 32-weight block's part
            // walk, a scalar tail) also in parts and at the other lane counts, rows a thread and reductions (each a
            // pipeline of its own, slow to build on lavapipe).
            let all = matches!((ty, cols), (Q4K, _) | (Q4_1, _) | (F32, 100));
            let parts: &[usize] = if all { &[0, 16] } else { &[0] };
            let kernels: &[(u32, bool, u32)] = if all {
                &[(1, true, 1), (16, true, 4), (32, true, 1), (32, false, 2)]
            } else {
                &[(32, true, 2)]
            };
            for &part in parts {
                let gw = match part {
                    0 => gpu.upload_matrix(&w).unwrap(),
                    _ => gpu.upload_matrix_in_parts(&w, part * w.row_bytes() + 8).unwrap(),
                };
                for &(lanes, sg, mv_rows) in kernels {
                    let what = format!("{ty} {rows}x{cols} parts of {part} lanes {lanes}x{mv_rows} subgroups {sg}");
                    // The norm folded in, outputs from column 3 of rows of 41; the add, weighed and not.
                    let gy = gpu.zeros(rows + 4).unwrap();
                    let (gr, gr2) = (gpu.upload(&res).unwrap(), gpu.upload(&res).unwrap());
                    let weighed = gpu.zeros(rows).unwrap();
                    let mut pass = gpu.pass().with_lanes(lanes).with_subgroups(sg).with_mv_rows(mv_rows);
                    pass.matvecs_normed_at([(&gw, 3)], &gxw, norm, &gy, rows + 4).unwrap();
                    pass.matvec_add(&gw, &gx, &gr, Some((&gnext, &weighed))).unwrap();
                    pass.matvec_add(&gw, &gx, &gr2, None).unwrap();
                    pass.finish().unwrap();
                    let y = gpu.read(&gy).unwrap();
                    for (i, &g) in y[3..3 + rows].iter().enumerate() {
                        let e = exact_n[i];
                        assert!(
                            (g as f64 - e).abs() <= tol * mag_n[i] + 1e-6,
                            "{what} normed out {i}: GPU {g} vs exact {e} (magnitude {})",
                            mag_n[i]
                        );
                    }
                    assert!(
                        y[..3].iter().chain(&y[3 + rows..]).all(|&v| v == 0.0),
                        "{what}: wrote outside"
                    );
                    let (added, added2) = (gpu.read(&gr).unwrap(), gpu.read(&gr2).unwrap());
                    assert_eq!(added, added2, "{what}: the add weighed and not");
                    for (i, &g) in added.iter().enumerate() {
                        let e = res[i] as f64 + exact[i];
                        assert!(
                            (g as f64 - e).abs() <= TOL * mag[i] + 1e-6 * (1.0 + e.abs()),
                            "{what} added out {i}: GPU {g} vs exact {e}"
                        );
                    }
                    let want: Vec<f32> = added.iter().zip(&next).map(|(a, b)| a * b).collect();
                    assert_eq!(gpu.read(&weighed).unwrap(), want, "{what}: weighed");
                }
            }
        }
        // The gate/up: one type (fused) and two (two mat-vecs and the activation), for both activations.
        let cols = 256;
        for ((tg, tu), glu) in [(Q4K, Q4K), (Q4K, Q6K), (Q8_0, Q8_0)]
            .into_iter()
            .flat_map(|t| [Glu::Silu, Glu::Gelu].map(|g| (t, g)))
        {
            let rows = 21;
            let gate = random_matrix(&mut rng, tg, rows, cols);
            let up = random_matrix(&mut rng, tu, rows, cols);
            let x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
            let nw: Vec<f32> = (0..cols).map(|_| 0.3 + rng.normal() * 0.05).collect();
            let xw: Vec<f32> = x.iter().zip(&nw).map(|(a, b)| a * b).collect();
            let mut xn = vec![0.0; cols];
            crate::kernels::ops::rms_norm(&x, &nw, eps, &mut xn);
            let (ge, gm) = reference(&gate, &xn, 1);
            let (ue, um) = reference(&up, &xn, 1);
            let (gg, gu) = (gpu.upload_matrix(&gate).unwrap(), gpu.upload_matrix(&up).unwrap());
            let (gx, gxw) = (gpu.upload(&x).unwrap(), gpu.upload(&xw).unwrap());
            for (lanes, mv_rows) in [(1, 1), (32, 2), (16, 4)] {
                let h = gpu.zeros(rows).unwrap();
                let mut pass = gpu.pass().with_lanes(lanes).with_mv_rows(mv_rows);
                pass.matvec_glu_normed(&gg, &gu, glu, &gxw, Norm { res: &gx, eps }, &h)
                    .unwrap();
                pass.finish().unwrap();
                let what = format!("{tg}/{tu} normed {glu:?} lanes {lanes}x{mv_rows}");
                assert_glu(&gpu.read(&h).unwrap(), glu, (&ge, &gm), (&ue, &um), tol, &what);
            }
        }
        let gw = gpu.upload_matrix(&random_matrix(&mut rng, Q8_0, 4, 32)).unwrap();
        let (gx, gy) = (gpu.zeros(32).unwrap(), gpu.zeros(4).unwrap());
        let mut pass = gpu.pass().with_tiled_min(1);
        assert!(!pass.folds(1));
        assert!(pass.matvec_add(&gw, &gx, &gy, None).is_err());
        let mut pass = gpu.pass();
        assert!(pass.matvec_add(&gw, &gy, &gx, None).is_err(), "an input too short");
        assert!(
            pass.matvec_add(&gw, &gx, &gy, Some((&gx, &gy))).is_err(),
            "norm weights of another length"
        );
    }

    /// What the matrix-unit kernel (coop.rs) multiplies, and the exact product of it: each weight (the CPU's
    /// dequantization) rounded to f16, each activation (a batch's rounded as the CPU's first, act8.rs) scaled by
    /// its row's power of two as `halves.wgsl` does and rounded to f16; with the exact product of the unrounded
    /// ones ([`reference`]) and the products' magnitude.
    pub(in crate::backend::gpu) fn f16_reference(w: &Matrix, x: &[f32], n: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (exact, mag) = reference(w, x, n);
        let half = |v: f32| half::f16::from_f32(v).to_f32();
        let wf: Vec<f32> = w.to_f32().into_iter().map(half).collect();
        let xr = super::super::act8::cpu_rounded(w.ty, &x[..n * w.cols]);
        let mut e16 = Vec::new();
        for t in 0..n {
            let row = &xr[t * w.cols..(t + 1) * w.cols];
            let m = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let k = (((m.to_bits() >> 23) & 0xff) as i32 - 127 - 14).max(0);
            let (down, up) = (2f32.powi(-k), 2f32.powi(k));
            let xs: Vec<f32> = row.iter().map(|&v| half(v * down) * up).collect();
            for r in 0..w.rows {
                let wr = &wf[r * w.cols..(r + 1) * w.cols];
                e16.push(wr.iter().zip(&xs).map(|(a, b)| *a as f64 * *b as f64).sum());
            }
        }
        (e16, exact, mag)
    }

    /// Against the f16 products: f32 sums in another order, and a weight whose f32 dequantization on the device
    /// differs from the CPU's in the last bit may round to the neighbouring f16 (2^-11 of one product).
    pub(in crate::backend::gpu) const TOL_F16: f64 = 1e-4;
    /// Against the exact product of the unrounded values: f16's rounding of each weight and activation, 2^-11
    /// relative each.
    const TOL_HALVES: f64 = 2e-3;

    /// The matrix-unit kernel (coop.rs) for every type it takes (all but F32 and BF16): within [`TOL_F16`] of the
    /// exact product of its f16 inputs and [`TOL_HALVES`] of the unrounded one, for batches of partial tiles, in
    /// parts, with the columns split (split-K), and with a token of values past f16's range (1e6), which its row's
    /// scale brings back. Prints SKIPPED on an adapter without matrix units (scripts/test-coopmat runs it on Mesa
    /// 26's lavapipe).
    #[test]
    fn coop_matmul_matches_f16_products() {
        let Some(gpu) = super::super::coop::test_units() else {
            return;
        };
        let mut rng = Rng(2109);
        for ty in TYPES.into_iter().filter(|t| !matches!(t, F32 | BF16)) {
            let cols = if ty.block_size() == 256 { 768 } else { 96 };
            for (rows, n, part, split) in [(6, 11, 2, 0), (70, 37, 48, 0), (131, 70, 0, 0), (131, 70, 0, 1 << 20)] {
                let w = random_matrix(&mut rng, ty, rows, cols);
                let mut x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
                x[3 * cols..4 * cols].iter_mut().for_each(|v| *v *= 1e6);
                let gw = match part {
                    0 => gpu.upload_matrix(&w).unwrap(),
                    _ => gpu.upload_matrix_in_parts(&w, part * w.row_bytes() + 8).unwrap(),
                };
                let (gx, gy) = (gpu.upload(&x).unwrap(), gpu.zeros(n * rows).unwrap());
                let mut pass = gpu.pass().with_coop(true).with_tiled_min(1).with_ksplit(split);
                assert!(pass.takes_coop(&gw, n), "{ty}");
                pass.matmul(&gw, &gx, n, &gy).unwrap();
                pass.finish().unwrap();
                let got = gpu.read(&gy).unwrap();
                let (e16, exact, mag) = f16_reference(&w, &x, n);
                for (i, &g) in got.iter().enumerate() {
                    let g = g as f64;
                    assert!(
                        (g - e16[i]).abs() <= TOL_F16 * mag[i] + 1e-6
                            && (g - exact[i]).abs() <= TOL_HALVES * mag[i] + 1e-6,
                        "{ty} {rows}x{cols} n {n} part {part} split {split} out {i}: GPU {g} vs f16 {} exact {} (magnitude {})",
                        e16[i],
                        exact[i],
                        mag[i]
                    );
                }
                // Still on the units: a kernel that failed to compile would have left them for the f32 one.
                assert!(gpu.coop() > 0, "{ty}: the device gave up its matrix units");
            }
        }
    }

    /// The fused gate/up projection on the matrix units: act(gate·x)·(up·x) of the f16 products, for both
    /// activations, fused (one type) and not (gate and up of different types, each on the units), on partial
    /// tiles. SKIPPED without matrix units, as above.
    #[test]
    fn coop_matmul_glu_matches_f16_products() {
        let Some(gpu) = super::super::coop::test_units() else {
            return;
        };
        let mut rng = Rng(2110);
        let (rows, cols, n) = (45, 256, 67);
        for (tg, tu) in [(Q4K, Q4K), (Q8_0, Q8_0), (Q4K, Q6K)] {
            let gate = random_matrix(&mut rng, tg, rows, cols);
            let up = random_matrix(&mut rng, tu, rows, cols);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal() * 0.3).collect();
            let (ge, _, gm) = f16_reference(&gate, &x, n);
            let (ue, _, um) = f16_reference(&up, &x, n);
            let (gg, gu) = (gpu.upload_matrix(&gate).unwrap(), gpu.upload_matrix(&up).unwrap());
            let gx = gpu.upload(&x).unwrap();
            for glu in [Glu::Silu, Glu::Gelu] {
                let h = gpu.zeros(n * rows).unwrap();
                let mut pass = gpu.pass().with_coop(true).with_tiled_min(1);
                pass.matmul_glu(&gg, &gu, glu, &gx, n, &h).unwrap();
                pass.finish().unwrap();
                let what = format!("{tg}/{tu} {glu:?} on the matrix units");
                assert_glu(&gpu.read(&h).unwrap(), glu, (&ge, &gm), (&ue, &um), TOL_F16, &what);
                assert!(gpu.coop() > 0, "{what}: the device gave up its matrix units");
            }
        }
    }

    /// Matrices over one batch into side-by-side columns (a layer's Q/K stack and V of another type): the bits of
    /// each matrix's own matmul, with one rounding where their types share an activation grid (Q4_K and Q6_K:
    /// Q8_K) and one each where they do not (Q4_0: Q8_0).
    #[test]
    fn matmuls_at_round_once_per_grid() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2108);
        let (cols, n) = (256, 5);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let gx = gpu.upload(&x).unwrap();
        for (tys, roundings) in [([Q4K, Q6K], 1), ([Q4K, Q4_0], 2)] {
            let ws = [(tys[0], 12, 0), (tys[1], 7, 12)]
                .map(|(ty, rows, at)| (gpu.upload_matrix(&random_matrix(&mut rng, ty, rows, cols)).unwrap(), at));
            let stride = 19;
            let gy = gpu.zeros(n * stride).unwrap();
            let mut pass = gpu.pass();
            pass.matmuls_at(ws.iter().map(|(w, at)| (w, *at)), &gx, n, &gy, stride)
                .unwrap();
            assert_eq!(pass.dispatches(), ws.len() + roundings, "{tys:?}");
            pass.finish().unwrap();
            let got = gpu.read(&gy).unwrap();
            for (w, at) in &ws {
                let own = gpu.zeros(n * w.rows).unwrap();
                let mut pass = gpu.pass();
                pass.matmul(w, &gx, n, &own).unwrap();
                pass.finish().unwrap();
                let own = gpu.read(&own).unwrap();
                for t in 0..n {
                    assert_eq!(
                        &got[t * stride + at..t * stride + at + w.rows],
                        &own[t * w.rows..(t + 1) * w.rows],
                        "{tys:?} row {t} columns from {at}"
                    );
                }
            }
            // Columns past the output's rows are an error, not a write out of bounds.
            assert!(
                gpu.pass()
                    .matmuls_at(ws.iter().map(|(w, at)| (w, *at)), &gx, n, &gy, stride - 1)
                    .is_err()
            );
        }
    }

    /// A pass over cached bind groups gives the bits of one that builds its own, and a second such pass builds
    /// none: for the fused gate/up projection and the unfused one (gate and up of different types), whose
    /// intermediate is the cache's scratch tensor, through both kernels.
    #[test]
    fn cached_bind_groups_match_uncached() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2105);
        let (rows, cols) = (40, 256);
        let binds = super::super::Binds::default();
        for (tg, tu) in [(Q4K, Q4K), (Q4K, Q6K)] {
            let gate = gpu.upload_matrix(&random_matrix(&mut rng, tg, rows, cols)).unwrap();
            let up = gpu.upload_matrix(&random_matrix(&mut rng, tu, rows, cols)).unwrap();
            for n in [3, 12] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normal() * 0.3).collect();
                let (x, h) = (gpu.upload(&x).unwrap(), gpu.zeros(n * rows).unwrap());
                let mut got = Vec::new();
                for cached in [false, true, true] {
                    let mut pass = if cached { gpu.pass_cached(&binds) } else { gpu.pass() };
                    pass.matmul_glu(&gate, &up, Glu::Silu, &x, n, &h).unwrap();
                    pass.finish().unwrap();
                    let bits: Vec<u32> = gpu.read(&h).unwrap().iter().map(|v| v.to_bits()).collect();
                    got.push((bits, binds.len()));
                }
                assert!(
                    got[1].1 > 0 && got[2].1 == got[1].1,
                    "{tg}/{tu} n {n}: {} then {}",
                    got[1].1,
                    got[2].1
                );
                assert!(
                    got[0].0 == got[1].0 && got[1].0 == got[2].0,
                    "{tg}/{tu} n {n}: cached bits differ"
                );
            }
        }
    }

    /// A pass started on the device part way (`Pass::flush`) gives the same bits as one submitted whole: a chain
    /// of matmuls, each reading the one before, split after every link, and a read at the end.
    #[test]
    fn flushed_pass_matches_whole() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2402);
        let n = 64;
        let w = gpu.upload_matrix(&random_matrix(&mut rng, Q4K, n, 256)).unwrap();
        let v = gpu.upload_matrix(&random_matrix(&mut rng, Q8_0, 256, n)).unwrap();
        let x0: Vec<f32> = (0..256).map(|_| rng.normal()).collect();
        let mut got = Vec::new();
        for flush in [false, true] {
            let (x, y) = (gpu.upload(&x0).unwrap(), gpu.zeros(n).unwrap());
            let mut pass = gpu.pass();
            for _ in 0..3 {
                pass.matmul(&w, &x, 1, &y).unwrap();
                if flush {
                    pass.flush().unwrap();
                }
                pass.matmul(&v, &y, 1, &x).unwrap();
                if flush {
                    pass.flush().unwrap();
                }
            }
            pass.read(&x, 0, 256).unwrap();
            got.push(pass.finish_read().unwrap().remove(0));
        }
        assert!(got[0] == got[1], "a flushed pass differs from a whole one");
        assert!(got[0].iter().any(|&b| b != 0), "the chain computed nothing");
    }

    /// Wall time of both kernels on one prefill-shaped matmul (SmolLM2's feed-forward up, Q4_1 1536×576, 64
    /// tokens), printed: `cargo test --release --lib matmul_kernel_times -- --ignored --nocapture`. On a software
    /// adapter it times the CPU running the shaders, not a GPU.
    #[test]
    #[ignore]
    fn matmul_kernel_times() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2106);
        let (rows, cols, n) = (1536, 576, 64);
        let w = gpu.upload_matrix(&random_matrix(&mut rng, Q4_1, rows, cols)).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
        let (x, y) = (gpu.upload(&x).unwrap(), gpu.zeros(n * rows).unwrap());
        let lanes = if gpu.is_software() { 1 } else { 16 };
        for (name, tiled_min) in [("per-row", usize::MAX), ("tiled", 1)] {
            let mut best = f64::MAX;
            for _ in 0..4 {
                let t = std::time::Instant::now();
                let mut pass = gpu.pass().with_lanes(lanes).with_tiled_min(tiled_min);
                pass.matmul(&w, &x, n, &y).unwrap();
                pass.finish().unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            eprintln!("{name}: best of 4 {:.1} ms on {}", best * 1e3, gpu.describe());
        }
    }

    /// A matmul module holds its own type's dequantizer only, and the per-row one its own type's dot product (a
    /// type without one, the dequantizing dot).
    #[test]
    fn source_holds_one_type() {
        for kernel in [super::wgsl::MATMUL, super::wgsl::MATMUL_TILED] {
            let s = super::source(Q8_0, kernel);
            assert!(s.contains("fn dq_q8_0_a(") && s.contains("fn dq_q8_0_b(") && s.contains("fn dequant_a("));
            assert!(!s.contains("dq_q4_k") && !s.contains('$'));
            assert!(!s.contains("fn dot_q4_k") && !s.contains("fn dot_dq"));
            assert_eq!(s.contains("fn dot_q8_0_a("), kernel == super::wgsl::MATMUL);
        }
        let s = super::source(IQ2S, super::wgsl::MATMUL);
        assert!(s.contains("fn dot_dq_b(") && s.contains("return dot_dq_a(") && !s.contains("fn dot_q8_0"));
        assert!(!s.contains("fn rows_dot_parts(") && !s.contains("fn pdot_"));
        let s = super::source(Q6K, super::wgsl::MATMUL);
        assert!(s.contains("fn dot_q6_k_a(") && s.contains("fn q6_part_a(") && !s.contains("fn dot_dq"));
        assert!(s.contains("fn pdot_q6_k_a(") && s.contains("fn pdot_q6_k_b(") && !s.contains("fn pdot_q4_k"));
        // The walks over a thread's rows, and the activation loads, name no buffer: written once.
        for once in [
            "fn rows_dot(",
            "fn rows_dot_parts(",
            "fn rows_dot_units(",
            "fn acts_q6_k(",
            "struct Acts",
        ] {
            assert_eq!(s.matches(once).count(), 1, "{once}");
        }
        assert!(s.contains("acts_q6_k(t,") && !s.contains('$'));
    }

    /// Bad shapes and types are errors, not panics or device faults.
    #[test]
    fn matmul_rejects_bad_input() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2102);
        let w = random_matrix(&mut rng, Q8_0, 4, 64);
        let gw = gpu.upload_matrix(&w).unwrap();
        let x = gpu.zeros(64).unwrap();
        let y = gpu.zeros(4).unwrap();
        let mut pass = gpu.pass();
        assert!(pass.matmul(&gw, &x, 2, &y).is_err());
        assert!(pass.matmul(&gw, &x, 0, &y).is_err());
        pass.finish().unwrap();
        let q8k = random_matrix(&mut rng, Q8K, 2, 256);
        assert!(gpu.upload_matrix(&q8k).is_err());
    }
}
