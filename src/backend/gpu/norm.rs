//! RMSNorm, alone or fused with the residual add before it (`shaders/norm.wgsl`).

use super::buffers::Tensor;
use super::device::grid;
use super::{Pass, module, u32_of, wgsl};
use anyhow::{Result, ensure};

fn source() -> String {
    module(&[wgsl::REDUCE, wgsl::NORM])
}

impl Pass<'_> {
    /// RMS-normalises each of the `n` rows of `x` (rows of `w.len()`) into `out`, scaled by `w`.
    pub fn rms_norm(&mut self, x: &Tensor, w: &Tensor, eps: f32, n: usize, out: &Tensor) -> Result<()> {
        self.rms_norm_cols(x, (w.len(), 0), w, eps, n, out)
    }

    /// [`Pass::rms_norm`] of a slice of wider rows: row `r` of `x` is the `w.len()` values from `r·stride + at`;
    /// `out` holds them side by side.
    pub fn rms_norm_cols(
        &mut self,
        x: &Tensor,
        (stride, at): (usize, usize),
        w: &Tensor,
        eps: f32,
        n: usize,
        out: &Tensor,
    ) -> Result<()> {
        ensure!(!w.is_empty(), "RMSNorm over rows of no values");
        ensure!(
            at + w.len() <= stride && (n == 0 || x.len() >= (n - 1) * stride + at + w.len()),
            "RMSNorm of {n} rows of {} from {at} of {stride} over a tensor of {}",
            w.len(),
            x.len()
        );
        ensure!(out.len() >= n * w.len(), "RMSNorm output too small");
        let bufs = [(1, &x.buf), (2, &w.buf), (3, &out.buf)];
        self.norm("rms_norm", &bufs, w.len(), (stride, at), eps, n, false)
    }

    /// [`Pass::rms_norm`] in place.
    pub fn rms_norm_inplace(&mut self, x: &Tensor, w: &Tensor, eps: f32, n: usize) -> Result<()> {
        self.check_norm(x, w, n)?;
        let width = w.len();
        self.norm(
            "rms_norm_inplace",
            &[(2, &w.buf), (4, &x.buf)],
            width,
            (width, 0),
            eps,
            n,
            false,
        )
    }

    /// The residual add and the RMSNorm after it, over `n` rows of `w.len()`: `x += y`, then `y = rmsnorm(x)·w`.
    /// With `post`, `y` is first RMS-normalised by `post` (Gemma 3's norm of a block's output, before the add).
    pub fn add_rms_norm(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        post: Option<&Tensor>,
        w: &Tensor,
        eps: f32,
        n: usize,
    ) -> Result<()> {
        self.check_norm(x, w, n)?;
        self.check_norm(y, w, n)?;
        ensure!(
            post.is_none_or(|p| p.len() == w.len()),
            "a post-norm of another width than the norm"
        );
        // Without a post-norm its binding holds `w`, unread.
        let pw = post.unwrap_or(w);
        let bufs = [(2, &w.buf), (4, &y.buf), (5, &x.buf), (6, &pw.buf)];
        let width = w.len();
        self.norm("add_rms_norm", &bufs, width, (width, 0), eps, n, post.is_some())
    }

    fn check_norm(&self, x: &Tensor, w: &Tensor, n: usize) -> Result<()> {
        ensure!(!w.is_empty(), "RMSNorm over rows of no values");
        ensure!(
            x.len() >= n * w.len(),
            "RMSNorm of {n} rows of {} over a tensor of {}",
            w.len(),
            x.len()
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn norm(
        &mut self,
        entry: &'static str,
        bufs: &[(u32, &wgpu::Buffer)],
        width: usize,
        (stride, at): (usize, usize),
        eps: f32,
        n: usize,
        post: bool,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let pipeline = self.reducing_pipeline("norm", entry, &[], source)?;
        let (gx, gy) = grid(u32_of(n, "rows")?);
        let params = [
            u32_of(n, "rows")?,
            u32_of(width, "width")?,
            eps.to_bits(),
            gx,
            post as u32,
            u32_of(stride, "row stride")?,
            u32_of(at, "row offset")?,
        ];
        self.dispatch(&pipeline, &params, bufs, (gx, gy, 1));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::kernels::ops;
    use crate::kernels::testutil::Rng;

    /// Within 2e-6 relative of the CPU's, which sums the squares in f64: the GPU's f32 sum of a row of a few
    /// thousand squares (256 partial sums, then subgroups or a tree, both run) is off by a few ulps, and the scale
    /// by half that.
    #[test]
    fn rms_norm_matches_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2120);
        for (width, n, sg) in [
            (576, 3, true),
            (2048, 1, true),
            (100, 5, true),
            (576, 3, false),
            (100, 5, false),
        ] {
            let x: Vec<f32> = (0..n * width).map(|_| rng.normal() * 3.0).collect();
            let w: Vec<f32> = (0..width).map(|_| 1.0 + rng.normal() * 0.2).collect();
            let eps = 1e-5;
            let mut want = vec![0.0; n * width];
            for (xr, o) in x.chunks(width).zip(want.chunks_mut(width)) {
                ops::rms_norm(xr, &w, eps, o);
            }
            let (gx, gw) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
            let out = gpu.zeros(n * width).unwrap();
            let mut pass = gpu.pass().with_subgroups(sg);
            pass.rms_norm(&gx, &gw, eps, n, &out).unwrap();
            pass.rms_norm_inplace(&gx, &gw, eps, n).unwrap();
            pass.finish().unwrap();
            for got in [gpu.read(&out).unwrap(), gpu.read(&gx).unwrap()] {
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 2e-6 * e.abs() + 1e-7,
                        "width {width} subgroups {sg} at {i}: {g} vs {e}"
                    );
                }
            }
        }
    }

    /// A slice of wider rows (DeepSeek's compressed KV vector before its RoPE key, after Q's low-rank values)
    /// normalised into rows of its own, as the CPU normalises the slice copied out; a slice past its rows is
    /// refused.
    #[test]
    fn rms_norm_of_a_slice_of_each_row() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2122);
        let (n, stride, at, width) = (4, 90, 32, 40);
        let x: Vec<f32> = (0..n * stride).map(|_| rng.normal() * 3.0).collect();
        let w: Vec<f32> = (0..width).map(|_| 1.0 + rng.normal() * 0.2).collect();
        let eps = 1e-6;
        let mut want = vec![0.0; n * width];
        for (xr, o) in x.chunks(stride).zip(want.chunks_mut(width)) {
            ops::rms_norm(&xr[at..at + width], &w, eps, o);
        }
        let (gx, gw, out) = (
            gpu.upload(&x).unwrap(),
            gpu.upload(&w).unwrap(),
            gpu.zeros(n * width).unwrap(),
        );
        let mut pass = gpu.pass();
        pass.rms_norm_cols(&gx, (stride, at), &gw, eps, n, &out).unwrap();
        assert!(
            pass.rms_norm_cols(&gx, (stride, stride - width + 1), &gw, eps, n, &out)
                .is_err()
        );
        assert!(pass.rms_norm_cols(&gx, (stride, at), &gw, eps, n + 1, &out).is_err());
        pass.finish().unwrap();
        for (i, (g, e)) in gpu.read(&out).unwrap().iter().zip(&want).enumerate() {
            assert!((g - e).abs() <= 2e-6 * e.abs() + 1e-7, "at {i}: {g} vs {e}");
        }
    }

    /// The fused add and norm against the CPU's ops it replaces (`ops::rms_norm_inplace` of the block's output where
    /// there is a post-norm, `ops::add_inplace`, `ops::rms_norm`): the residual within 1e-6 relative plus 1e-6 (exact
    /// without a post-norm), the normalised rows within 4e-6 relative plus 1e-7.
    #[test]
    fn add_rms_norm_matches_cpu_ops() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2121);
        let cases = [
            (576, 3, false, true),
            (576, 2, true, true),
            (2048, 1, false, true),
            (100, 5, true, true),
        ];
        // The workgroup-memory reductions too.
        let trees = [(576, 2, true, false), (2048, 1, false, false)];
        for (width, n, post, sg) in cases.into_iter().chain(trees) {
            let x: Vec<f32> = (0..n * width).map(|_| rng.normal() * 3.0).collect();
            let y: Vec<f32> = (0..n * width).map(|_| rng.normal()).collect();
            let w: Vec<f32> = (0..width).map(|_| 1.0 + rng.normal() * 0.2).collect();
            let pw: Vec<f32> = (0..width).map(|_| 1.0 + rng.normal() * 0.2).collect();
            let eps = 1e-6;
            let (mut want_x, mut want_y) = (x.clone(), y.clone());
            for (xr, yr) in want_x.chunks_mut(width).zip(want_y.chunks_mut(width)) {
                if post {
                    ops::rms_norm_inplace(yr, &pw, eps);
                }
                ops::add_inplace(xr, yr);
                ops::rms_norm(xr, &w, eps, yr);
            }
            let (gx, gy) = (gpu.upload(&x).unwrap(), gpu.upload(&y).unwrap());
            let (gw, gpw) = (gpu.upload(&w).unwrap(), gpu.upload(&pw).unwrap());
            let mut pass = gpu.pass().with_subgroups(sg);
            pass.add_rms_norm(&gx, &gy, post.then_some(&gpw), &gw, eps, n).unwrap();
            assert!(pass.add_rms_norm(&gx, &gy, None, &gw, eps, n + 1).is_err());
            pass.finish().unwrap();
            let got_x = gpu.read(&gx).unwrap();
            if !post {
                assert_eq!(got_x, want_x, "width {width}: the residual add is exact");
            }
            for (i, (g, e)) in got_x.iter().zip(&want_x).enumerate() {
                assert!(
                    (g - e).abs() <= 1e-6 * e.abs() + 1e-6,
                    "width {width} post {post}: x at {i}: {g} vs {e}"
                );
            }
            for (i, (g, e)) in gpu.read(&gy).unwrap().iter().zip(&want_y).enumerate() {
                assert!(
                    (g - e).abs() <= 4e-6 * e.abs() + 1e-7,
                    "width {width} post {post} subgroups {sg}: normalised at {i}: {g} vs {e}"
                );
            }
        }
    }
}
