//! A batch's activations rounded to the CPU backend's 8-bit grid before a matmul of quantized weights
//! (`shaders/act8.wgsl`).
//!
//! The CPU backend, as llama.cpp, quantizes activations to 8 bits before every quantized matmul (the type each
//! weight type is dotted with, `kernels::table`). A GPU that kept them in f32 computed products closer to exact
//! ones, and so a model of its own: Gemma 3's perplexity on the golden text came out 0.57 % below the CPU's
//! (docs/gpu.md). Rounding a batch's activations the same way makes a GPU prefill's logits and KV rows the CPU's
//! up to the order of the sums, which is what a prefill handed from one backend to the other needs. A decode step
//! (one row) keeps f32 activations: the rounding would be a dispatch of its own before each mat-vec.

use super::buffers::Tensor;
use super::device::grid;
use super::{Pass, env_number, module, u32_of, wgsl};
use crate::gguf::GgmlType;
use anyhow::{Result, ensure};
use std::sync::OnceLock;

/// The activation type a matmul of `ty` weights rounds a batch to (the type the CPU dots `ty` with), `None` where
/// the CPU keeps f32 activations (the float types) or `BATON_GPU_ACT8=0` says to keep them.
pub(super) fn act_type(ty: GgmlType) -> Option<GgmlType> {
    // `BATON_GPU_ACT8=0` keeps every batch's activations f32, to measure what the rounding costs.
    static ON: OnceLock<bool> = OnceLock::new();
    if !*ON.get_or_init(|| env_number("BATON_GPU_ACT8", |&v: &u32| v <= 1, 1) == 1) {
        return None;
    }
    Some(crate::kernels::kernels().for_type(ty)?.vec_dot_type)
}

/// Threads of `act8.wgsl` per block of the activation type `act`.
fn threads_per_block(act: GgmlType) -> u32 {
    match act {
        GgmlType::Q8_0 | GgmlType::Q8_1 => 8,
        _ => 64,
    }
}

impl Pass<'_> {
    /// The first `len` values of `x` (whole blocks of `act`) rounded to the activation type `act` as the CPU
    /// quantizes them ([`act_type`] of the weights), in a tensor of their own. Matmuls call it through
    /// `Pass::round_for`.
    pub(super) fn act8(&mut self, act: GgmlType, x: &Tensor, len: usize) -> Result<Tensor> {
        let group = threads_per_block(act);
        ensure!(
            len <= x.len() && len.is_multiple_of(4 * group as usize),
            "{len} activations to round in blocks of {} (of a tensor of {})",
            4 * group,
            x.len()
        );
        let y = self.rounded(len)?;
        let pipeline = self
            .gpu()
            .pipeline("act8", "round8", &[], || module(&[wgsl::F16, wgsl::ACT8]))?;
        let (gx, gy) = grid(u32_of(len.div_ceil(256), "activations")?);
        let params = [u32_of(len, "activations")?, gx, group, 0];
        self.dispatch(&pipeline, &params, &[(1, &x.buf), (2, &y.buf)], (gx, gy, 1));
        Ok(y)
    }
}

/// The CPU's rounding of a batch's activations for a matmul of `w_ty` weights (its quantizer, dequantized: what
/// its dot products multiply the weights with), for the tests of the kernels that read them; `x` where they stay
/// f32.
#[cfg(test)]
pub(super) fn cpu_rounded(w_ty: GgmlType, x: &[f32]) -> Vec<f32> {
    use crate::kernels;
    let Some(k) = kernels::kernels().for_type(w_ty) else {
        return x.to_vec();
    };
    let act = k.vec_dot_type;
    let mut q = vec![0u8; act.row_bytes(x.len()).expect("whole blocks")];
    kernels::kernels().quant(act)(x, &mut q);
    let mut out = vec![0f32; x.len()];
    kernels::dequantize_row(act, &q, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::super::{module, test_gpu, wgsl};
    use super::cpu_rounded;
    use crate::gguf::GgmlType;
    use crate::kernels::testutil::Rng;

    /// Every activation type, on rows with ties of magnitude (the first wins, as on the CPU), zero blocks, a few
    /// large values and a tail workgroup that is only partly used: the GPU's values are the CPU's dequantized
    /// quants, within one f32 rounding of the product d·q.
    #[test]
    fn rounding_matches_the_cpu_quantizers() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(808);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::IQ4NL] {
            let cols = 512;
            let rows = 5;
            let mut x: Vec<f32> = (0..rows * cols).map(|_| 3.0 * rng.normal()).collect();
            x[cols..cols + 256].fill(0.0);
            x[3 * cols + 7] = 40.0;
            x[3 * cols + 9] = -40.0;
            x[4 * cols + 1] = -40.0;
            x[4 * cols + 200] = 40.0;
            let len = if ty == GgmlType::Q4K {
                rows * cols
            } else {
                rows * cols - 32
            };
            let want = cpu_rounded(ty, &x[..len]);
            let t = gpu.upload(&x).unwrap();
            let mut pass = gpu.pass();
            let act = super::act_type(ty).expect("a quantized type rounds");
            let y = pass.act8(act, &t, len).unwrap();
            pass.finish().unwrap();
            let got = gpu.read(&y).unwrap();
            for i in 0..len {
                assert!(
                    (got[i] - want[i]).abs() <= 1e-6 * want[i].abs(),
                    "{ty:?} at {i}: {} rounds to {} on the GPU, {} on the CPU",
                    x[i],
                    got[i],
                    want[i]
                );
            }
        }
        assert!(super::act_type(GgmlType::F16).is_none(), "float weights keep f32");
        let t = gpu.upload(&[1.0; 64]).unwrap();
        let mut pass = gpu.pass();
        assert!(
            pass.act8(GgmlType::Q8K, &t, 64).is_err(),
            "64 values are not a Q8_K block"
        );
    }

    /// `f16.wgsl`'s rounding is the CPU's conversion (`half`, ties to even) bit for bit: on ties, below f16's least
    /// normal number, at and past its largest, and on random values of every scale. (NVIDIA's driver drops
    /// `unpack2x16float(pack2x16float(x))`, which it replaced, so this is what keeps the Q8_0 scales the CPU's.)
    #[test]
    fn f16_rounding_is_the_cpus() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(1606);
        let step = 2f32.powi(-11);
        let mut x = vec![
            0.0,
            -0.0,
            1.0 + step,
            1.0 + 3.0 * step,
            -(1.0 + step),
            2f32.powi(-25),
            3.0 * 2f32.powi(-25),
            6.0e-5,
            2f32.powi(-14),
            -1.0e-7,
            1.0e-9,
            65504.0,
            65519.0,
            65520.0,
            -70000.0,
            1.0e30,
        ];
        for e in -30..17 {
            for _ in 0..20 {
                x.push(rng.normal() * 2f32.powi(e));
            }
        }
        x.resize(x.len().next_multiple_of(64), 0.5);
        const KERNEL: &str = "
            @group(0) @binding(0) var<uniform> p: vec4<u32>;
            @group(0) @binding(1) var<storage, read> x: array<f32>;
            @group(0) @binding(2) var<storage, read_write> y: array<f32>;
            @compute @workgroup_size(64)
            fn main(@builtin(global_invocation_id) g: vec3<u32>) {
                if (g.x < p.x) {
                    y[g.x] = f16_round(x[g.x]);
                }
            }";
        let t = gpu.upload(&x).unwrap();
        let mut pass = gpu.pass();
        let y = pass.scratch(x.len()).unwrap();
        let pipeline = gpu
            .pipeline("f16_test", "main", &[], || module(&[wgsl::F16, KERNEL]))
            .unwrap();
        let params = [x.len() as u32, 0, 0, 0];
        pass.dispatch(
            &pipeline,
            &params,
            &[(1, &t.buf), (2, &y.buf)],
            (x.len() as u32 / 64, 1, 1),
        );
        pass.finish().unwrap();
        let got = gpu.read(&y).unwrap();
        for (v, g) in x.iter().zip(&got) {
            let want = half::f16::from_f32(*v).to_f32();
            assert_eq!(
                g.to_bits(),
                want.to_bits(),
                "{v:e} rounds to {g:e} on the GPU, {want:e} on the CPU"
            );
        }
    }
}
