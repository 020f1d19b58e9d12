//! The KV rows a forward pass wrote, gathered on the device for the host's copy of the cache
//! (`shaders/kv_gather.wgsl`): one read back for the whole pass, where there were two copies a KV head and layer
//! (256 a decode step of Llama 3.2 1B).

use super::buffers::{Halves, U32s};
use super::device::grid;
use super::{Pass, module, u32_of, wgsl};
use anyhow::{Result, ensure};

/// Where a layer's rows go in the gathered run and what its caches hold.
pub struct KvRun {
    pub n_head_kv: usize,
    pub hdk: usize,
    pub hdv: usize,
    pub n_ctx: usize,
}

impl KvRun {
    /// Halves a layer's `n` rows take in the run.
    pub fn halves(&self, n: usize) -> usize {
        self.n_head_kv * n * (self.hdk + self.hdv)
    }
}

impl Pass<'_> {
    /// Copies the rows of positions `pos[0]..pos[0] + n` of the caches `kc` and `vc` (`[n_head_kv, n_ctx, hd]`)
    /// into `out` from half `at`: per head, its K rows then its V rows. `pos` holds the batch's positions, in order
    /// from `pos[0]` (its largest value is checked against the caches).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_gather(
        &mut self,
        r: &KvRun,
        kc: &Halves,
        vc: &Halves,
        pos: &U32s,
        n: usize,
        out: &Halves,
        at: usize,
    ) -> Result<()> {
        ensure!(
            r.hdk.is_multiple_of(2) && r.hdv.is_multiple_of(2) && at.is_multiple_of(2),
            "KV rows of odd head sizes ({}, {}) or at an odd half ({at})",
            r.hdk,
            r.hdv
        );
        ensure!(
            !pos.is_empty()
                && (pos.max() as usize) < r.n_ctx
                && n <= pos.len()
                && kc.len() >= r.n_head_kv * r.n_ctx * r.hdk
                && vc.len() >= r.n_head_kv * r.n_ctx * r.hdv
                && at + r.halves(n) <= out.len(),
            "gathering {n} KV rows up to position {} of caches of {} into {} halves from {at}",
            pos.max(),
            r.n_ctx,
            out.len()
        );
        let total = r.halves(n) / 2;
        if total == 0 {
            return Ok(());
        }
        let pipeline = self
            .gpu()
            .pipeline("kv_gather", "gather", &[], || module(&[wgsl::KV_GATHER]))?;
        let (gx, gy) = grid(u32_of(total.div_ceil(256), "KV words")?);
        let params = [
            u32_of(total, "KV words")?,
            u32_of(r.hdk / 2, "head size")?,
            u32_of(r.hdv / 2, "head size")?,
            u32_of(n, "rows")?,
            u32_of(r.n_ctx, "context")?,
            0,
            u32_of(at / 2, "KV offset")?,
            gx,
        ];
        self.dispatch(
            &pipeline,
            &params,
            &[(1, &kc.buf), (2, &vc.buf), (3, &out.buf), (4, &pos.buf)],
            (gx, gy, 1),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use super::KvRun;
    use crate::kernels::testutil::Rng;
    use half::f16;

    /// The gathered run holds, per head, the K rows then the V rows of the positions asked for, bit for bit, at
    /// the offset asked for; the halves around it are untouched.
    #[test]
    fn gathers_each_heads_rows() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2401);
        let r = KvRun {
            n_head_kv: 3,
            hdk: 6,
            hdv: 4,
            n_ctx: 11,
        };
        let k: Vec<f16> = (0..r.n_head_kv * r.n_ctx * r.hdk)
            .map(|_| f16::from_f32(rng.normal()))
            .collect();
        let v: Vec<f16> = (0..r.n_head_kv * r.n_ctx * r.hdv)
            .map(|_| f16::from_f32(rng.normal()))
            .collect();
        let (kc, vc) = (gpu.upload_halves(&k).unwrap(), gpu.upload_halves(&v).unwrap());
        let (pos0, n, at) = (4, 5, 8);
        let out = gpu.zero_halves(at + r.halves(n) + 6).unwrap();
        let pos = gpu
            .upload_u32(&(pos0 as u32..(pos0 + n) as u32).collect::<Vec<_>>())
            .unwrap();
        let mut pass = gpu.pass();
        pass.kv_gather(&r, &kc, &vc, &pos, n, &out, at).unwrap();
        pass.finish().unwrap();
        let mut want = vec![f16::ZERO; at];
        for h in 0..r.n_head_kv {
            let row0 = h * r.n_ctx + pos0;
            want.extend_from_slice(&k[row0 * r.hdk..(row0 + n) * r.hdk]);
            want.extend_from_slice(&v[row0 * r.hdv..(row0 + n) * r.hdv]);
        }
        want.resize(out.len(), f16::ZERO);
        assert_eq!(gpu.read_halves(&out).unwrap(), want);

        let mut pass = gpu.pass();
        let late = gpu.upload_u32(&[7, 8, 9, 10, 11]).unwrap();
        assert!(
            pass.kv_gather(&r, &kc, &vc, &late, 5, &out, at).is_err(),
            "positions past the context"
        );
        assert!(
            pass.kv_gather(&r, &kc, &vc, &pos, n, &out, at + 8).is_err(),
            "a run past the output"
        );
    }
}
