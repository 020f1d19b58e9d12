//! DeepSeek's latent attention's own op (`shaders/latent.wgsl`): the batch's K and V heads assembled from the
//! compressed vector's products, so the rest of the layer is any architecture's (`layers.rs`).

use super::buffers::Tensor;
use super::device::grid;
use super::{Pass, module, u32_of, wgsl};
use crate::backend::AttnShape;
use anyhow::{Result, ensure};

fn source() -> String {
    module(&[wgsl::LATENT])
}

impl Pass<'_> {
    /// Writes the K and V parts of the `a.n_tok` rows of `qkv` (rows of `a.qkv_width()`, Q first). K head `h` is
    /// head `h`'s K_nope from `kvb` (rows of `n_head · (nope + hdv)`: per head `nope` values of K, then `hdv` of V;
    /// `nope = hdk - rot`), then the RoPE key the heads share: the `rot` values from `k_pe_at` in each row of
    /// `k_pe` (rows of `stride`); V head `h` is head `h`'s V from `kvb`.
    pub fn latent_kv(
        &mut self,
        (k_pe, stride, k_pe_at): (&Tensor, usize, usize),
        kvb: &Tensor,
        a: &AttnShape,
        rot: usize,
        qkv: &Tensor,
    ) -> Result<()> {
        let (n, nh, hdk, hdv) = (a.n_tok, a.n_head, a.hdk, a.hdv);
        ensure!(
            a.n_head_kv == nh && rot > 0 && rot < hdk,
            "latent attention of {nh} heads ({} KV heads) of {hdk} with {rot} rotated",
            a.n_head_kv
        );
        let nope = hdk - rot;
        ensure!(
            k_pe_at + rot <= stride
                && k_pe.len() >= n * stride
                && kvb.len() >= n * nh * (nope + hdv)
                && qkv.len() >= n * a.qkv_width(),
            "latent attention's buffers smaller than {n} rows"
        );
        let values = n * nh * (hdk + hdv);
        if values == 0 {
            return Ok(());
        }
        let pipeline = self.gpu().pipeline("latent", "latent_kv", &[], source)?;
        let (gx, gy) = grid(u32_of(values.div_ceil(256), "K and V values")?);
        let params = [
            u32_of(n, "rows")?,
            u32_of(nh, "heads")?,
            u32_of(nope, "unrotated dimensions")?,
            u32_of(rot, "rotated dimensions")?,
            u32_of(hdv, "V head size")?,
            u32_of(stride, "RoPE key row")?,
            u32_of(k_pe_at, "RoPE key offset")?,
            u32_of(nh * hdk, "Q width")?,
            u32_of(a.qkv_width(), "Q, K and V width")?,
            gx,
        ];
        let bufs = [(1, &k_pe.buf), (2, &kvb.buf), (3, &qkv.buf)];
        self.dispatch(&pipeline, &params, &bufs, (gx, gy, 1));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::backend::AttnShape;
    use crate::kernels::testutil::Rng;

    /// Against the CPU's assembly (`model::deepseek2::latent_qkv`'s copies): every K and V value in place, Q's part
    /// of each row untouched; a shape of the wrong kind is refused.
    #[test]
    fn latent_kv_assembles_the_heads() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2140);
        let (n, nh, nope, rot, hdv, r) = (3, 4, 32, 16, 24, 20);
        let hdk = nope + rot;
        let a = AttnShape {
            n_tok: n,
            n_head: nh,
            n_head_kv: nh,
            hdk,
            hdv,
            window: None,
            scale: 1.0,
        };
        let w = a.qkv_width();
        // The RoPE key after the compressed vector, both after 5 values of something else (Q's low-rank values).
        let stride = 5 + r + rot;
        let ckv: Vec<f32> = (0..n * stride).map(|_| rng.normal()).collect();
        let kvb: Vec<f32> = (0..n * nh * (nope + hdv)).map(|_| rng.normal()).collect();
        let qkv: Vec<f32> = (0..n * w).map(|_| rng.normal()).collect();
        let mut want = qkv.clone();
        for t in 0..n {
            let k_pe = &ckv[t * stride + 5 + r..(t + 1) * stride];
            for h in 0..nh {
                let src = &kvb[(t * nh + h) * (nope + hdv)..(t * nh + h + 1) * (nope + hdv)];
                let k = t * w + nh * hdk + h * hdk;
                want[k..k + nope].copy_from_slice(&src[..nope]);
                want[k + nope..k + hdk].copy_from_slice(k_pe);
                let v = t * w + 2 * nh * hdk + h * hdv;
                want[v..v + hdv].copy_from_slice(&src[nope..]);
            }
        }
        let (gc, gk, gq) = (
            gpu.upload(&ckv).unwrap(),
            gpu.upload(&kvb).unwrap(),
            gpu.upload(&qkv).unwrap(),
        );
        let mut pass = gpu.pass();
        let k_pe = (&gc, stride, 5 + r);
        pass.latent_kv(k_pe, &gk, &a, rot, &gq).unwrap();
        assert!(pass.latent_kv(k_pe, &gk, &a, hdk, &gq).is_err(), "no unrotated part");
        assert!(
            pass.latent_kv((&gc, stride, 6 + r), &gk, &a, rot, &gq).is_err(),
            "a key past its row"
        );
        let gqa = AttnShape { n_head_kv: 2, ..a };
        assert!(pass.latent_kv(k_pe, &gk, &gqa, rot, &gq).is_err(), "shared KV heads");
        let more = AttnShape { n_tok: n + 1, ..a };
        assert!(
            pass.latent_kv(k_pe, &gk, &more, rot, &gq).is_err(),
            "rows past the buffers"
        );
        pass.finish().unwrap();
        assert_eq!(gpu.read(&gq).unwrap(), want);
    }
}
