//! Cooperative matrices ("tensor cores"): a batch's matmul on the adapter's matrix units
//! (`shaders/matmul_coop.wgsl`), where wgpu offers them (`EXPERIMENTAL_COOPERATIVE_MATRIX`: Vulkan's
//! VK_KHR_cooperative_matrix, NVIDIA's tensor cores among them, or Metal's simdgroup matrices).
//!
//! The matrix units multiply f16, so this kernel's products are not the CPU's up to the order of the sums, as the
//! f32 tiled kernel's are: each weight is dequantized to f16 and each activation (a batch's, rounded to the CPU's
//! 8-bit grid first, act8.rs) converted to f16 (`halves.wgsl`, each row scaled by a power of two that keeps it
//! inside f16's range), a relative rounding of 2^-11 on each, with f32 sums; llama.cpp's matrix-unit kernels
//! round the same way. It takes every weight type but F32 and BF16, whose values f16 may not hold.
//!
//! It is used where the adapter has the feature, f16 in shaders, subgroups of one fixed size, an S × S × S
//! configuration of f16 inputs and f32 sums (S = 16, else 8) and the workgroup memory the kernel takes, and where
//! one multiplication at load ([`probe`]) gives the exact product. `BATON_GPU_COOPMAT=0` turns it off;
//! `BATON_GPU_COOPMAT=1` turns it on for a software adapter too (Mesa's lavapipe has 8 × 8 from Mesa 26), which
//! the tests do: `scripts/test-coopmat` runs them on Mesa 26's lavapipe.

use super::buffers::{GpuMatrix, Tensor, UNIT};
use super::device::grid;
use super::matmul::{Rows, tiled_source};
use super::{Gpu, Pass, module, u32_of, wgsl};
use crate::gguf::GgmlType;
use anyhow::{Result, ensure};
use std::sync::Arc;

/// The features the kernel needs (subgroups are asked for apart, subgroup.rs).
pub(super) const FEATURES: wgpu::Features =
    wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX.union(wgpu::Features::SHADER_F16);

/// `BATON_GPU_COOPMAT`: `Some(false)` for 0, `Some(true)` for 1, `None` unset (on for a hardware adapter that
/// has the units, off for a software one). Read once: every pass asks.
pub(super) fn wanted() -> Option<bool> {
    static WANTED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| match std::env::var("BATON_GPU_COOPMAT").ok()?.trim() {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    })
}

/// Workgroup memory the kernel takes with S × S matrices: two tiles of 64 × 40 halves, and 2 S × S f32 blocks
/// for each of the 4 subgroups (`matmul_coop.wgsl`).
fn workgroup_bytes(s: u32) -> u32 {
    2 * 64 * 40 * 2 + 8 * s * s * 4
}

/// The matrix size S the kernel can take on `adapter` with subgroups of `subgroup` (0: none), or 0 where it
/// cannot (see the module's doc) or `BATON_GPU_COOPMAT=0` says not to.
pub(super) fn size_for(adapter: &wgpu::Adapter, subgroup: u32) -> u32 {
    if wanted() == Some(false) || subgroup == 0 || !adapter.features().contains(FEATURES) {
        return 0;
    }
    let info = adapter.get_info();
    let limits = adapter.limits();
    let threads = 4 * subgroup;
    if info.subgroup_min_size != info.subgroup_max_size
        || limits.max_compute_invocations_per_workgroup < threads
        || limits.max_compute_workgroup_size_x < threads
    {
        return 0;
    }
    let props = adapter.cooperative_matrix_properties();
    let has = |s: u32| {
        props.iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (s, s, s)
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        }) && workgroup_bytes(s) <= limits.max_compute_workgroup_storage_size
    };
    [16, 8].into_iter().find(|&s| has(s)).unwrap_or(0)
}

/// The module's head: the enables (first, as WGSL wants them), the matrix types and sizes.
fn head(s: u32, sg: u32) -> String {
    format!(
        "enable f16;\nenable wgpu_cooperative_matrix;\n\
         alias MA = coop_mat{s}x{s}<f16, A>;\nalias MB = coop_mat{s}x{s}<f16, B>;\nalias MC = coop_mat{s}x{s}<f32, C>;\n\
         const S: u32 = {s}u;\nconst SG: u32 = {sg}u;\n"
    )
}

/// The probe: one subgroup multiplies an S × S matrix of small integers by another into f32 sums, which are
/// exact, row-major A and column-major B as the kernel loads them (`p.one` = 1: a binding the layout keeps; not in the stride, which naga 30's
/// SPIR-V writer takes only as a constant).
const PROBE: &str = "
struct Params { one: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> pa: array<f16>;
@group(0) @binding(2) var<storage, read> pb: array<f16>;
@group(0) @binding(3) var<storage, read_write> pc: array<f32>;

@compute @workgroup_size(SG)
fn probe() {
    let a = coopLoadT<MA>(&pa[0], S);
    let b = coopLoad<MB>(&pb[0], S);
    let c = coopMultiplyAdd(a, b, MC());
    coopStore(c, &pc[p.one - 1u], S);
}
";

/// Whether `gpu`'s matrix units of size `s` multiply as the kernel expects them to (a driver that fails gets the
/// f32 tiled kernel instead).
pub(super) fn probe(gpu: &Gpu, s: u32) -> Result<bool> {
    let n = s as usize;
    let a: Vec<f32> = (0..n * n).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i * 3) % 7) as f32 - 2.0).collect();
    let halves = |v: &[f32]| gpu.upload_halves(&v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>());
    let (ga, gb, gc) = (halves(&a)?, halves(&b)?, gpu.zeros(n * n)?);
    let mut pass = gpu.pass();
    let pipeline = gpu.pipeline(&format!("coop_probe{s}"), "probe", &[], || {
        head(s, gpu.subgroup()) + PROBE
    })?;
    pass.dispatch(&pipeline, &[1], &[(1, &ga.buf), (2, &gb.buf), (3, &gc.buf)], (1, 1, 1));
    pass.read(&gc, 0, n * n)?;
    let got: Vec<f32> = bytemuck::pod_collect_to_vec(&pass.finish_read()?[0]);
    // C[i][j] = Σ_k A[i][k] B[k][j], A row-major, B and C column-major.
    Ok((0..n * n).all(|e| {
        let (i, j) = (e % n, e / n);
        got[e] == (0..n).map(|k| a[i * n + k] * b[j * n + k]).sum::<f32>()
    }))
}

/// Whether the kernel takes weights of type `ty` in rows of `cols`.
fn takes(ty: GgmlType, cols: usize) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::BF16) && cols.is_multiple_of(UNIT)
}

impl Pass<'_> {
    /// Whether a batch of `n` rows over `w` takes the matrix-unit kernel: where this pass has it (`with_coop`) and
    /// the tiled kernels would take the batch.
    pub(super) fn takes_coop(&self, w: &GpuMatrix, n: usize) -> bool {
        self.coop > 0 && n >= self.tiled_min && takes(w.ty, w.cols)
    }

    /// The pass with the matrix-unit kernel (`on`, where the adapter has it) or without, so tests run both.
    pub fn with_coop(mut self, on: bool) -> Self {
        self.coop = if on { self.gpu().coop() } else { 0 };
        self
    }

    /// The `n` rows of `cols` values of `x` as the matrix-unit kernel reads them (`halves.wgsl`): each row's
    /// halves, scaled into f16's range, then the rows' scales.
    pub(super) fn halves(&mut self, x: &Tensor, n: usize, cols: usize) -> Result<Tensor> {
        ensure!(
            cols.is_multiple_of(2) && x.len() >= n * cols,
            "halving {n} rows of {cols} of a tensor of {}",
            x.len()
        );
        let y = self.kept_halves(n * cols / 2 + n)?;
        let pipeline = self.reducing_pipeline("halves", "halve", &[], || module(&[wgsl::REDUCE, wgsl::HALVES]))?;
        let (gx, gy) = grid(u32_of(n, "rows")?);
        let params = [u32_of(n, "rows")?, u32_of(cols, "columns")?, gx, 0];
        self.dispatch(&pipeline, &params, &[(1, &x.buf), (2, &y.buf)], (gx, gy, 1));
        Ok(y)
    }

    /// The entry point `entry` (`matmul` or `matmul_glu`) of the matrix-unit kernel for weights of type `ty`, its
    /// tiles over `rows` (a batch's tokens or a mixture's grouped picks).
    pub(super) fn coop_pipeline(
        &self,
        ty: GgmlType,
        entry: &'static str,
        rows: Rows,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let (s, sg) = (self.coop, self.gpu().subgroup());
        ensure!(s > 0 && sg > 0, "no matrix units on this pass");
        let key = format!("matmul_coop{}_{}_{s}", rows.key(), super::matmul::wgsl_type(ty));
        self.gpu().pipeline(&key, entry, &[], || {
            module(&[&head(s, sg), &tiled_source(ty, wgsl::MATMUL_COOP, rows)])
        })
    }
}

/// The test adapter ([`super::test_gpu`]) where it has matrix units; `None`, after printing SKIPPED with the
/// reason, where it has none (`scripts/test-coopmat` runs the tests that ask on Mesa 26's lavapipe).
#[cfg(test)]
pub(super) fn test_units() -> Option<Arc<Gpu>> {
    let gpu = super::test_gpu()?;
    if gpu.coop() == 0 {
        println!(
            "SKIPPED: {} has no cooperative matrices wgpu can use (scripts/test-coopmat runs Mesa 26's lavapipe)",
            gpu.describe()
        );
        return None;
    }
    Some(gpu)
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;

    /// Where the adapter has matrix units, the probe passed at load (else `coop()` is 0); where it has none, the
    /// tests of the kernel print SKIPPED, which `scripts/test-coopmat` answers by running them on Mesa 26.
    #[test]
    fn probe_passes_where_there_are_units() {
        let Some(gpu) = super::test_units() else { return };
        assert!(super::probe(&gpu, gpu.coop()).unwrap(), "{}", gpu.describe());
    }

    /// `halves.wgsl`: each row's values times 2^-k in f16 and 2^k after the rows, k the least that brings the
    /// row's largest magnitude under 2^15: 0 for small values and for zeros, 1 just past 2^15, 5 at 1e6 (2^19.9).
    /// On any adapter (it needs neither f16 nor matrix units).
    #[test]
    fn halves_scale_rows_into_f16() {
        let Some(gpu) = test_gpu() else { return };
        let cols = 300;
        let rows: [(f32, u32); 4] = [(3.0, 0), (0.0, 0), (40000.0, 1), (-1e6, 5)];
        let x: Vec<f32> = rows
            .iter()
            .flat_map(|&(big, _)| (0..cols).map(move |i| big * ((i % 17) as f32 - 8.0) / 8.0))
            .collect();
        let gx = gpu.upload(&x).unwrap();
        let mut pass = gpu.pass();
        let h = pass.halves(&gx, rows.len(), cols).unwrap();
        let words = rows.len() * cols / 2 + rows.len();
        pass.read(&h, 0, words).unwrap();
        let got: Vec<u32> = bytemuck::pod_collect_to_vec(&pass.finish_read().unwrap()[0]);
        for (r, &(_, k)) in rows.iter().enumerate() {
            let scale = f32::from_bits(got[rows.len() * cols / 2 + r]);
            assert_eq!(scale, 2f32.powi(k as i32), "row {r}");
            for c in 0..cols {
                let word = got[(r * cols + c) / 2];
                let bits = if c % 2 == 0 { word & 0xffff } else { word >> 16 };
                // Within one f16 step: WGSL leaves `pack2x16float`'s rounding to the implementation.
                let want = x[r * cols + c] / scale;
                let got = half::f16::from_bits(bits as u16).to_f32();
                assert!(
                    (got - want).abs() <= want.abs() / 1024.0,
                    "row {r} column {c}: {got} for {want}"
                );
            }
        }
    }

    #[test]
    fn head_names_the_size() {
        let h = super::head(16, 32);
        assert!(h.starts_with("enable f16;\nenable wgpu_cooperative_matrix;\n"));
        assert!(h.contains("alias MC = coop_mat16x16<f32, C>;") && h.contains("const SG: u32 = 32u;"));
        assert!(super::workgroup_bytes(16) <= 32768 && super::workgroup_bytes(8) < super::workgroup_bytes(16));
    }
}
