//! RoPE, both styles, over the CPU's angle table, fused with what surrounds it in a layer (`shaders/rope.wgsl`):
//! one dispatch adds Q, K and V's biases, RMS-normalises the Q and K heads, rotates them and stores K and V into
//! the f16 cache, where these were five to nine dispatches. A decode step's attention does the same work itself
//! (`attention::Queries::Fresh`), from the same shader functions (`shaders/qkv_head.wgsl`).

use super::buffers::{Halves, Tensor, U32s};
use super::device::{Gpu, grid};
use super::{Pass, module, u32_of, wgsl};
use crate::backend::AttnShape;
use crate::kernels::ops::RopeTable;
use anyhow::{Result, ensure};

/// A [`RopeTable`] on the device: (cos, sin) of each rotated pair at each position.
pub struct GpuRope {
    buf: wgpu::Buffer,
    half: usize,
    n_ctx: usize,
}

/// A layer's vectors applied to its Q, K and V heads before attention, in one buffer (so [`Pass::rope_store`] binds
/// eight storage buffers, the portable limit): the biases (Qwen 2) and the Q and K head norms' weights (Qwen 3,
/// Gemma 3), each an (offset, length) where the layer has it.
pub struct QkvExtras {
    buf: Tensor,
    bias: [Option<(usize, usize)>; 3],
    norm: Option<[(usize, usize); 2]>,
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

    /// Uploads a layer's Q, K and V biases and Q and K norm weights, those it has, into one buffer.
    pub fn upload_qkv_extras(&self, bias: [Option<&[f32]>; 3], norm: Option<[&[f32]; 2]>) -> Result<QkvExtras> {
        let mut all = Vec::new();
        let mut put = |v: &[f32]| {
            all.extend_from_slice(v);
            (all.len() - v.len(), v.len())
        };
        let bias = bias.map(|b| b.map(&mut put));
        let norm = norm.map(|n| n.map(&mut put));
        // A buffer of no values cannot be bound.
        if all.is_empty() {
            all.push(0.0);
        }
        Ok(QkvExtras {
            buf: self.upload(&all)?,
            bias,
            norm,
        })
    }
}

fn source() -> String {
    module(&[wgsl::F16, wgsl::REDUCE, wgsl::QKV_HEAD, wgsl::ROPE])
}

/// A shader's offset of an optional vector, checked to be `len` long.
fn offset(v: Option<(usize, usize)>, len: usize, what: &str) -> Result<u32> {
    match v {
        None => Ok(u32::MAX),
        Some((at, n)) => {
            ensure!(n == len, "{what} of {n} values where {len} are needed");
            u32_of(at, what)
        }
    }
}

/// Halves one layer's K and V rows of a batch take in the run read back for the host's cache.
pub fn fresh_halves(a: &AttnShape) -> usize {
    a.n_head_kv * a.n_tok * (a.hdk + a.hdv)
}

/// What makes a layer's Q, K and V heads ready for attention (`shaders/qkv_head.wgsl`), as the CPU's
/// `model::blocks` does, for [`Pass::rope_store`] and a decode step's attention (`attention::Queries::Fresh`).
pub struct Ready<'a> {
    /// The rows' projections, each row Q `[n_head, hdk]`, K `[n_head_kv, hdk]` and V `[n_head_kv, hdv]` side by
    /// side, as the stacked projections write them.
    pub qkv: &'a Tensor,
    /// The layer's biases, added to each head, and Q and K head norms (with `eps`), where it has them.
    pub extras: &'a QkvExtras,
    pub eps: f32,
    /// The angles Q and K are rotated by; `neox`: the halves of a head rather than adjacent pairs.
    pub table: &'a GpuRope,
    pub neox: bool,
    /// The first dimension of a Q or K head that RoPE turns: 0, or DeepSeek's unrotated part (`Mla::n_nope`),
    /// whose heads end in their rotated dimensions.
    pub rot_at: usize,
    /// The run the host's copy of the cache is read back from, and the half this layer's rows start at (per KV
    /// head, its K rows at the batch's positions, then its V rows).
    pub fresh: (&'a Halves, usize),
}

impl Ready<'_> {
    /// Checks the shapes against `a`'s rows, the caches `kc`/`vc` of `n_ctx` positions and the positions `pos`,
    /// and gives the words qkv_head.wgsl reads from its module's Params (`half_rot` to `fresh_at`).
    pub(super) fn words(&self, a: &AttnShape, [kc, vc]: [&Halves; 2], n_ctx: usize, pos: &U32s) -> Result<[u32; 11]> {
        let (n, hq, hkv) = (a.n_tok, a.n_head, a.n_head_kv);
        let (table, (fresh, fresh_at)) = (self.table, self.fresh);
        ensure!(
            a.hdk.is_multiple_of(2) && a.hdv.is_multiple_of(2) && a.hdk <= 256 && a.hdv <= 256,
            "the GPU takes even head sizes up to 256, not {} and {}",
            a.hdk,
            a.hdv
        );
        ensure!(
            self.rot_at + 2 * table.half <= a.hdk,
            "RoPE rotates {} values from {} of a head of {}",
            2 * table.half,
            self.rot_at,
            a.hdk
        );
        ensure!(self.qkv.len() >= n * a.qkv_width(), "Q, K and V smaller than {n} rows");
        ensure!(
            kc.len() >= hkv * n_ctx * a.hdk && vc.len() >= hkv * n_ctx * a.hdv,
            "KV cache smaller than {hkv} heads of {n_ctx} positions"
        );
        ensure!(pos.len() >= n, "{n} rows given {} positions", pos.len());
        ensure!(
            fresh_at.is_multiple_of(2) && fresh_at + fresh_halves(a) <= fresh.len(),
            "{n} rows' K and V from half {fresh_at} past a run of {}",
            fresh.len()
        );
        ensure!(
            (pos.max() as usize) < n_ctx.min(table.n_ctx),
            "position {} past a cache of {n_ctx} or a RoPE table of {}",
            pos.max(),
            table.n_ctx
        );
        let extras = self.extras;
        let [bq, bk, bv] = extras.bias;
        let (qn, kn) = match extras.norm {
            Some([qn, kn]) => (Some(qn), Some(kn)),
            None => (None, None),
        };
        Ok([
            u32_of(table.half, "rotated pairs")?,
            self.neox as u32,
            u32_of(table.n_ctx, "positions")?,
            self.eps.to_bits(),
            offset(bq, hq * a.hdk, "Q bias")?,
            offset(bk, hkv * a.hdk, "K bias")?,
            offset(bv, hkv * a.hdv, "V bias")?,
            offset(qn, a.hdk, "Q norm")?,
            offset(kn, a.hdk, "K norm")?,
            u32_of(fresh_at / 2, "KV run offset")?,
            u32_of(self.rot_at, "first rotated dimension")?,
        ])
    }

    /// The buffers qkv_head.wgsl binds, with the caches `kc` and `vc`.
    pub(super) fn bufs<'b>(&'b self, [kc, vc]: [&'b Halves; 2]) -> [(u32, &'b wgpu::Buffer); 6] {
        [
            (2, &self.qkv.buf),
            (3, &self.fresh.0.buf),
            (4, &kc.buf),
            (5, &vc.buf),
            (6, &self.table.buf),
            (8, &self.extras.buf.buf),
        ]
    }
}

impl Pass<'_> {
    /// Readies the `a.n_tok` rows of `r.qkv` for attention, row `t` at position `pos[t]` (see [`Ready`]): Q goes
    /// to `q` (`[n_tok, n_head, hdk]`); K and V into the f16 caches `kc` and `vc` (`[n_head_kv, n_ctx, hd]`) at the
    /// rows' positions, and into the host's run.
    pub fn rope_store(
        &mut self,
        r: &Ready,
        a: &AttnShape,
        q: &Tensor,
        kv: [&Halves; 2],
        n_ctx: usize,
        pos: &U32s,
    ) -> Result<()> {
        let ready = r.words(a, kv, n_ctx, pos)?;
        let (n, hq, hkv) = (a.n_tok, a.n_head, a.n_head_kv);
        ensure!(q.len() >= n * hq * a.hdk, "rotated Q smaller than {n} rows");
        let workgroups = n * (hq + 2 * hkv);
        if workgroups == 0 {
            return Ok(());
        }
        let pipeline = self.reducing_pipeline("rope", "rope_store", &[], source)?;
        let (gx, gy) = grid(u32_of(workgroups, "heads")?);
        let mut params = vec![
            u32_of(n, "rows")?,
            u32_of(hq, "heads")?,
            u32_of(hkv, "KV heads")?,
            u32_of(a.hdk, "head size")?,
            u32_of(a.hdv, "head size")?,
            u32_of(n_ctx, "context")?,
            gx,
        ];
        params.extend(ready);
        let mut bufs = vec![(1, &q.buf), (7, &pos.buf)];
        bufs.extend(r.bufs(kv));
        self.dispatch(&pipeline, &params, &bufs, (gx, gy, 1));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Pass, test_gpu};
    use super::{Ready, fresh_halves};
    use crate::backend::AttnShape;
    use crate::kernels::ops::{self, RopeTable};
    use crate::kernels::testutil::Rng;
    use half::f16;

    /// The fused op against the CPU's ops it replaces (`model::blocks`: bias, head norm, RoPE, f16 store), with and
    /// without biases and norms, both RoPE styles, partial rotation and full, of a head's first dimensions or its
    /// last (DeepSeek's), GQA, rows at scattered positions. Q
    /// within 4e-6 of 1 + its magnitude (the CPU sums a norm's squares in f64; a rotation is a product and a sum,
    /// maybe fused); the cache within one f16 step of the CPU's f16 of its K and V, the other positions untouched.
    #[test]
    fn rope_store_matches_cpu_ops() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2130);
        let (n_head, n_head_kv, hd, n_ctx) = (6, 2, 64, 300);
        let pos = [0u32, 7, 255, 299];
        let n = pos.len();
        let gp = gpu.upload_u32(&pos).unwrap();
        let a = AttnShape {
            n_tok: n,
            n_head,
            n_head_kv,
            hdk: hd,
            hdv: hd,
            window: None,
            scale: 1.0,
        };
        let eps = 1e-6;
        for (n_rot, rot_at, biased, normed) in [
            (64, 0, false, false),
            (32, 0, true, false),
            (64, 0, false, true),
            (32, 0, true, true),
            (16, 48, false, false),
            (32, 32, true, true),
        ] {
            let table = RopeTable::new(10000.0, n_rot, n_ctx);
            let gt = gpu.upload_rope(&table).unwrap();
            let normal = |rng: &mut Rng, len: usize, s: f32| (0..len).map(|_| rng.normal() * s).collect::<Vec<f32>>();
            let q = normal(&mut rng, n * n_head * hd, 2.0);
            let k = normal(&mut rng, n * n_head_kv * hd, 2.0);
            let v = normal(&mut rng, n * n_head_kv * hd, 2.0);
            let bias = [n_head, n_head_kv, n_head_kv].map(|h| normal(&mut rng, h * hd, 0.5));
            let norm = [0, 1].map(|_| (0..hd).map(|_| 1.0 + rng.normal() * 0.2).collect::<Vec<f32>>());
            let old: Vec<f16> = (0..n_head_kv * n_ctx * hd)
                .map(|_| f16::from_f32(rng.normal()))
                .collect();
            for neox in [false, true] {
                // The CPU's ops, head by head.
                let prep = |x: &[f32], heads: usize, b: &[f32], w: Option<&[f32]>, rotate: bool| {
                    let mut x = x.to_vec();
                    for row in x.chunks_mut(heads * hd) {
                        if biased {
                            ops::add_inplace(row, b);
                        }
                    }
                    for (i, head) in x.chunks_mut(hd).enumerate() {
                        if let Some(w) = w {
                            ops::rms_norm_inplace(head, w, eps);
                        }
                        if rotate {
                            table.apply(&mut head[rot_at..], pos[i / heads] as usize, neox);
                        }
                    }
                    x
                };
                let w = |i: usize| normed.then_some(&norm[i][..]);
                let want_q = prep(&q, n_head, &bias[0], w(0), true);
                let cache = |x: Vec<f32>| {
                    let mut c = old.clone();
                    for (t, &p) in pos.iter().enumerate() {
                        for h in 0..n_head_kv {
                            for i in 0..hd {
                                c[(h * n_ctx + p as usize) * hd + i] = f16::from_f32(x[(t * n_head_kv + h) * hd + i]);
                            }
                        }
                    }
                    c
                };
                let want_k = cache(prep(&k, n_head_kv, &bias[1], w(1), true));
                let want_v = cache(prep(&v, n_head_kv, &bias[2], None, false));

                let extras = gpu
                    .upload_qkv_extras(
                        [0, 1, 2].map(|i| biased.then_some(&bias[i][..])),
                        normed.then_some([&norm[0][..], &norm[1][..]]),
                    )
                    .unwrap();
                // Each row's Q, K and V side by side, as the stacked projections write them.
                let rows = (0..n).flat_map(|t| {
                    let (qw, kw) = (n_head * hd, n_head_kv * hd);
                    [
                        &q[t * qw..(t + 1) * qw],
                        &k[t * kw..(t + 1) * kw],
                        &v[t * kw..(t + 1) * kw],
                    ]
                });
                let qkv: Vec<f32> = rows.flatten().copied().collect();
                let (gqkv, gq) = (gpu.upload(&qkv).unwrap(), gpu.zeros(q.len()).unwrap());
                let (kc, vc) = (gpu.upload_halves(&old).unwrap(), gpu.upload_halves(&old).unwrap());
                // The run for the host's copy, this layer's after another's (`at` halves in).
                let at = 2 * n_head_kv * n * hd;
                let fresh = gpu.zero_halves(at + fresh_halves(&a)).unwrap();
                // The head norm's sum by subgroups in one style, by the workgroup-memory tree in the other.
                let sg = neox;
                let mut pass = gpu.pass().with_subgroups(sg);
                let rs = |pass: &mut Pass, n_ctx, at| {
                    let ready = Ready {
                        qkv: &gqkv,
                        extras: &extras,
                        eps,
                        table: &gt,
                        neox,
                        rot_at,
                        fresh: (&fresh, at),
                    };
                    pass.rope_store(&ready, &a, &gq, [&kc, &vc], n_ctx, &gp)
                };
                rs(&mut pass, n_ctx, at).unwrap();
                assert!(rs(&mut pass, 299, at).is_err(), "a position past the cache is refused");
                assert!(
                    rs(&mut pass, n_ctx, at + 2).is_err(),
                    "a run past its buffer is refused"
                );
                pass.finish().unwrap();
                let case = format!("rot {n_rot} from {rot_at} bias {biased} norm {normed} neox {neox} subgroups {sg}");
                for (i, (g, e)) in gpu.read(&gq).unwrap().iter().zip(&want_q).enumerate() {
                    assert!((g - e).abs() <= 4e-6 * (1.0 + e.abs()), "{case}: Q at {i}: {g} vs {e}");
                }
                // Per KV head, its K rows at the batch's positions, then its V rows, as the caches hold them.
                let run: Vec<f16> = (0..n_head_kv)
                    .flat_map(|h| {
                        let rows = |c: &[f16]| {
                            pos.map(|p| (h * n_ctx + p as usize) * hd)
                                .map(|r| c[r..r + hd].to_vec())
                        };
                        rows(&want_k).into_iter().chain(rows(&want_v)).flatten()
                    })
                    .collect();
                let got_run = gpu.read_halves(&fresh).unwrap()[at..].to_vec();
                for (what, got, want) in [
                    ("K", gpu.read_halves(&kc).unwrap(), &want_k),
                    ("V", gpu.read_halves(&vc).unwrap(), &want_v),
                    ("the host's run", got_run, &run),
                ] {
                    for (i, (g, e)) in got.iter().zip(want).enumerate() {
                        // Rounded to f16 as the CPU rounds, from f32 values that may differ by an ulp (the
                        // rotation's and the norm's order of sums): one f16 step at most.
                        let step = (e.to_f32().abs() * 2f32.powi(-10)).max(6e-8);
                        assert!(
                            (g.to_f32() - e.to_f32()).abs() <= step,
                            "{case}: {what} cache at {i}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }
}
