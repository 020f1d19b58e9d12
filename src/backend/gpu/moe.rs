//! A mixture of experts' routing and weighted sum on the device (`shaders/route.wgsl`, `shaders/moe.wgsl`): the
//! router's logits become each row's top-k expert ids and weights in device buffers, which the indexed matmuls
//! (`Pass::matmul_ids`, `matmul.rs`) and [`Pass::moe_sum`] read, so a layer of experts needs no read-back to the
//! host. The semantics are `model::moe::route`'s (tested against it here). A batch's picks are grouped by expert
//! on the device ([`Pass::picks`], `shaders/picks.wgsl`), so its indexed matmuls take the tiled kernel and read
//! each picked expert's weights once per 64 picks of it, not once per pick.

use super::buffers::{Tensor, U32s};
use super::device::grid;
use super::{Gpu, Pass, env_number, module, u32_of, wgsl};
use crate::model::{Gating, Routing};
use anyhow::{Result, ensure};

/// The most experts a layer may have for its picks to be grouped on the device (`MAX_EXPERTS` in `picks.wgsl`,
/// workgroup memory); a layer of more takes the per-pick mat-vecs at every batch size.
pub const MAX_GROUPED_EXPERTS: usize = 1024;

/// Whether a batch's picks are grouped by expert for the tiled kernel ([`Pass::picks`]): `BATON_GPU_GROUP=0` keeps
/// the per-pick mat-vecs at every batch size, to compare; else on. Read once.
fn group_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| env_number("BATON_GPU_GROUP", |v| *v <= 1, 1) == 1)
}

/// Picks a tile of the grouped picks takes (`TILE` in `picks.wgsl`, the tiled matmul's tokens a tile).
const PICKS_A_TILE: usize = 64;

/// A batch's expert picks as the indexed matmuls (`Pass::matmul_ids`, matmul.rs) read them: `n` expert ids in
/// `ids` (`[rows, k]`, each row's in its top-k order) and, where the batch takes the tiled kernel, the same picks
/// grouped by expert ([`Pass::picks`]).
pub struct Picks<'a> {
    pub ids: &'a U32s,
    pub n: usize,
    pub(super) grouped: Option<Grouped<'a>>,
}

/// Picks grouped by expert on the device, and the tiles the grouped matmuls' grid covers.
#[derive(Clone, Copy)]
pub(super) struct Grouped<'a> {
    pub groups: &'a PickGroups,
    pub tiles: usize,
}

impl<'a> Picks<'a> {
    /// The picks as they are: each takes a mat-vec of its expert (a decode step's k picks).
    pub fn each(ids: &'a U32s, n: usize) -> Picks<'a> {
        Picks { ids, n, grouped: None }
    }
}

/// The device buffers a batch's picks are grouped into (`picks.wgsl`): `order`, the picks expert by expert, and
/// `tiles`, three words a tile; sized once for a session's largest batch.
pub struct PickGroups {
    order: U32s,
    tiles: U32s,
    n_expert: usize,
}

impl PickGroups {
    /// Buffers for up to `n_picks` picks of `n_expert` experts.
    pub fn new(gpu: &Gpu, n_picks: usize, n_expert: usize) -> Result<PickGroups> {
        Ok(PickGroups {
            order: gpu.upload_u32(&vec![0; n_picks.max(1)])?,
            tiles: gpu.upload_u32(&vec![0; 3 * max_tiles(n_picks, n_expert).max(1)])?,
            n_expert,
        })
    }

    pub(super) fn order(&self) -> &U32s {
        &self.order
    }

    pub(super) fn tiles(&self) -> &U32s {
        &self.tiles
    }
}

/// Tiles `n_picks` picks of `n_expert` experts take at most, however they are routed: every expert's run ends in
/// at most one tile that is not full.
fn max_tiles(n_picks: usize, n_expert: usize) -> usize {
    n_picks.div_ceil(PICKS_A_TILE) + n_expert.min(n_picks)
}

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

    /// The `n_rows · k` picks in `ids` (of `n_expert` experts) for the indexed matmuls: where a batch of `n_rows`
    /// rows takes the tiled kernel (as a dense matmul over it would, `tiled_min`) and the layer has at most
    /// [`MAX_GROUPED_EXPERTS`], grouped by expert into `groups` on the device (one dispatch), unless
    /// `BATON_GPU_GROUP=0`; else as they are.
    pub fn picks<'a>(
        &mut self,
        ids: &'a U32s,
        n_rows: usize,
        k: usize,
        n_expert: usize,
        groups: &'a PickGroups,
    ) -> Result<Picks<'a>> {
        let n = n_rows * k;
        ensure!(ids.len() >= n, "{n} picks with {} expert ids", ids.len());
        if !group_on() || n_rows < self.tiled_min || n_expert > MAX_GROUPED_EXPERTS || n == 0 {
            return Ok(Picks::each(ids, n));
        }
        let tiles = max_tiles(n, n_expert);
        ensure!(
            groups.n_expert == n_expert && groups.order.len() >= n && groups.tiles.len() >= 3 * tiles,
            "grouping {n} picks of {n_expert} experts into buffers for {} picks of {}",
            groups.order.len(),
            groups.n_expert
        );
        let pipeline = self
            .gpu()
            .pipeline("picks", "group_picks", &[], || module(&[wgsl::PICKS]))?;
        let params = [
            u32_of(n, "expert picks")?,
            u32_of(n_expert, "experts")?,
            u32_of(tiles, "tiles")?,
            0,
        ];
        let bufs = [(1, &ids.buf), (2, &groups.order.buf), (3, &groups.tiles.buf)];
        self.dispatch(&pipeline, &params, &bufs, (1, 1, 1));
        Ok(Picks {
            ids,
            n,
            grouped: Some(Grouped { groups, tiles }),
        })
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
    use super::{PickGroups, max_tiles};
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
    /// rounding of an input of several rows) for a few weight types (F32 with rows of 2.5 units, padded on the
    /// device), whole and in parts of 50 rows that split experts (and, at 2 and 4 rows a thread, a thread's rows), on
    /// the per-pick kernel in the software layout and at 16 lanes with 2 and 4 rows a thread, and on the tiled
    /// kernel over the picks grouped on the device: the down projection (a pick's own input row) within the
    /// matmuls' tolerance (`1e-5 · Σ|w·x|`), the fused gate/up (a row's input shared by its k picks; gate and up of
    /// different types take the unfused path) through SiLU within that error's effect. Two batches: 3 rows, and 70
    /// whose every row picks the last expert (two tiles of it, the second of 6 picks) and one of the others.
    #[test]
    fn indexed_matmuls_match_the_picked_experts() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2203);
        let (n_x, rows, k) = (5, 37, 2);
        let types: [(GgmlType, GgmlType); 4] = [(F32, F32), (Q8_0, Q8_0), (Q4K, Q4K), (Q4K, Q6K)];
        // Row t's slots; in the small batch one row picks an expert twice over the batch, expert 0 and the last are
        // there.
        let batches: [Vec<u32>; 2] = [
            vec![4, 0, 2, 4, 1, 3],
            (0..70u32).flat_map(|t| [4, (t * 7) % 4]).collect(),
        ];
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
            let part = |m: &Matrix| m.row_bytes() * 50 + 8;
            let whole = (
                gpu.upload_experts(&gate, n_x).unwrap(),
                gpu.upload_experts(&up, n_x).unwrap(),
            );
            let parted = (
                gpu.upload_experts_in_parts(&gate, n_x, part(&gate)).unwrap(),
                gpu.upload_experts_in_parts(&up, n_x, part(&up)).unwrap(),
            );
            for picks in &batches {
                let n = picks.len() / k;
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normal()).collect();
                let gx = gpu.upload(&x).unwrap();
                let (xg, xu) = (cpu_rounded(ty, &x), cpu_rounded(ty_up, &x));
                // The down projection's shape: each pick its own input row (here its row's, repeated).
                let xd: Vec<f32> = (0..n * k)
                    .flat_map(|z| x[(z / k) * cols..(z / k + 1) * cols].to_vec())
                    .collect();
                let xd = gpu.upload(&xd).unwrap();
                let ids = gpu.upload_u32(picks).unwrap();
                let groups = PickGroups::new(&gpu, n * k, n_x).unwrap();
                for (in_parts, (gg, gu)) in [(false, &whole), (true, &parted)] {
                    // (lanes, mat-vec rows a thread, tiled): the per-pick kernel in the software adapter's layout,
                    // with a K-quant block's 16 lanes and 2 or 4 rows a thread (a Q8_0 block's 4 lanes 4 times
                    // over), and the tiled one.
                    for (lanes, mv_rows, tiled) in [(1, 1, false), (16, 2, false), (16, 4, false), (1, 1, true)] {
                        let y = gpu.zeros(n * k * rows).unwrap();
                        let h = gpu.zeros(n * k * rows).unwrap();
                        let tiled_min = if tiled { 1 } else { usize::MAX };
                        let mut pass = gpu
                            .pass()
                            .with_lanes(lanes)
                            .with_mv_rows(mv_rows)
                            .with_tiled_min(tiled_min);
                        let p = pass.picks(&ids, n, k, n_x, &groups).unwrap();
                        assert_eq!(p.grouped.is_some(), tiled);
                        pass.matmul_glu_ids(gg, gu, Glu::Silu, &gx, k, &p, &h).unwrap();
                        pass.matmul_ids(gg, &xd, 1, &p, &y).unwrap();
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
                                let what = format!(
                                    "{ty}/{ty_up} {n} rows, parts {in_parts} kernel {lanes}x{mv_rows} tiled {tiled} pick {z} row {r}"
                                );
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

    /// The grouped picks on the matrix units (`matmul_coop.wgsl` over `tiled_picks.wgsl`): the down projection
    /// within `TOL_F16` of the exact product of its f16 inputs (matmul.rs), the fused gate/up through SiLU, for 70
    /// rows of 2 picks (every row the last expert: two tiles of it) over 5 experts of 37 rows, whole and in parts of
    /// 50 rows, for Q8_0, Q4_K and a Q4_K gate with a Q6_K up (each on the units, then the activation). SKIPPED
    /// without matrix units (scripts/test-coopmat runs it on Mesa 26's lavapipe).
    #[test]
    fn coop_grouped_picks_match_f16_products() {
        use super::super::matmul::Rows;
        use super::super::matmul::tests::{TOL_F16, assert_glu, f16_reference};
        let Some(gpu) = super::super::coop::test_units() else {
            return;
        };
        let mut rng = Rng(2205);
        let (n_x, rows, k, n) = (5, 37, 2, 70);
        let picks: Vec<u32> = (0..n as u32).flat_map(|t| [4, (t * 7) % 4]).collect();
        for (ty, ty_up) in [(Q8_0, Q8_0), (Q4K, Q4K), (Q4K, Q6K)] {
            let cols = if ty.block_size() == 256 { 256 } else { 96 };
            let gate = random_matrix(&mut rng, ty, n_x * rows, cols);
            let up = random_matrix(&mut rng, ty_up, n_x * rows, cols);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normal() * 0.3).collect();
            let xd: Vec<f32> = (0..n * k)
                .flat_map(|z| x[(z / k) * cols..(z / k + 1) * cols].to_vec())
                .collect();
            // The references over every row of the experts' view, for each input row, then each pick's.
            let view = n_x * rows;
            let pick = |r: &[f64], per_pick: bool| -> Vec<f64> {
                (0..n * k)
                    .flat_map(|z| {
                        let at = if per_pick { z } else { z / k } * view + picks[z] as usize * rows;
                        r[at..at + rows].to_vec()
                    })
                    .collect()
            };
            let (ge, _, gm) = f16_reference(&gate, &x, n);
            let (ue, _, um) = f16_reference(&up, &x, n);
            let (de, _, dm) = f16_reference(&gate, &xd, n * k);
            let (ge, gm, ue, um) = (pick(&ge, false), pick(&gm, false), pick(&ue, false), pick(&um, false));
            let (de, dm) = (pick(&de, true), pick(&dm, true));
            let (gx, gxd) = (gpu.upload(&x).unwrap(), gpu.upload(&xd).unwrap());
            let ids = gpu.upload_u32(&picks).unwrap();
            let groups = PickGroups::new(&gpu, n * k, n_x).unwrap();
            for part in [0, 50] {
                let load = |m: &Matrix| match part {
                    0 => gpu.upload_experts(m, n_x).unwrap(),
                    _ => gpu.upload_experts_in_parts(m, n_x, part * m.row_bytes() + 8).unwrap(),
                };
                let (gg, gu) = (load(&gate), load(&up));
                let (y, h) = (gpu.zeros(n * k * rows).unwrap(), gpu.zeros(n * k * rows).unwrap());
                let mut pass = gpu.pass().with_coop(true).with_tiled_min(1);
                assert!(pass.takes_coop(&gg.mat, n), "{ty}");
                // The kernels compile (a failure would leave the f32 kernel, whose sums pass too).
                for entry in ["matmul", "matmul_glu"] {
                    pass.coop_pipeline(ty, entry, Rows::Picks).unwrap();
                }
                let p = pass.picks(&ids, n, k, n_x, &groups).unwrap();
                assert!(p.grouped.is_some());
                pass.matmul_glu_ids(&gg, &gu, Glu::Silu, &gx, k, &p, &h).unwrap();
                pass.matmul_ids(&gg, &gxd, 1, &p, &y).unwrap();
                pass.read(&y, 0, n * k * rows).unwrap();
                pass.read(&h, 0, n * k * rows).unwrap();
                let got = pass.finish_read().unwrap();
                let (y, h) = (f32s(&got[0]), f32s(&got[1]));
                let what = format!("{ty}/{ty_up} part {part} on the matrix units");
                for (i, &g) in y.iter().enumerate() {
                    let g = g as f64;
                    assert!(
                        (g - de[i]).abs() <= TOL_F16 * dm[i] + 1e-6,
                        "{what} down out {i}: {g} vs f16 {}",
                        de[i]
                    );
                }
                assert_glu(&h, Glu::Silu, (&ge, &gm), (&ue, &um), TOL_F16, &what);
                assert!(gpu.coop() > 0, "{what}: the device gave up its matrix units");
            }
        }
    }

    /// The grouping (`picks.wgsl`) for random routings, some with every pick on one expert and some with ids
    /// past the experts: `order` holds each valid pick once, expert by expert in ascending order, and `tiles`
    /// cuts each expert's run into tiles of 64 picks (the last shorter), in order, then marks the rest of the
    /// grid empty; a batch under `tiled_min` rows is not grouped.
    #[test]
    fn picks_group_by_expert() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2204);
        let u32s = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        for (case, (n_rows, k, n_x)) in [(1, 1, 1), (3, 2, 5), (100, 8, 128), (300, 4, 7), (70, 1, 1024)]
            .into_iter()
            .enumerate()
        {
            let n = n_rows * k;
            let ids: Vec<u32> = (0..n)
                .map(|_| match case {
                    3 => 2,
                    4 => [0, 1023, 1024][rng.next() as usize % 3],
                    _ => (rng.next() % n_x as u64) as u32,
                })
                .collect();
            let groups = PickGroups::new(&gpu, n, n_x).unwrap();
            let gids = gpu.upload_u32(&ids).unwrap();
            let mut pass = gpu.pass().with_tiled_min(2);
            let p = pass.picks(&gids, n_rows, k, n_x, &groups).unwrap();
            let Some(g) = p.grouped else {
                assert!(n_rows < 2, "case {case}: {n_rows} rows not grouped");
                continue;
            };
            assert_eq!(g.tiles, max_tiles(n, n_x));
            pass.read_u32(groups.order(), 0, n).unwrap();
            pass.read_u32(groups.tiles(), 0, 3 * g.tiles).unwrap();
            let got = pass.finish_read().unwrap();
            let (order, tiles) = (u32s(&got[0]), u32s(&got[1]));
            let valid: Vec<usize> = (0..n).filter(|&z| (ids[z] as usize) < n_x).collect();
            // The runs: each valid pick once, experts ascending.
            let run = &order[..valid.len()];
            let mut seen = run.to_vec();
            seen.sort();
            assert_eq!(
                seen,
                valid.iter().map(|&z| z as u32).collect::<Vec<_>>(),
                "case {case}: the picks"
            );
            assert!(
                run.windows(2).all(|w| ids[w[0] as usize] <= ids[w[1] as usize]),
                "case {case}: runs out of expert order"
            );
            // The tiles: expert by expert, each run's picks in tiles of 64.
            let mut want = Vec::new();
            let mut at = 0u32;
            for e in 0..n_x as u32 {
                let c = valid.iter().filter(|&&z| ids[z] == e).count() as u32;
                for j in (0..c).step_by(64) {
                    want.extend([e, at + j, (c - j).min(64)]);
                }
                at += c;
            }
            assert!(want.len() <= 3 * g.tiles, "case {case}: more tiles than the grid");
            while want.len() < 3 * g.tiles {
                want.extend([u32::MAX, 0, 0]);
            }
            assert_eq!(tiles, want, "case {case}: tiles");
        }
    }
}
