//! Embedding lookup on the device (`shaders/embed.wgsl`): a batch's token rows of the embedding matrix, kept in
//! its GGUF blocks as the matmuls' weights are and dequantized by the same code, so the host uploads token ids
//! instead of a row of `n_embd` floats per token.

use super::buffers::{GpuMatrix, Tensor, U32s, UNIT};
use super::device::grid;
use super::matmul::dequantizers;
use super::{Pass, module, u32_of, wgsl};
use anyhow::{Result, ensure};

impl Pass<'_> {
    /// `x[t, :] = scale · embd[tok[t], :]` for the `tok.len()` tokens of `tok`, all below `embd.rows` (the caller
    /// checks the ids against the vocabulary; the shader writes nothing for one past it).
    pub fn embed(&mut self, embd: &GpuMatrix, tok: &U32s, scale: f32, x: &Tensor) -> Result<()> {
        let n = tok.len();
        ensure!(n > 0, "an embedding of no tokens");
        ensure!(
            (tok.max() as usize) < embd.rows,
            "token id {} is outside the embedding's {} rows",
            tok.max(),
            embd.rows
        );
        ensure!(
            x.len() >= n * embd.cols,
            "embedding output holds {} values, {n} rows of {} need {}",
            x.len(),
            embd.cols,
            n * embd.cols
        );
        ensure!(
            embd.cols.is_multiple_of(UNIT),
            "the GPU embedding lookup needs rows of a multiple of {UNIT} values, not {}",
            embd.cols
        );
        let key = format!("embed_{}", embd.ty);
        let ty = embd.ty;
        let pipeline = self.gpu().pipeline(&key, "embed", &[], || {
            module(&[&dequantizers(ty, &[("wa", "a")]), wgsl::EMBED])
        })?;
        let units = embd.cols / UNIT;
        let (gx, gy) = grid(u32_of((n * units).div_ceil(64), "embedding units")?);
        for part in &embd.parts {
            let params = [
                u32_of(n, "tokens")?,
                u32_of(embd.cols, "cols")?,
                u32_of(embd.row_bytes, "row bytes")?,
                u32_of(units, "units")?,
                u32_of(part.row0, "rows")?,
                u32_of(part.rows, "rows")?,
                gx,
                scale.to_bits(),
            ];
            let mut bufs = vec![(1, &part.buf), (2, &tok.buf), (3, &x.buf)];
            bufs.extend(self.grid_binding(ty)?);
            self.dispatch(&pipeline, &params, &bufs, (gx, gy, 1));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::gguf::GgmlType::*;
    use crate::kernels::tests::random_matrix;
    use crate::kernels::testutil::Rng;

    /// The rows looked up on the device equal the CPU's scalar dequantization of them, times the scale, for a
    /// float type, 32-weight blocks, K-quants and a grid i-quant (its codebooks), whole and in parts of 7 rows (a
    /// token in each part, one repeated); an id past the matrix is an error.
    #[test]
    fn embed_matches_cpu_rows() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2120);
        let (rows, cols) = (23, 512);
        let tokens = [0u32, 22, 7, 7, 13, 6, 21];
        for ty in [F16, Q8_0, Q5_1, Q3K, Q6K, IQ4XS, IQ2XS, IQ1S] {
            let m = random_matrix(&mut rng, ty, rows, cols);
            for (part, scale) in [(0, 1.0f32), (7, 22.627417)] {
                let gm = match part {
                    0 => gpu.upload_matrix(&m).unwrap(),
                    _ => gpu.upload_matrix_in_parts(&m, part * m.row_bytes() + 8).unwrap(),
                };
                let tok = gpu.upload_u32(&tokens).unwrap();
                let x = gpu.zeros(tokens.len() * cols).unwrap();
                let mut pass = gpu.pass();
                pass.embed(&gm, &tok, scale, &x).unwrap();
                pass.finish().unwrap();
                let got = gpu.read(&x).unwrap();
                let mut row = vec![0.0; cols];
                for (t, &id) in tokens.iter().enumerate() {
                    m.dequantize_row_into(id as usize, &mut row);
                    let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs())) * scale;
                    for (k, (&g, &w)) in got[t * cols..(t + 1) * cols].iter().zip(&row).enumerate() {
                        // The same f32 operations, up to a fused multiply-add (an ulp of the product, which a
                        // weight's min may cancel down to near zero): within a few ulps of the row's largest.
                        let want = w * scale;
                        assert!(
                            (g - want).abs() <= 4.0 * f32::EPSILON * (want.abs() + amax),
                            "{ty} parts of {part} token {t} (id {id}) weight {k}: {g} vs {want}"
                        );
                    }
                }
                let bad = gpu.upload_u32(&[rows as u32]).unwrap();
                assert!(gpu.pass().embed(&gm, &bad, 1.0, &x).is_err());
            }
        }
    }
}
