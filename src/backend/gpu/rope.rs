//! RoPE (`shaders/rope.wgsl`), adjacent pairs (Llama) or halves (NeoX style), over the CPU's angle table.

use super::buffers::{Tensor, U32s};
use super::device::{Gpu, grid};
use super::{Pass, module, u32_of, wgsl};
use crate::kernels::ops::RopeTable;
use anyhow::{Result, ensure};

/// A [`RopeTable`] on the device: (cos, sin) of each rotated pair at each position.
pub struct GpuRope {
    buf: wgpu::Buffer,
    half: usize,
    n_ctx: usize,
}

impl Gpu {
    /// Uploads the CPU's table, so both backends rotate by the same angles.
    pub fn upload_rope(&self, t: &RopeTable) -> Result<GpuRope> {
        let n_ctx = t.n_ctx();
        let half = t.cos_sin(0).0.len();
        let mut cs = Vec::with_capacity(n_ctx * half * 2);
        for p in 0..n_ctx {
            let (c, s) = t.cos_sin(p);
            for (c, s) in c.iter().zip(s) {
                cs.extend([*c, *s]);
            }
        }
        let cs = self.upload(&cs)?;
        Ok(GpuRope {
            buf: cs.buf,
            half,
            n_ctx,
        })
    }
}

fn source() -> String {
    module(&[wgsl::ROPE])
}

impl Pass<'_> {
    /// Rotates each head of the `n` rows of `x` (`[n, n_heads, head_dim]`), row `t` by position `pos[t]`; `neox`
    /// rotates the halves of a head instead of adjacent pairs.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &mut self,
        table: &GpuRope,
        x: &Tensor,
        n: usize,
        n_heads: usize,
        head_dim: usize,
        pos: &U32s,
        neox: bool,
    ) -> Result<()> {
        ensure!(
            2 * table.half <= head_dim,
            "RoPE rotates {} values of a head of {head_dim}",
            2 * table.half
        );
        ensure!(x.len() >= n * n_heads * head_dim, "RoPE input too small");
        ensure!(pos.len() >= n, "RoPE of {n} rows given {} positions", pos.len());
        ensure!(
            (pos.max() as usize) < table.n_ctx,
            "RoPE at position {} past its table of {}",
            pos.max(),
            table.n_ctx
        );
        let pairs = n * n_heads * table.half;
        if pairs == 0 {
            return Ok(());
        }
        let pipeline = self.gpu().pipeline("rope", "rope", &[], source)?;
        let (gx, gy) = grid(u32_of(pairs.div_ceil(64), "RoPE pairs")?);
        let params = [
            u32_of(n, "rows")?,
            u32_of(n_heads, "heads")?,
            u32_of(head_dim, "head size")?,
            u32_of(table.half, "rotated pairs")?,
            neox as u32,
            gx,
            u32_of(table.n_ctx, "positions")?,
            0,
        ];
        self.dispatch(
            &pipeline,
            &params,
            &[(1, &x.buf), (2, &table.buf), (3, &pos.buf)],
            (gx, gy, 1),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::kernels::ops::RopeTable;
    use crate::kernels::testutil::Rng;

    /// Both styles, with fewer rotated values than the head (partial rotation) and without, rows at scattered
    /// positions: within 1e-6 of the CPU's rotation by the same table (a product and a sum each, possibly fused).
    #[test]
    fn rope_matches_cpu_both_styles() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2130);
        for (n_rot, head_dim) in [(64, 64), (32, 64)] {
            let table = RopeTable::new(10000.0, n_rot, 300);
            let gt = gpu.upload_rope(&table).unwrap();
            let (n, n_heads) = (4, 3);
            let pos = [0u32, 7, 255, 299];
            let x: Vec<f32> = (0..n * n_heads * head_dim).map(|_| rng.normal()).collect();
            let gp = gpu.upload_u32(&pos).unwrap();
            for neox in [false, true] {
                let mut want = x.clone();
                for (t, row) in want.chunks_mut(n_heads * head_dim).enumerate() {
                    for head in row.chunks_mut(head_dim) {
                        table.apply(head, pos[t] as usize, neox);
                    }
                }
                let gx = gpu.upload(&x).unwrap();
                let mut pass = gpu.pass();
                pass.rope(&gt, &gx, n, n_heads, head_dim, &gp, neox).unwrap();
                pass.finish().unwrap();
                let got = gpu.read(&gx).unwrap();
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 1e-6 * (1.0 + e.abs()),
                        "neox {neox} at {i}: {g} vs {e}"
                    );
                }
            }
        }
    }
}
