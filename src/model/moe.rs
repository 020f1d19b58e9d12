//! The mixture-of-experts feed-forward (`qwen3moe`; llama.cpp's `build_moe_ffn`): a router scores every expert for
//! each row, the row runs its top-k experts' gated feed-forwards, and their outputs are summed with the routing
//! weights.
//!
//! - **Weights stay where they are.** An expert tensor is one 3-D tensor in the file (`[cols, rows, n_expert]`);
//!   expert e's matrix is rows `e*rows..(e+1)*rows` of its 2-D view, and [`Experts`] holds one view per expert into
//!   the memory map: nothing is copied, and the pages of experts no token picks are never read.
//! - **Routing is data** ([`super::hparams::Routing`]): the gating function, renormalisation, scale and shared experts
//!   are fields, so another architecture's routing is another value, not another layer.
//! - **Grouped by expert.** A batch's rows are sorted by the experts they picked; each picked expert runs its matmuls
//!   once over its gathered rows (so its weights are read once per batch), and the weighted outputs are added back to
//!   their rows in each row's own top-k order: a row gets the same bits alone (decode, which reads only its k experts)
//!   or in any batch.

use super::blocks::{Buffers, Step, project};
use super::hparams::{Gating, Moe, Routing};
use crate::gguf::{GgufFile, TensorInfo};
use crate::kernels::matrix::{Bytes, Layout};
use crate::kernels::{Glu, Matrix};
use anyhow::{Result, bail};
use std::sync::Arc;

/// One expert tensor: `n_expert` matrices of the same shape, each a view of its rows of the mapped 3-D tensor.
pub struct Experts {
    pub mats: Vec<Matrix>,
}

impl Experts {
    /// The 3-D tensor `info` (llama.cpp's `{cols, rows, n_expert}`) as one view per expert, its shape checked.
    pub fn mapped(
        file: &Arc<GgufFile>,
        info: &TensorInfo,
        cols: usize,
        rows: usize,
        n_expert: usize,
    ) -> Result<Experts> {
        let name = &info.name;
        let dims: Vec<u64> = info.dims.clone();
        if dims != [cols as u64, rows as u64, n_expert as u64] {
            bail!("expert tensor {name:?} has dimensions {dims:?}, expected [{cols}, {rows}, {n_expert}]");
        }
        if !crate::kernels::matrix::supports(info.ty) {
            bail!(
                "expert tensor {name:?} has type {} which Baton cannot compute with",
                info.ty
            );
        }
        let Some(row_bytes) = info.ty.row_bytes(cols) else {
            bail!(
                "expert tensor {name:?}: rows of {cols} do not fill whole {} blocks",
                info.ty
            );
        };
        let bytes = rows * row_bytes;
        if bytes * n_expert != info.size {
            bail!(
                "expert tensor {name:?} holds {} bytes, expected {n_expert} experts of {bytes}",
                info.size
            );
        }
        let mats = (0..n_expert)
            .map(|e| Matrix {
                ty: info.ty,
                rows,
                cols,
                data: Bytes::Mapped {
                    file: file.clone(),
                    offset: info.offset + e * bytes,
                    len: bytes,
                },
                layout: Layout::Rows,
            })
            .collect();
        Ok(Experts { mats })
    }
}

/// A mixture-of-experts layer's tensors.
pub struct MoeWeights {
    /// `ffn_gate_inp`: one row of router weights per expert.
    pub router: Matrix,
    pub gate: Experts,
    pub up: Experts,
    pub down: Experts,
}

impl MoeWeights {
    /// Bytes one token reads: the router and `k` experts' three matrices.
    pub fn active_bytes(&self, k: usize) -> usize {
        let one = |x: &Experts| x.mats.first().map_or(0, Matrix::size_bytes);
        self.router.size_bytes() + k * (one(&self.gate) + one(&self.up) + one(&self.down))
    }
}

/// Working memory of one MoE layer pass over up to `n_rows` rows, allocated once per session.
pub struct MoeScratch {
    /// Router logits, `[n_rows, n_expert]`.
    logits: Vec<f32>,
    /// Each row's chosen experts and weights, `[n_rows, k]`, in the row's top-k order.
    picks: Vec<(usize, f32)>,
    /// Slots `t * k + j` sorted by expert (then row): expert e's are `order[start[e]..start[e + 1]]`.
    order: Vec<usize>,
    start: Vec<usize>,
    /// Where the counting sort puts each expert's next slot.
    next: Vec<usize>,
    /// One expert's gathered input rows, its hidden activations and its output rows.
    xg: Vec<f32>,
    hg: Vec<f32>,
    yg: Vec<f32>,
    /// Each slot's weighted expert output, `[n_rows, k, n_embd]`.
    out: Vec<f32>,
}

impl MoeScratch {
    /// Bytes [`MoeScratch::new`] allocates.
    pub fn bytes_for(m: &Moe, n_embd: usize, n_rows: usize) -> usize {
        let slots = n_rows.saturating_mul(m.n_expert_used);
        let floats = [m.n_expert, n_embd, m.n_ff_exp, n_embd]
            .iter()
            .fold(0usize, |n, &w| n.saturating_add(n_rows.saturating_mul(w)))
            .saturating_add(slots.saturating_mul(n_embd));
        let words = slots.saturating_add(2 * m.n_expert + 1);
        floats
            .saturating_mul(4)
            .saturating_add(slots.saturating_mul(std::mem::size_of::<(usize, f32)>()))
            .saturating_add(words.saturating_mul(std::mem::size_of::<usize>()))
    }

    pub fn new(m: &Moe, n_embd: usize, n_rows: usize) -> MoeScratch {
        let slots = n_rows * m.n_expert_used;
        MoeScratch {
            logits: vec![0.0; n_rows * m.n_expert],
            picks: vec![(0, 0.0); slots],
            order: vec![0; slots],
            start: vec![0; m.n_expert + 1],
            next: vec![0; m.n_expert],
            xg: vec![0.0; n_rows * n_embd],
            hg: vec![0.0; n_rows * m.n_ff_exp],
            yg: vec![0.0; n_rows * n_embd],
            out: vec![0.0; slots * n_embd],
        }
    }
}

/// Chooses one row's experts from its router `logits` into `picks` (`k` of them), in descending order of
/// probability, the lowest index first among equals, with their weights as `r` says. Softmax probabilities are
/// computed as ggml's `soft_max` does (max subtracted, the sum in f64, one multiply by its inverse); renormalised
/// weights divide by their sum, clamped to f16's smallest normal as llama.cpp clamps it.
pub fn route(logits: &[f32], r: &Routing, picks: &mut [(usize, f32)]) {
    debug_assert_eq!(r.gating, Gating::Softmax, "the loader refuses other gating functions");
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let inv = (1.0 / sum) as f32;
    let prob = |e: usize| (logits[e] - max).exp() * inv;
    for j in 0..picks.len() {
        let mut best: Option<usize> = None;
        for e in 0..logits.len() {
            if picks[..j].iter().any(|&(p, _)| p == e) {
                continue;
            }
            // Strictly greater: the lowest index wins a tie. A NaN logit (a broken model) ranks below every number
            // and picks nothing it should not: a row of NaNs picks 0, 1, ...
            if best.is_none_or(|b| logits[e] > logits[b] || (logits[b].is_nan() && !logits[e].is_nan())) {
                best = Some(e);
            }
        }
        let e = best.expect("k <= n_expert, checked at load");
        picks[j] = (e, prob(e));
    }
    if r.normalise {
        let sum = picks.iter().map(|&(_, w)| f64::from(w)).sum::<f64>() as f32;
        let sum = sum.max(6.103_515_6e-5);
        for p in picks.iter_mut() {
            p.1 /= sum;
        }
    }
    if r.scale != 1.0 {
        for p in picks.iter_mut() {
            p.1 *= r.scale;
        }
    }
}

/// The mixture's feed-forward of the normalised input `b.xn` (`[s.n_tok, n_embd]`), written back to `b.xn`.
pub fn ffn(s: &Step, m: &MoeWeights, b: &mut Buffers) {
    let moe = s.hp.moe.as_ref().expect("a layer with experts has MoE hyperparameters");
    let (n, e, k, n_x, f) = (s.n_tok, s.hp.n_embd, moe.n_expert_used, moe.n_expert, moe.n_ff_exp);
    let Buffers { xn, sc, moe: ms, .. } = b;
    let ms = ms.as_mut().expect("a MoE model's scratch has the MoE buffers");

    project(s, &m.router, xn, &mut ms.logits, sc);
    for t in 0..n {
        route(
            &ms.logits[t * n_x..(t + 1) * n_x],
            &moe.routing,
            &mut ms.picks[t * k..(t + 1) * k],
        );
    }

    // Counting sort of the slots by expert.
    ms.start.fill(0);
    for &(ex, _) in &ms.picks[..n * k] {
        ms.start[ex + 1] += 1;
    }
    for ex in 0..n_x {
        ms.start[ex + 1] += ms.start[ex];
    }
    ms.next.copy_from_slice(&ms.start[..n_x]);
    for slot in 0..n * k {
        let ex = ms.picks[slot].0;
        ms.order[ms.next[ex]] = slot;
        ms.next[ex] += 1;
    }

    for ex in 0..n_x {
        let slots = &ms.order[ms.start[ex]..ms.start[ex + 1]];
        let rows = slots.len();
        if rows == 0 {
            continue;
        }
        for (i, &slot) in slots.iter().enumerate() {
            let t = slot / k;
            ms.xg[i * e..(i + 1) * e].copy_from_slice(&xn[t * e..(t + 1) * e]);
        }
        let (gate, up, down) = (&m.gate.mats[ex], &m.up.mats[ex], &m.down.mats[ex]);
        s.be.matmul_glu(
            s.pool,
            gate,
            up,
            Glu::Silu,
            &ms.xg[..rows * e],
            rows,
            &mut ms.hg[..rows * f],
            sc,
        );
        s.be.matmul(s.pool, down, &ms.hg[..rows * f], rows, &mut ms.yg[..rows * e], sc);
        for (i, &slot) in slots.iter().enumerate() {
            let w = ms.picks[slot].1;
            let y = &ms.yg[i * e..(i + 1) * e];
            for (o, &v) in ms.out[slot * e..(slot + 1) * e].iter_mut().zip(y) {
                *o = v * w;
            }
        }
    }

    // Each row's weighted outputs summed in its top-k order, as llama.cpp's chain of adds.
    for t in 0..n {
        let row = &mut xn[t * e..(t + 1) * e];
        row.copy_from_slice(&ms.out[t * k * e..(t * k + 1) * e]);
        for j in 1..k {
            let slot = t * k + j;
            for (o, &v) in row.iter_mut().zip(&ms.out[slot * e..(slot + 1) * e]) {
                *o += v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ThreadPool;
    use crate::kernels::ggml::Numerics;
    use crate::kernels::ops::RopeTable;
    use crate::model::{Ffn, Model};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn scratch_bytes_are_what_new_allocates() {
        let m = Moe {
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 96,
            routing: softmax(),
        };
        for n_rows in [1, 7, 64] {
            let s = MoeScratch::new(&m, 40, n_rows);
            let f32s = s.logits.len() + s.xg.len() + s.hg.len() + s.yg.len() + s.out.len();
            let words = s.order.len() + s.start.len() + s.next.len();
            let held = 4 * f32s + s.picks.len() * std::mem::size_of::<(usize, f32)>() + 8 * words;
            assert_eq!(MoeScratch::bytes_for(&m, 40, n_rows), held, "{n_rows} rows");
        }
    }

    fn softmax() -> Routing {
        Routing {
            gating: Gating::Softmax,
            normalise: true,
            scale: 1.0,
            n_shared: 0,
        }
    }

    /// Logits ln 1, ln 2, ln 4, ln 3 give probabilities 0.1, 0.2, 0.4, 0.3: the top two are experts 2 and 3, and
    /// renormalised their weights are 0.4/0.7 and 0.3/0.7.
    #[test]
    fn top_k_and_renormalised_weights() {
        let logits = [1.0f32, 2.0, 4.0, 3.0].map(f32::ln);
        let mut picks = [(9, 0.0); 2];
        route(&logits, &softmax(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (2, 3));
        assert!((picks[0].1 - 4.0 / 7.0).abs() < 1e-6, "{picks:?}");
        assert!((picks[1].1 - 3.0 / 7.0).abs() < 1e-6, "{picks:?}");

        let raw = Routing {
            normalise: false,
            ..softmax()
        };
        route(&logits, &raw, &mut picks);
        assert!(
            (picks[0].1 - 0.4).abs() < 1e-6 && (picks[1].1 - 0.3).abs() < 1e-6,
            "{picks:?}"
        );

        let scaled = Routing {
            scale: 2.5,
            ..softmax()
        };
        route(&logits, &scaled, &mut picks);
        assert!((picks[0].1 - 2.5 * 4.0 / 7.0).abs() < 1e-5, "{picks:?}");

        // k = n_expert: every expert, the weights are the probabilities themselves.
        let mut all = [(9, 0.0); 4];
        route(&logits, &softmax(), &mut all);
        assert_eq!(all.map(|p| p.0), [2, 3, 1, 0]);
        assert!((all.iter().map(|p| p.1).sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((all[3].1 - 0.1).abs() < 1e-6, "{all:?}");
    }

    /// Equal logits: the lowest indices win, in index order, and share the weight equally.
    #[test]
    fn ties_go_to_the_lowest_index() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 2.0];
        let mut picks = [(9, 0.0); 2];
        route(&logits, &softmax(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (1, 3));
        assert_eq!(picks[0].1, picks[1].1);
        assert!((picks[0].1 - 0.5).abs() < 1e-6);
        let mut one = [(9, 0.0)];
        route(&[3.0, 3.0, 3.0], &softmax(), &mut one);
        assert_eq!(one, [(0, 1.0)]);
        route(&[f32::NAN, 1.0, 2.0], &softmax(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (2, 1));
    }

    /// Layer `il`'s mixture over the rows of `x` in one pass of `n_rows`-row buffers.
    fn run_ffn(m: &Model, il: usize, x: &[f32], numerics: Numerics) -> Vec<f32> {
        let hp = &m.hp;
        let n = x.len() / hp.n_embd;
        let pool = ThreadPool::new(2);
        let rope = RopeTable::new(hp.rope_base, hp.n_rot, 8);
        let step = Step {
            hp,
            pool: &pool,
            rope: &rope,
            il,
            n_tok: n,
            be: crate::backend::for_numerics(numerics),
        };
        let mut b = Buffers::new(hp, n, 8, 2);
        b.xn[..x.len()].copy_from_slice(x);
        let Ffn::Moe(w) = &m.layer(il).ffn else {
            panic!("layer {il} has no experts")
        };
        ffn(&step, w, &mut b);
        b.xn[..x.len()].to_vec()
    }

    /// On a random-weight qwen3moe: a batch of rows grouped by expert gives each row the bits it gets alone (a
    /// decode step), and both are the mixture computed the plain way (every expert's matrices as f32, f64 sums).
    #[test]
    fn grouped_batch_matches_rows_alone_and_the_plain_sum() {
        let dir = tempfile::tempdir().unwrap();
        let m = crate::engine::batch::tests::tiny(crate::model::Arch::Qwen3Moe, dir.path());
        let (e, n) = (m.hp.n_embd, 40);
        let moe = m.hp.moe.clone().unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let x: Vec<f32> = (0..n * e).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
        for numerics in [Numerics::Fast, Numerics::Ggml] {
            for il in [0, 3] {
                let batch = run_ffn(&m, il, &x, numerics);
                let mut used = vec![false; moe.n_expert];
                for t in 0..n {
                    let row = &x[t * e..(t + 1) * e];
                    let alone = run_ffn(&m, il, row, numerics);
                    assert!(
                        alone == batch[t * e..(t + 1) * e],
                        "{numerics:?} layer {il} row {t}: the batch changed its bits"
                    );

                    let Ffn::Moe(w) = &m.layer(il).ffn else { unreachable!() };
                    let router = w.router.to_f32();
                    let logits: Vec<f32> = router
                        .chunks(e)
                        .map(|r| r.iter().zip(row).map(|(a, b)| f64::from(a * b)).sum::<f64>() as f32)
                        .collect();
                    let mut picks = vec![(0, 0.0); moe.n_expert_used];
                    route(&logits, &moe.routing, &mut picks);
                    let mut want = vec![0.0f64; e];
                    for &(ex, wt) in &picks {
                        used[ex] = true;
                        let (g, u, d) = (
                            w.gate.mats[ex].to_f32(),
                            w.up.mats[ex].to_f32(),
                            w.down.mats[ex].to_f32(),
                        );
                        let dot = |m: &[f32], v: &[f32], i: usize| -> f64 {
                            m[i * v.len()..(i + 1) * v.len()]
                                .iter()
                                .zip(v)
                                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                                .sum()
                        };
                        let h: Vec<f32> = (0..moe.n_ff_exp)
                            .map(|i| {
                                let (gv, uv) = (dot(&g, row, i), dot(&u, row, i));
                                (gv / (1.0 + (-gv).exp()) * uv) as f32
                            })
                            .collect();
                        for (o, wo) in want.iter_mut().enumerate() {
                            *wo += f64::from(wt) * dot(&d, &h, o);
                        }
                    }
                    let err = want
                        .iter()
                        .zip(&alone)
                        .map(|(a, b)| (*a as f32 - b).abs())
                        .fold(0.0, f32::max);
                    assert!(
                        err < 1e-3,
                        "{numerics:?} layer {il} row {t}: differs from the plain sum by {err}"
                    );
                }
                // The rows spread over several experts, so the grouping is exercised.
                assert!(used.iter().filter(|&&u| u).count() >= 4, "{used:?}");
            }
        }
    }
}
