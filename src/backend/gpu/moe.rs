//! A mixture of experts' routing and weighted sum on the device (`shaders/route.wgsl`, `shaders/moe.wgsl`): the
//! router's logits become each row's top-k expert ids and weights in device buffers, which the indexed matmuls
//! (`Pass::matmul_ids`, `matmul.rs`) and [`Pass::moe_sum`] read, so a layer of experts needs no read-back to the
//! host. The semantics are `model::moe::route`'s (tested against it here).

use super::buffers::{Tensor, U32s};
use super::device::grid;
use super::{Pass, module, u32_of, wgsl};
use crate::model::{Gating, Routing};
use anyhow::{Result, ensure};

impl Pass<'_> {
    /// Routes the `n_rows` rows of router logits `logits` (`[n_rows, n_expert]`, overwritten by the probabilities)
    /// as `model::moe::route` does: each row's `k` experts into `ids` and their weights into `wts` (`[n_rows, k]`,
    /// in the row's top-k order), with the selection bias `bias` (`[n_expert]`) where the layer has one.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &mut self,
        logits: &Tensor,
        bias: Option<&Tensor>,
        r: &Routing,
        n_rows: usize,
        n_expert: usize,
        k: usize,
        ids: &U32s,
        wts: &Tensor,
    ) -> Result<()> {
        ensure!(k > 0 && k <= n_expert, "routing {k} experts of {n_expert} a row");
        if r.grouped() {
            ensure!(
                r.n_group <= 64
                    && n_expert.is_multiple_of(r.n_group)
                    && r.n_group_used > 0
                    && r.n_group_used < r.n_group
                    && k <= r.n_group_used * (n_expert / r.n_group),
                "{n_expert} experts in {} groups, {} of them used, cannot give {k} experts",
                r.n_group,
                r.n_group_used
            );
        }
        ensure!(
            logits.len() >= n_rows * n_expert && ids.len() >= n_rows * k && wts.len() >= n_rows * k,
            "routing {n_rows} rows of {n_expert} experts, {k} each: buffers too small"
        );
        if let Some(b) = bias {
            ensure!(
                b.len() >= n_expert,
                "a selection bias of {} for {n_expert} experts",
                b.len()
            );
        }
        if n_rows == 0 {
            return Ok(());
        }
        let pipeline = self.gpu().pipeline("route", "route", &[], || module(&[wgsl::ROUTE]))?;
        let (gx, gy) = grid(u32_of(n_rows.div_ceil(64), "rows")?);
        let grouped = r.grouped();
        let params = [
            u32_of(n_rows, "rows")?,
            u32_of(n_expert, "experts")?,
            u32_of(k, "experts a row")?,
            match r.gating {
                Gating::Softmax => 0,
                Gating::Sigmoid => 1,
            },
            r.normalise as u32,
            r.scale.to_bits(),
            if grouped { u32_of(r.n_group, "groups")? } else { 0 },
            if grouped { u32_of(r.n_group_used, "groups")? } else { 0 },
            bias.is_some() as u32,
            gx,
            0,
            0,
        ];
        // The shader declares the bias whether or not the layer has one: a layer without binds a word it never reads.
        let none;
        let bias = match bias {
            Some(b) => b,
            None => {
                none = self.scratch(1)?;
                &none
            }
        };
        let bufs = [(1, &logits.buf), (2, &bias.buf), (3, &ids.buf), (4, &wts.buf)];
        self.dispatch(&pipeline, &params, &bufs, (gx, gy, 1));
        Ok(())
    }

    /// `y[t] = Σ_j o[t·k + j] · w[t·k + j]` over each row's `k` picks in its top-k order, plus `shared[t]` where
    /// given: the mixture's output, `[n_rows, width]`, from the picks' expert outputs `o` (`[n_rows · k, width]`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_sum(
        &mut self,
        o: &Tensor,
        w: &Tensor,
        shared: Option<&Tensor>,
        n_rows: usize,
        k: usize,
        width: usize,
        y: &Tensor,
    ) -> Result<()> {
        let n = n_rows * width;
        ensure!(
            k > 0 && o.len() >= n * k && w.len() >= n_rows * k && y.len() >= n,
            "a sum of {n_rows} rows of {k} picks of {width}: buffers too small"
        );
        if let Some(s) = shared {
            ensure!(s.len() >= n, "shared experts' output too small");
        }
        if n == 0 {
            return Ok(());
        }
        let entry = if shared.is_some() { "moe_sum_shared" } else { "moe_sum" };
        let pipeline = self.gpu().pipeline("moe", entry, &[], || module(&[wgsl::MOE]))?;
        let (gx, gy) = grid(u32_of(n.div_ceil(256), "values")?);
        let params = [u32_of(n, "values")?, u32_of(width, "width")?, u32_of(k, "picks")?, gx];
        let mut bufs = vec![(1, &o.buf), (2, &w.buf), (3, &y.buf)];
        if let Some(s) = shared {
            bufs.push((4, &s.buf));
        }
        self.dispatch(&pipeline, &params, &bufs, (gx, gy, 1));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::act8::cpu_rounded;
    use super::super::test_gpu;
    use crate::gguf::GgmlType::{self, *};
    use crate::kernels::tests::random_matrix;
    use crate::kernels::testutil::Rng;
    use crate::kernels::{Glu, Matrix};
    use crate::model::moe::tests::routing_case;
    use crate::model::moe::{gate, select};

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// The device's routing is the CPU's (`model::moe::route`), step by step, for random logits on a coarse grid
    /// (so rows hold exact ties, which both break towards the lower index), with and without a selection bias (also
    /// from a few values: ties of score), softmax and sigmoid, with and without groups, renormalisation and a
    /// scale: its probabilities are the CPU's `gate` within 1e-5 relative (the softmax's sum is f32 here, f64 there,
    /// and the two `exp`s differ in the last bits), and from those probabilities it picks the experts, in the
    /// order, that the CPU's `select` picks, their weights within 1e-5 relative. Checked apart because a real GPU's
    /// `exp` (NVIDIA's, seen on an H100 and an H200) can flip a near tie that lavapipe's keeps: two groups whose
    /// scores are the same sums added in another order.
    #[test]
    fn route_matches_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2201);
        let n_rows = 97;
        let mut ties = 0;
        for case in 0..24 {
            let (r, n_x, most) = routing_case(case);
            let k = [1, 2, 4, 6][case % 4].min(most);
            let logits: Vec<f32> = (0..n_rows * n_x)
                .map(|_| ((rng.uniform() * 16.0).floor() - 8.0) * 0.5)
                .collect();
            let bias: Vec<f32> = (0..n_x).map(|_| [0.0, 0.125, -0.25][rng.next() as usize % 3]).collect();
            let bias = (case % 6 >= 3).then_some(&bias[..]);

            let lg = gpu.upload(&logits).unwrap();
            let gb = bias.map(|b| gpu.upload(b).unwrap());
            let ids = gpu.upload_u32(&vec![0; n_rows * k]).unwrap();
            let wts = gpu.zeros(n_rows * k).unwrap();
            let mut pass = gpu.pass();
            pass.route(&lg, gb.as_ref(), &r, n_rows, n_x, k, &ids, &wts).unwrap();
            pass.read(&wts, 0, n_rows * k).unwrap();
            pass.read_u32(&ids, 0, n_rows * k).unwrap();
            pass.read(&lg, 0, n_rows * n_x).unwrap();
            let got = pass.finish_read().unwrap();
            let w = f32s(&got[0]);
            let e: Vec<u32> = got[1]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let probs = f32s(&got[2]);
            for t in 0..n_rows {
                let gpu_probs = &probs[t * n_x..(t + 1) * n_x];
                let mut row = logits[t * n_x..(t + 1) * n_x].to_vec();
                gate(&mut row, r.gating);
                for (x, (g, c)) in gpu_probs.iter().zip(&row).enumerate() {
                    assert!(
                        (g - c).abs() <= 1e-5 * c.abs().max(1e-3),
                        "case {case} {r:?} row {t} expert {x}: probability {g} vs {c}"
                    );
                }
                let mut want = vec![(0, 0.0); k];
                select(gpu_probs, bias, &r, &mut want);
                let mut sorted = logits[t * n_x..(t + 1) * n_x].to_vec();
                sorted.sort_by(f32::total_cmp);
                ties += sorted.windows(2).filter(|p| p[0] == p[1]).count();
                for (j, &(we, ww)) in want.iter().enumerate() {
                    let (ge, gw) = (e[t * k + j] as usize, w[t * k + j]);
                    assert_eq!(ge, we, "case {case} {r:?} k {k} row {t} slot {j}: expert");
                    assert!(
                        (gw - ww).abs() <= 1e-5 * ww.abs().max(1e-3),
                        "case {case} {r:?} row {t} slot {j}: weight {gw} vs {ww}"
                    );
                }
            }
        }
        assert!(ties > 1000, "the logits should hold ties: {ties}");
    }

    /// The weighted sum: each row's picks in order, plus the shared experts' output, as the CPU adds them.
    #[test]
    fn moe_sum_matches_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2202);
        let (n, k, width) = (5, 3, 70);
        let o: Vec<f32> = (0..n * k * width).map(|_| rng.normal()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        let sh: Vec<f32> = (0..n * width).map(|_| rng.normal()).collect();
        for shared in [false, true] {
            let (go, gw, gs) = (
                gpu.upload(&o).unwrap(),
                gpu.upload(&w).unwrap(),
                gpu.upload(&sh).unwrap(),
            );
            let y = gpu.zeros(n * width).unwrap();
            let mut pass = gpu.pass();
            pass.moe_sum(&go, &gw, shared.then_some(&gs), n, k, width, &y).unwrap();
            pass.read(&y, 0, n * width).unwrap();
            let got = f32s(&pass.finish_read().unwrap()[0]);
            for t in 0..n {
                for c in 0..width {
                    let mut s = o[t * k * width + c] * w[t * k];
                    for j in 1..k {
                        s += o[(t * k + j) * width + c] * w[t * k + j];
                    }
                    if shared {
                        s += sh[t * width + c];
                    }
                    let g = got[t * width + c];
                    assert!((g - s).abs() <= 1e-6 * (1.0 + s.abs()), "row {t} col {c}: {g} vs {s}");
                }
            }
        }
    }

    /// The exact product (f64) of expert `e`'s rows of the 2-D view `wf` (`rows` each) with `x`, and the sum of the
    /// products' magnitudes.
    fn expert_dot(wf: &[f32], cols: usize, rows: usize, e: usize, x: &[f32]) -> Vec<(f64, f64)> {
        (0..rows)
            .map(|r| {
                let wr = &wf[(e * rows + r) * cols..(e * rows + r + 1) * cols];
                let p = wr.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64);
                (p.clone().sum(), p.map(f64::abs).sum())
            })
            .collect()
    }

    /// The indexed matmuls equal the exact product of the picked expert's rows (the CPU's dequantization, and its
    /// rounding of an input of several rows) for a
    /// few weight types (F32 with rows of 2.5 units, padded on the device), both lane layouts, whole and in parts
    /// that split experts: the down projection (a pick's own
    /// input row) within the matmuls' tolerance (`1e-5 · Σ|w·x|`), the fused gate/up (a row's input shared by its
    /// k picks; gate and up of different types take the unfused path) through SiLU within that error's effect.
    #[test]
    fn indexed_matmuls_match_the_picked_experts() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2203);
        let (n_x, rows, n, k) = (5, 37, 3, 2);
        let types: [(GgmlType, GgmlType); 4] = [(F32, F32), (Q8_0, Q8_0), (Q4K, Q4K), (Q4K, Q6K)];
        for (ty, ty_up) in types {
            // F32 rows of 80: the last unit half padding (buffers.rs).
            let cols = match ty {
                F32 => 80,
                _ if ty.block_size() == 256 => 256,
                _ => 96,
            };
            let gate = random_matrix(&mut rng, ty, n_x * rows, cols);
            let up = random_matrix(&mut rng, ty_up, n_x * rows, cols);
            let (gf, uf) = (gate.to_f32(), up.to_f32());
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
            // Picks: row t's slots; one row picks an expert twice over the batch, expert 0 and the last are there.
            let picks: Vec<u32> = vec![4, 0, 2, 4, 1, 3];
            let gx = gpu.upload(&x).unwrap();
            let (xg, xu) = (cpu_rounded(ty, &x), cpu_rounded(ty_up, &x));
            // The down projection's shape: each pick its own input row (here its row's, repeated).
            let xd: Vec<f32> = (0..n * k)
                .flat_map(|z| x[(z / k) * cols..(z / k + 1) * cols].to_vec())
                .collect();
            let xd = gpu.upload(&xd).unwrap();
            let ids = gpu.upload_u32(&picks).unwrap();
            let part = |m: &Matrix| m.row_bytes() * 50 + 8;
            for in_parts in [false, true] {
                let up_load = |m: &Matrix| match in_parts {
                    false => gpu.upload_experts(m, n_x).unwrap(),
                    true => gpu.upload_experts_in_parts(m, n_x, part(m)).unwrap(),
                };
                let (gg, gu) = (up_load(&gate), up_load(&up));
                for lanes in [1, 16] {
                    let y = gpu.zeros(n * k * rows).unwrap();
                    let h = gpu.zeros(n * k * rows).unwrap();
                    let mut pass = gpu.pass().with_lanes(lanes);
                    pass.matmul_glu_ids(&gg, &gu, Glu::Silu, &gx, k, &ids, n * k, &h)
                        .unwrap();
                    pass.matmul_ids(&gg, &xd, 1, &ids, n * k, &y).unwrap();
                    pass.read(&y, 0, n * k * rows).unwrap();
                    pass.read(&h, 0, n * k * rows).unwrap();
                    let got = pass.finish_read().unwrap();
                    let (y, h) = (f32s(&got[0]), f32s(&got[1]));
                    for (z, &e) in picks.iter().enumerate() {
                        // An input of several rows is rounded as the CPU's, for each matrix's type (act8.rs).
                        let row = |x: &[f32]| x[(z / k) * cols..(z / k + 1) * cols].to_vec();
                        let g = expert_dot(&gf, cols, rows, e as usize, &row(&xg));
                        let u = expert_dot(&uf, cols, rows, e as usize, &row(&xu));
                        for r in 0..rows {
                            let what = format!("{ty}/{ty_up} parts {in_parts} lanes {lanes} pick {z} row {r}");
                            let (gv, gm) = g[r];
                            let (uv, um) = u[r];
                            let got_y = y[z * rows + r] as f64;
                            assert!((got_y - gv).abs() <= 1e-5 * gm + 1e-6, "{what}: {got_y} vs {gv}");
                            let silu = gv / (1.0 + (-gv).exp());
                            let want = silu * uv;
                            let tol = 2e-5 * (1.2 * uv.abs() * gm + (gv.abs() + 0.3) * um) + 1e-6;
                            let got_h = h[z * rows + r] as f64;
                            assert!((got_h - want).abs() <= tol, "{what}: glu {got_h} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
