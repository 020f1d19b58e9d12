//! Element-wise ops (`shaders/elementwise.wgsl`): the residual add (where no RMSNorm follows it in the pass), and
//! the GLU activation for a feed-forward whose gate and up matrices are of different types (otherwise `matmul_glu` applies it in the matmul).

use super::buffers::Tensor;
use super::device::grid;
use super::matmul::act_code;
use super::{Pass, module, u32_of, wgsl};
use crate::kernels::Glu;
use anyhow::{Result, ensure};

fn source() -> String {
    module(&[wgsl::F16, wgsl::ACT, wgsl::ELEMENTWISE])
}

impl Pass<'_> {
    /// `x[..n] += y[..n]` (the residual add).
    pub fn add(&mut self, x: &Tensor, y: &Tensor, n: usize) -> Result<()> {
        self.elementwise("add", x, y, n, Glu::Silu)
    }

    /// `g[i] = act(g[i]) * u[i]` for `i < n`.
    pub fn glu_mul(&mut self, g: &Tensor, u: &Tensor, glu: Glu, n: usize) -> Result<()> {
        self.elementwise("glu_mul", g, u, n, glu)
    }

    fn elementwise(&mut self, entry: &'static str, a: &Tensor, b: &Tensor, n: usize, glu: Glu) -> Result<()> {
        ensure!(
            a.len() >= n && b.len() >= n,
            "{entry} over {n} values of tensors of {} and {}",
            a.len(),
            b.len()
        );
        if n == 0 {
            return Ok(());
        }
        let pipeline = self.gpu().pipeline("elementwise", entry, &[], source)?;
        let (gx, gy) = grid(u32_of(n.div_ceil(256), "values")?);
        let params = [u32_of(n, "values")?, gx, act_code(glu), 0];
        self.dispatch(&pipeline, &params, &[(1, &a.buf), (2, &b.buf)], (gx, gy, 1));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::kernels::Glu;
    use crate::kernels::ops;
    use crate::kernels::testutil::Rng;

    /// The residual add is exact; SiLU is within 1e-5 relative of the CPU's (the two `exp`s differ in the last
    /// bits); GeGLU rounds its input and result to f16 as the CPU's table does, so the two agree within one f16
    /// step of the input (slope ≤ 1.13) and of the result: 2e-3·(|x| + 0.2)·|u|.
    #[test]
    fn add_and_activations_match_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2110);
        let n = 3001;
        // Mostly small gate values, some beyond GELU's ±10 cut-offs and SiLU's large-exponent range.
        let g: Vec<f32> = (0..n)
            .map(|i| (if i % 7 == 0 { 60.0 } else { 8.0 }) * (rng.uniform() - 0.5))
            .collect();
        let u: Vec<f32> = (0..n).map(|_| rng.normal()).collect();

        let (a, b) = (gpu.upload(&g).unwrap(), gpu.upload(&u).unwrap());
        let mut pass = gpu.pass();
        pass.add(&a, &b, n).unwrap();
        pass.finish().unwrap();
        let mut want = g.clone();
        ops::add_inplace(&mut want, &u);
        assert_eq!(gpu.read(&a).unwrap(), want, "residual add");

        for glu in [Glu::Silu, Glu::Gelu] {
            let a = gpu.upload(&g).unwrap();
            let mut pass = gpu.pass();
            pass.glu_mul(&a, &b, glu, n).unwrap();
            pass.finish().unwrap();
            let got = gpu.read(&a).unwrap();
            let mut want = g.clone();
            glu.apply(&mut want, &u);
            for i in 0..n {
                let tol = match glu {
                    Glu::Silu => 1e-5 * want[i].abs() + 1e-7,
                    Glu::Gelu => 2e-3 * (g[i].abs() + 0.2) * u[i].abs() + 1e-7,
                };
                assert!(
                    (got[i] - want[i]).abs() <= tol,
                    "{glu:?} at {i}: act({}) * {} = {} on the GPU, {} on the CPU",
                    g[i],
                    u[i],
                    got[i],
                    want[i]
                );
            }
        }
    }
}
