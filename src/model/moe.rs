//! The mixture-of-experts feed-forward (`qwen3moe`, `dots1`; llama.cpp's `build_moe_ffn`): a router scores every
//! expert for each row, the row runs its top-k experts' gated feed-forwards, their outputs are summed with the
//! routing weights, and the shared experts' output (where the layer has them) is added.
//!
//! - **Weights stay where they are.** An expert tensor is one 3-D tensor in the file (`[cols, rows, n_expert]`);
//!   expert e's matrix is rows `e*rows..(e+1)*rows` of its 2-D view, and [`Experts`] holds one view per expert into
//!   the memory map: nothing is copied, and the pages of experts no token picks are never read.
//! - **Routing is data** ([`super::hparams::Routing`]): the gating function, renormalisation, scale, groups and shared
//!   experts are fields, and the selection bias and shared experts are optional tensors of the layer, so another
//!   architecture's routing is another value, not another layer.
//! - **Grouped by expert.** A batch's rows are sorted by the experts they picked; each picked expert runs its matmuls
//!   once over its gathered rows (so its weights are read once per batch), and the weighted outputs are added back to
//!   their rows in each row's own top-k order: a row gets the same bits alone (decode, which reads only its k experts)
//!   or in any batch.

use super::DenseFfn;
use super::blocks::{Buffers, Step, project};
use super::hparams::{Gating, Moe, Routing};
use crate::gguf::{GgufFile, TensorInfo};
use crate::kernels::matrix::{Bytes, Layout};
use crate::kernels::{Glu, Matrix};
use anyhow::{Result, bail};
use std::sync::Arc;

/// One expert tensor: `n_expert` matrices of the same shape, each a view of its rows of the mapped 3-D tensor.
/// Whether this process leaves experts in the mapped file (`--experts-on-disk`, BATON_EXPERTS_ON_DISK=1) rather
/// than repacking them into memory with the other weights. Chosen once per process, as the backend is, so that
/// every loader (the pipeline's stages, a node's ranges) places experts alike.
pub fn experts_on_disk() -> bool {
    std::env::var_os("BATON_EXPERTS_ON_DISK").is_some_and(|v| v == "1")
}

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

/// The 3-D expert tensor `name` of `f` as one mapped 2-D matrix, `n_expert · rows` rows of `cols` (expert e's rows
/// after expert e - 1's), its shape checked: what the GPU uploads (`backend::gpu::GpuExperts`) and picks from.
pub(crate) fn experts_matrix(
    f: &Arc<GgufFile>,
    name: &str,
    cols: usize,
    rows: usize,
    n_expert: usize,
) -> Result<Matrix> {
    let info = f.tensor_info(name)?;
    // Its shape, type and size, checked as the CPU's views check them.
    Experts::mapped(f, info, cols, rows, n_expert)?;
    Ok(Matrix {
        ty: info.ty,
        rows: n_expert * rows,
        cols,
        data: Bytes::Mapped {
            file: f.clone(),
            offset: info.offset,
            len: info.size,
        },
        layout: Layout::Rows,
    })
}

/// A mixture-of-experts layer's tensors.
pub struct MoeWeights {
    /// `ffn_gate_inp`: one row of router weights per expert.
    pub router: Matrix,
    pub gate: Experts,
    pub up: Experts,
    pub down: Experts,
    /// `exp_probs_b`: added to each expert's probability for choosing the experts only (DeepSeek V3, dots1); the
    /// weights are the unbiased probabilities.
    pub bias: Option<Vec<f32>>,
    /// The shared experts (`ffn_{gate,up,down}_shexp`), one gated feed-forward that every row runs, added to the
    /// routed sum.
    pub shared: Option<DenseFfn>,
}

impl MoeWeights {
    /// Bytes one token reads: the router, `k` experts' three matrices and the shared experts.
    pub fn active_bytes(&self, k: usize) -> usize {
        let one = |x: &Experts| x.mats.first().map_or(0, Matrix::size_bytes);
        let shared = self
            .shared
            .as_ref()
            .map_or(0, |d| d.gate.size_bytes() + d.up.size_bytes() + d.down.size_bytes());
        self.router.size_bytes() + k * (one(&self.gate) + one(&self.up) + one(&self.down)) + shared
    }
}

/// One expert's work for one row: row `row` of the batch runs expert `expert`, its output scaled by `weight`. A
/// batch's picks are its rows' top-k in order (`row * k + j`); the subset sent to another node keeps that order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pick {
    pub row: u32,
    pub expert: u32,
    pub weight: f32,
}

/// Experts computed by another process holding the same weights (`--experts-split`, `cluster::experts`).
pub trait RemoteExperts: Send + Sync {
    /// Whether to send it work now: false while it is known to be down, so a dead peer costs no wait per layer.
    fn available(&self) -> bool;
    /// Sends layer `layer`'s `picks` over the rows `x` (`[n_rows, n_embd]`), calls `local` (which computes this
    /// side's share meanwhile), and returns the picks' weighted outputs, `[picks.len(), n_embd]`, in their order.
    /// An error means the peer did not answer: the caller computes those picks itself.
    fn run(&self, layer: usize, x: &[f32], picks: &[Pick], local: &mut dyn FnMut()) -> Result<Vec<f32>>;
}

/// Working memory of one MoE layer pass over up to `n_rows` rows, allocated once per session.
pub struct MoeScratch {
    /// Rows one pass takes at most.
    n_rows: usize,
    /// Router logits, `[n_rows, n_expert]`.
    logits: Vec<f32>,
    /// Each row's chosen experts and weights, `[n_rows, k]`, in the row's top-k order.
    top: Vec<(usize, f32)>,
    /// The same as picks, `[n_rows * k]`.
    picks: Vec<Pick>,
    group: Grouping,
    /// Each pick's weighted expert output, `[n_rows, k, n_embd]`.
    out: Vec<f32>,
    /// The shared experts' output, `[n_rows, n_embd]` (empty without shared experts).
    shared: Vec<f32>,
    /// With a remote peer: whether expert e runs there this pass, the picks sent and where each one's output goes.
    remote_expert: Vec<bool>,
    remote: Vec<Pick>,
    remote_at: Vec<usize>,
    /// Experts by decreasing load, to balance the two sides.
    by_load: Vec<usize>,
}

/// The buffers of running picks grouped by expert.
struct Grouping {
    /// Picks sorted by expert (then row): expert e's are `order[start[e]..start[e + 1]]`.
    order: Vec<usize>,
    start: Vec<usize>,
    /// Where the counting sort puts each expert's next pick.
    next: Vec<usize>,
    /// One expert's gathered input rows, its hidden activations and its output rows (at most `n_rows` at a time).
    xg: Vec<f32>,
    hg: Vec<f32>,
    yg: Vec<f32>,
}

impl MoeScratch {
    /// Bytes [`MoeScratch::new`] allocates.
    pub fn bytes_for(m: &Moe, n_embd: usize, n_rows: usize) -> usize {
        let slots = n_rows.saturating_mul(m.n_expert_used);
        let floats = [m.n_expert, n_embd, m.n_ff_exp, n_embd]
            .iter()
            .fold(0usize, |n, &w| n.saturating_add(n_rows.saturating_mul(w)))
            .saturating_add(slots.saturating_mul(n_embd))
            .saturating_add(Self::shared_len(m, n_embd, n_rows));
        // order and remote_at; start, next and by_load.
        let words = slots.saturating_mul(2).saturating_add(3 * m.n_expert + 1);
        // picks and remote.
        let picks = slots.saturating_mul(2 * std::mem::size_of::<Pick>());
        floats
            .saturating_mul(4)
            .saturating_add(slots.saturating_mul(std::mem::size_of::<(usize, f32)>()))
            .saturating_add(words.saturating_mul(std::mem::size_of::<usize>()))
            .saturating_add(picks)
            .saturating_add(m.n_expert)
    }

    fn shared_len(m: &Moe, n_embd: usize, n_rows: usize) -> usize {
        if m.routing.n_shared > 0 {
            n_rows.saturating_mul(n_embd)
        } else {
            0
        }
    }

    pub fn new(m: &Moe, n_embd: usize, n_rows: usize) -> MoeScratch {
        let slots = n_rows * m.n_expert_used;
        let pick = Pick {
            row: 0,
            expert: 0,
            weight: 0.0,
        };
        MoeScratch {
            n_rows,
            logits: vec![0.0; n_rows * m.n_expert],
            top: vec![(0, 0.0); slots],
            picks: vec![pick; slots],
            group: Grouping {
                order: vec![0; slots],
                start: vec![0; m.n_expert + 1],
                next: vec![0; m.n_expert],
                xg: vec![0.0; n_rows * n_embd],
                hg: vec![0.0; n_rows * m.n_ff_exp],
                yg: vec![0.0; n_rows * n_embd],
            },
            out: vec![0.0; slots * n_embd],
            shared: vec![0.0; Self::shared_len(m, n_embd, n_rows)],
            remote_expert: vec![false; m.n_expert],
            remote: Vec::with_capacity(slots),
            remote_at: Vec::with_capacity(slots),
            by_load: Vec::with_capacity(m.n_expert),
        }
    }
}
/// Chooses one row's experts from its router `logits` into `picks` (`k` of them), as llama.cpp's `build_moe_ffn`:
/// 1. the logits become probabilities in place (`logits` holds them afterwards): softmax as ggml's `soft_max` (max
///    subtracted, the sum in f64, one multiply by its inverse), or sigmoid `1 / (1 + e^-x)`;
/// 2. an expert's selection score is its probability plus its `bias` (`exp_probs_b`), if the layer has one;
/// 3. with groups, each group scores the sum of its two best selection scores, and only the `n_group_used` best
///    groups' experts may be chosen;
/// 4. the top k by selection score, in descending order, the lowest index first among equals (a NaN ranks below
///    every number);
/// 5. their weights are their unbiased probabilities, renormalised to sum to 1 if `r.normalise` (the sum clamped to
///    f16's smallest normal as llama.cpp clamps it), then multiplied by `r.scale`.
pub fn route(logits: &mut [f32], bias: Option<&[f32]>, r: &Routing, picks: &mut [(usize, f32)]) {
    gate(logits, r.gating);
    select(logits, bias, r, picks);
}

/// Step 1 of [`route`]: the router's logits become probabilities in place.
pub fn gate(logits: &mut [f32], gating: Gating) {
    match gating {
        Gating::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f64;
            for l in logits.iter_mut() {
                *l = (*l - max).exp();
                // A NaN logit (a broken model) stays NaN, ranks last, and leaves the others' probabilities alone.
                if !l.is_nan() {
                    sum += f64::from(*l);
                }
            }
            let inv = (1.0 / sum) as f32;
            for l in logits.iter_mut() {
                *l *= inv;
            }
        }
        Gating::Sigmoid => {
            for l in logits.iter_mut() {
                *l = 1.0 / (1.0 + (-*l).exp());
            }
        }
    }
}

/// Steps 2 to 5 of [`route`], over the probabilities [`gate`] made. Apart, so the GPU's routing can be checked
/// step by step: its `exp` may differ from the CPU's in the last bits, which may flip a near tie.
pub fn select(probs: &[f32], bias: Option<&[f32]>, r: &Routing, picks: &mut [(usize, f32)]) {
    let score = |e: usize| match bias {
        Some(b) => probs[e] + b[e],
        None => probs[e],
    };
    // Strictly greater: the lowest index wins a tie; a NaN ranks below every number.
    let better = |a: f32, b: f32| a > b || (b.is_nan() && !a.is_nan());

    // Groups kept, as a bit mask (at most 64 groups, checked at load); all experts without groups.
    let n_x = probs.len();
    let per = if r.grouped() { n_x / r.n_group } else { n_x };
    let mut kept: u64 = if r.grouped() { 0 } else { 1 };
    if r.grouped() {
        let group_score = |gi: usize| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for e in gi * per..(gi + 1) * per {
                let s = score(e);
                if better(s, a) {
                    b = a;
                    a = s;
                } else if better(s, b) {
                    b = s;
                }
            }
            a + b
        };
        for _ in 0..r.n_group_used {
            let mut best: Option<(usize, f32)> = None;
            for gi in (0..r.n_group).filter(|&gi| kept & (1 << gi) == 0) {
                let s = group_score(gi);
                if best.is_none_or(|(_, bs)| better(s, bs)) {
                    best = Some((gi, s));
                }
            }
            let (gi, _) = best.expect("n_group_used < n_group, checked at load");
            kept |= 1 << gi;
        }
    }
    let allowed = |e: usize| kept & (1 << (e / per)) != 0;

    for j in 0..picks.len() {
        let mut best: Option<usize> = None;
        for e in (0..n_x).filter(|&e| allowed(e)) {
            if picks[..j].iter().any(|&(p, _)| p == e) {
                continue;
            }
            if best.is_none_or(|b| better(score(e), score(b))) {
                best = Some(e);
            }
        }
        let e = best.expect("k <= the experts of the kept groups, checked at load");
        picks[j] = (e, probs[e]);
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

/// The mixture's feed-forward of the normalised input `b.xn` (`[s.n_tok, n_embd]`), written back to `b.xn`. With a
/// remote peer (`s.experts`), about half of the picked experts run there while this side runs the rest; a peer that
/// fails leaves its share to run here. Each pick's output has the same bits wherever it ran, and each row sums its
/// picks in its top-k order, so the result does not depend on the split.
pub fn ffn(s: &Step, m: &MoeWeights, b: &mut Buffers) {
    let moe = s.hp.moe.as_ref().expect("a layer with experts has MoE hyperparameters");
    let (n, e, k, n_x) = (s.n_tok, s.hp.n_embd, moe.n_expert_used, moe.n_expert);
    let Buffers {
        xn, sc, moe: ms, work, ..
    } = b;
    let ms = ms.as_mut().expect("a MoE model's scratch has the MoE buffers");

    // The shared experts first, while `xn` still holds the input (their hidden activations in the working buffer,
    // free during the feed-forward).
    if let Some(d) = &m.shared {
        let h = &mut work[..n * d.gate.rows];
        s.be.matmul_glu(s.pool, &d.gate, &d.up, Glu::Silu, &xn[..n * e], n, h, sc);
        project(s, &d.down, h, &mut ms.shared, sc);
    }

    project(s, &m.router, xn, &mut ms.logits, sc);
    for t in 0..n {
        let top = &mut ms.top[t * k..(t + 1) * k];
        route(
            &mut ms.logits[t * n_x..(t + 1) * n_x],
            m.bias.as_deref(),
            &moe.routing,
            top,
        );
        for (j, &(ex, w)) in top.iter().enumerate() {
            ms.picks[t * k + j] = Pick {
                row: t as u32,
                expert: ex as u32,
                weight: w,
            };
        }
    }
    let picks = &ms.picks[..n * k];
    let x = &xn[..n * e];

    ms.remote.clear();
    ms.remote_at.clear();
    let peer = s.experts.filter(|p| p.available());
    if peer.is_some() {
        split_experts(picks, n_x, &mut ms.by_load, &mut ms.group.start, &mut ms.remote_expert);
        for (i, p) in picks.iter().enumerate() {
            if ms.remote_expert[p.expert as usize] {
                ms.remote.push(*p);
                ms.remote_at.push(i);
            }
        }
    }
    // A batch whose picks all stay here (one row, one expert) costs no round trip.
    match peer.filter(|_| !ms.remote.is_empty()) {
        None => run_picks(s, m, x, picks, |_| true, &mut ms.out, &mut ms.group, sc),
        Some(peer) => {
            let remote = &ms.remote_expert;
            let mut ran = false;
            let got = peer.run(s.il, x, &ms.remote, &mut || {
                let here = |ex: usize| !remote[ex];
                run_picks(s, m, x, picks, here, &mut ms.out, &mut ms.group, sc);
                ran = true;
            });
            if !ran {
                run_picks(s, m, x, picks, |ex| !remote[ex], &mut ms.out, &mut ms.group, sc);
            }
            match got {
                Ok(y) if y.len() == ms.remote.len() * e => {
                    for (yi, &at) in y.chunks_exact(e).zip(&ms.remote_at) {
                        ms.out[at * e..(at + 1) * e].copy_from_slice(yi);
                    }
                }
                // The peer said why (it logs its failures); its share runs here.
                _ => run_picks(s, m, x, picks, |ex| remote[ex], &mut ms.out, &mut ms.group, sc),
            }
        }
    }

    // Each row's weighted outputs summed in its top-k order, as llama.cpp's chain of adds, then the shared experts'.
    for t in 0..n {
        let row = &mut xn[t * e..(t + 1) * e];
        row.copy_from_slice(&ms.out[t * k * e..(t * k + 1) * e]);
        for j in 1..k {
            let slot = t * k + j;
            for (o, &v) in row.iter_mut().zip(&ms.out[slot * e..(slot + 1) * e]) {
                *o += v;
            }
        }
        if m.shared.is_some() {
            for (o, &v) in row.iter_mut().zip(&ms.shared[t * e..(t + 1) * e]) {
                *o += v;
            }
        }
    }
}

/// Chooses the experts the remote side runs: the picked experts by decreasing number of rows (the lowest index
/// first among equals), each to the side with fewer rows so far, this side first. A decode step's k experts split
/// k/2 each; a batch's rows split about evenly.
fn split_experts(picks: &[Pick], n_expert: usize, by_load: &mut Vec<usize>, load: &mut [usize], remote: &mut [bool]) {
    load[..n_expert].fill(0);
    for p in picks {
        load[p.expert as usize] += 1;
    }
    by_load.clear();
    by_load.extend((0..n_expert).filter(|&ex| load[ex] > 0));
    by_load.sort_unstable_by_key(|&ex| (std::cmp::Reverse(load[ex]), ex));
    remote.fill(false);
    let (mut here, mut there) = (0, 0);
    for &ex in by_load.iter() {
        if there < here {
            remote[ex] = true;
            there += load[ex];
        } else {
            here += load[ex];
        }
    }
}

/// Runs the `picks` whose expert `mine` accepts over their rows of `x`, grouped by expert so that each expert's
/// weights are read once, writing pick i's weighted output to `out[i * n_embd..]`. An expert's rows go through in
/// groups of at most the scratch's rows (a remote request may repeat a row; a local batch never needs more than one).
#[allow(clippy::too_many_arguments)]
fn run_picks(
    s: &Step,
    m: &MoeWeights,
    x: &[f32],
    picks: &[Pick],
    mine: impl Fn(usize) -> bool,
    out: &mut [f32],
    g: &mut Grouping,
    sc: &mut crate::backend::Scratch,
) {
    let e = s.hp.n_embd;
    let f = m.gate.mats.first().map_or(0, |g| g.rows);
    let n_x = m.gate.mats.len();
    let cap = g.xg.len() / e;

    // Counting sort of the picks by expert.
    g.start.fill(0);
    for p in picks.iter().filter(|p| mine(p.expert as usize)) {
        g.start[p.expert as usize + 1] += 1;
    }
    for ex in 0..n_x {
        g.start[ex + 1] += g.start[ex];
    }
    g.next.copy_from_slice(&g.start[..n_x]);
    for (i, p) in picks.iter().enumerate() {
        let ex = p.expert as usize;
        if mine(ex) {
            g.order[g.next[ex]] = i;
            g.next[ex] += 1;
        }
    }

    for ex in 0..n_x {
        for group in g.order[g.start[ex]..g.start[ex + 1]].chunks(cap.max(1)) {
            let rows = group.len();
            for (r, &i) in group.iter().enumerate() {
                let t = picks[i].row as usize;
                g.xg[r * e..(r + 1) * e].copy_from_slice(&x[t * e..(t + 1) * e]);
            }
            let (gate, up, down) = (&m.gate.mats[ex], &m.up.mats[ex], &m.down.mats[ex]);
            s.be.matmul_glu(
                s.pool,
                gate,
                up,
                Glu::Silu,
                &g.xg[..rows * e],
                rows,
                &mut g.hg[..rows * f],
                sc,
            );
            s.be.matmul(s.pool, down, &g.hg[..rows * f], rows, &mut g.yg[..rows * e], sc);
            for (r, &i) in group.iter().enumerate() {
                let w = picks[i].weight;
                let y = &g.yg[r * e..(r + 1) * e];
                for (o, &v) in out[i * e..(i + 1) * e].iter_mut().zip(y) {
                    *o = v * w;
                }
            }
        }
    }
}

/// Layer picks sent by another node (`--experts-split`): checks them against the layer and the scratch, runs them,
/// and returns their weighted outputs, `[picks.len(), n_embd]`. `x` is the rows they index, `[n_rows, n_embd]`.
pub fn serve_picks(s: &Step, m: &MoeWeights, x: &[f32], picks: &[Pick], b: &mut Buffers) -> Result<Vec<f32>> {
    let moe = s.hp.moe.as_ref().expect("a layer with experts has MoE hyperparameters");
    let e = s.hp.n_embd;
    let ms = b.moe.as_mut().expect("a MoE model's scratch has the MoE buffers");
    if !x.len().is_multiple_of(e) || x.len() / e > ms.n_rows {
        bail!("{} values are not 1..={} rows of {e}", x.len(), ms.n_rows);
    }
    let n_rows = x.len() / e;
    if picks.len() > ms.picks.len() {
        bail!("{} picks exceed the {} this session takes", picks.len(), ms.picks.len());
    }
    if let Some(p) = picks
        .iter()
        .find(|p| p.row as usize >= n_rows || p.expert as usize >= moe.n_expert || !p.weight.is_finite())
    {
        bail!(
            "pick of expert {} for row {} with weight {} is out of range ({n_rows} rows, {} experts)",
            p.expert,
            p.row,
            p.weight,
            moe.n_expert
        );
    }
    let mut out = vec![0.0; picks.len() * e];
    run_picks(s, m, x, picks, |_| true, &mut out, &mut ms.group, &mut b.sc);
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::kernels::ThreadPool;
    use crate::kernels::ggml::Numerics;
    use crate::kernels::ops::RopeTable;
    use crate::model::{Ffn, Model};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::path::Path;

    /// The routing of test case `case`, shared with the GPU's routing test: no groups, 4 groups of 4 (2 used) or 8
    /// of 4 (3 used); sigmoid or softmax; with and without renormalisation and scale. Also the expert count and how
    /// many experts the kept groups hold (the largest k).
    pub(crate) fn routing_case(case: usize) -> (Routing, usize, usize) {
        let (n_group, n_group_used, per) = match case % 3 {
            0 => (0, 0, 16),
            1 => (4, 2, 4),
            _ => (8, 3, 4),
        };
        let n = if n_group > 1 { n_group * per } else { per };
        let r = Routing {
            gating: if case.is_multiple_of(2) {
                Gating::Sigmoid
            } else {
                Gating::Softmax
            },
            normalise: !case.is_multiple_of(5),
            scale: if case.is_multiple_of(4) { 2.5 } else { 1.0 },
            n_shared: 0,
            n_group,
            n_group_used,
        };
        (r, n, n_group_used.max(1) * per)
    }

    #[test]
    fn scratch_bytes_are_what_new_allocates() {
        for n_shared in [0, 2] {
            let m = Moe {
                n_expert: 8,
                n_expert_used: 2,
                n_ff_exp: 96,
                n_dense_lead: 0,
                routing: Routing { n_shared, ..softmax() },
            };
            for n_rows in [1, 7, 64] {
                let s = MoeScratch::new(&m, 40, n_rows);
                assert_eq!(s.shared.len(), if n_shared > 0 { n_rows * 40 } else { 0 });
                let g = &s.group;
                let f32s = s.logits.len() + g.xg.len() + g.hg.len() + g.yg.len() + s.out.len() + s.shared.len();
                let words =
                    g.order.len() + g.start.len() + g.next.len() + s.remote_at.capacity() + s.by_load.capacity();
                let picks = (s.picks.len() + s.remote.capacity()) * std::mem::size_of::<Pick>();
                let held = 4 * f32s
                    + s.top.len() * std::mem::size_of::<(usize, f32)>()
                    + 8 * words
                    + picks
                    + s.remote_expert.len();
                assert_eq!(
                    MoeScratch::bytes_for(&m, 40, n_rows),
                    held,
                    "{n_rows} rows, {n_shared} shared"
                );
            }
        }
    }

    fn softmax() -> Routing {
        Routing {
            gating: Gating::Softmax,
            normalise: true,
            scale: 1.0,
            n_shared: 0,
            n_group: 0,
            n_group_used: 0,
        }
    }

    /// [`route`] of a copy of `logits` (which it turns into probabilities).
    fn routed(logits: &[f32], bias: Option<&[f32]>, r: &Routing, picks: &mut [(usize, f32)]) {
        route(&mut logits.to_vec(), bias, r, picks);
    }

    /// Logits ln 1, ln 2, ln 4, ln 3 give probabilities 0.1, 0.2, 0.4, 0.3: the top two are experts 2 and 3, and
    /// renormalised their weights are 0.4/0.7 and 0.3/0.7.
    #[test]
    fn top_k_and_renormalised_weights() {
        let logits = [1.0f32, 2.0, 4.0, 3.0].map(f32::ln);
        let mut picks = [(9, 0.0); 2];
        routed(&logits, None, &softmax(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (2, 3));
        assert!((picks[0].1 - 4.0 / 7.0).abs() < 1e-6, "{picks:?}");
        assert!((picks[1].1 - 3.0 / 7.0).abs() < 1e-6, "{picks:?}");

        let raw = Routing {
            normalise: false,
            ..softmax()
        };
        routed(&logits, None, &raw, &mut picks);
        assert!(
            (picks[0].1 - 0.4).abs() < 1e-6 && (picks[1].1 - 0.3).abs() < 1e-6,
            "{picks:?}"
        );

        let scaled = Routing {
            scale: 2.5,
            ..softmax()
        };
        routed(&logits, None, &scaled, &mut picks);
        assert!((picks[0].1 - 2.5 * 4.0 / 7.0).abs() < 1e-5, "{picks:?}");

        // k = n_expert: every expert, the weights are the probabilities themselves.
        let mut all = [(9, 0.0); 4];
        routed(&logits, None, &softmax(), &mut all);
        assert_eq!(all.map(|p| p.0), [2, 3, 1, 0]);
        assert!((all.iter().map(|p| p.1).sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((all[3].1 - 0.1).abs() < 1e-6, "{all:?}");
    }

    /// Equal logits: the lowest indices win, in index order, and share the weight equally.
    #[test]
    fn ties_go_to_the_lowest_index() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 2.0];
        let mut picks = [(9, 0.0); 2];
        routed(&logits, None, &softmax(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (1, 3));
        assert_eq!(picks[0].1, picks[1].1);
        assert!((picks[0].1 - 0.5).abs() < 1e-6);
        let mut one = [(9, 0.0)];
        routed(&[3.0, 3.0, 3.0], None, &softmax(), &mut one);
        assert_eq!(one, [(0, 1.0)]);
        routed(&[f32::NAN, 1.0, 2.0], None, &softmax(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (2, 1));
    }

    fn sigmoid() -> Routing {
        Routing {
            gating: Gating::Sigmoid,
            normalise: false,
            scale: 1.0,
            ..softmax()
        }
    }

    /// Sigmoid gating: logits 0, ln 3, ln 4, -ln 3 give probabilities 1/2, 3/4, 4/5, 1/4. Without a bias the top two
    /// are experts 2 and 1; a bias of +0.6 on expert 0 makes it the first choice, but its weight stays its unbiased
    /// 1/2. Renormalised and scaled by 2.5, the weights are 2.5 · (1/2, 4/5) / 1.3.
    #[test]
    fn sigmoid_gating_and_a_selection_bias_that_only_chooses() {
        let logits = [0.0f32, 3.0f32.ln(), 4.0f32.ln(), -(3.0f32.ln())];
        let mut picks = [(9, 0.0); 2];
        routed(&logits, None, &sigmoid(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (2, 1));
        assert!(
            (picks[0].1 - 0.8).abs() < 1e-6 && (picks[1].1 - 0.75).abs() < 1e-6,
            "{picks:?}"
        );

        let bias = [0.6f32, 0.0, 0.0, 0.0];
        routed(&logits, Some(&bias), &sigmoid(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (0, 2), "0 scores 1.1, 2 scores 0.8");
        assert!(
            (picks[0].1 - 0.5).abs() < 1e-6 && (picks[1].1 - 0.8).abs() < 1e-6,
            "{picks:?}"
        );

        let r = Routing {
            normalise: true,
            scale: 2.5,
            ..sigmoid()
        };
        routed(&logits, Some(&bias), &r, &mut picks);
        assert!((picks[0].1 - 2.5 * 0.5 / 1.3).abs() < 1e-6, "{picks:?}");
        assert!((picks[1].1 - 2.5 * 0.8 / 1.3).abs() < 1e-6, "{picks:?}");

        // A negative bias removes an expert that would win on its probability alone; the probabilities are left in
        // the logits' place.
        let mut probs = logits.to_vec();
        route(&mut probs, Some(&[0.0, 0.0, -1.0, 0.0]), &sigmoid(), &mut picks);
        assert_eq!((picks[0].0, picks[1].0), (1, 0));
        assert!((probs[3] - 0.25).abs() < 1e-6, "{probs:?}");
    }

    /// Groups: 8 experts in 4 groups of 2, the best 2 groups kept. Expert 0 has the highest score, but its group
    /// (0, 1) sums to 0.9 + 0.0 and loses to groups (4, 5) and (6, 7), which sum to 1.4 and 1.2; the top 3 are then
    /// chosen among experts 4..8 only.
    #[test]
    fn groups_keep_the_best_pairs_and_choose_within_them() {
        let r = Routing {
            n_group: 4,
            n_group_used: 2,
            ..sigmoid()
        };
        let probs = [0.9f32, 0.0, 0.5, 0.5, 0.7, 0.7, 0.8, 0.4];
        // Logits whose sigmoids are these probabilities (0 for 0 via a very negative logit).
        let logits: Vec<f32> = probs
            .iter()
            .map(|&p| if p == 0.0 { -200.0 } else { (p / (1.0 - p)).ln() })
            .collect();
        let mut picks = [(9, 0.0); 3];
        routed(&logits, None, &r, &mut picks);
        assert_eq!(picks.map(|p| p.0), [6, 4, 5]);
        // Without groups expert 0 wins.
        routed(&logits, None, &sigmoid(), &mut picks);
        assert_eq!(picks.map(|p| p.0), [0, 6, 4]);
        // The bias counts in the group scores too: +0.6 on expert 1 makes group (0, 1) the best (1.5).
        let mut bias = [0.0f32; 8];
        bias[1] = 0.6;
        routed(&logits, Some(&bias), &r, &mut picks);
        assert_eq!(
            picks.map(|p| p.0),
            [0, 4, 5],
            "groups (0, 1) and (4, 5); 5 ties 4 and loses on index"
        );
    }

    /// The router against a plain one written from llama.cpp's description (sort, not scan): random logits, biases
    /// and routings, gating softmax and sigmoid, with and without groups, renormalisation and scale.
    #[test]
    fn route_matches_a_plain_reference() {
        fn reference(logits: &[f32], bias: Option<&[f32]>, r: &Routing, k: usize) -> Vec<(usize, f32)> {
            let n = logits.len();
            let probs: Vec<f32> = match r.gating {
                Gating::Softmax => {
                    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
                    let inv = (1.0 / sum) as f32;
                    logits.iter().map(|&l| (l - max).exp() * inv).collect()
                }
                Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
            };
            let mut sel: Vec<f32> = (0..n).map(|e| probs[e] + bias.map_or(0.0, |b| b[e])).collect();
            // Sorts by descending score, the lower index first among equals (a stable sort).
            let top = |v: &[f32], m: usize| -> Vec<usize> {
                let mut idx: Vec<usize> = (0..v.len()).collect();
                idx.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap());
                idx.truncate(m);
                idx
            };
            if r.n_group > 1 {
                let per = n / r.n_group;
                let scores: Vec<f32> = (0..r.n_group)
                    .map(|g| {
                        let grp = &sel[g * per..(g + 1) * per];
                        let t = top(grp, 2);
                        grp[t[0]] + grp[t[1]]
                    })
                    .collect();
                let kept = top(&scores, r.n_group_used);
                for (e, s) in sel.iter_mut().enumerate() {
                    if !kept.contains(&(e / per)) {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
            let mut w: Vec<(usize, f32)> = top(&sel, k).into_iter().map(|e| (e, probs[e])).collect();
            if r.normalise {
                let sum = (w.iter().map(|p| f64::from(p.1)).sum::<f64>() as f32).max(6.103_515_6e-5);
                w.iter_mut().for_each(|p| p.1 /= sum);
            }
            w.iter_mut().for_each(|p| p.1 *= r.scale);
            w
        }

        let mut rng = StdRng::seed_from_u64(3);
        for case in 0..2000 {
            let (r, n, most) = routing_case(case);
            let k = rng.gen_range(1..=most).min(8);
            let logits: Vec<f32> = (0..n).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
            let bias: Vec<f32> = (0..n).map(|_| rng.gen_range(-0.5f32..0.5)).collect();
            let bias = (case % 7 != 0).then_some(&bias[..]);
            let mut picks = vec![(0, 0.0); k];
            routed(&logits, bias, &r, &mut picks);
            let want = reference(&logits, bias, &r, k);
            assert_eq!(
                picks.iter().map(|p| p.0).collect::<Vec<_>>(),
                want.iter().map(|p| p.0).collect::<Vec<_>>(),
                "case {case}: {r:?}"
            );
            for (p, w) in picks.iter().zip(&want) {
                assert!(
                    (p.1 - w.1).abs() <= 1e-6 * w.1.abs().max(1.0),
                    "case {case}: {picks:?} vs {want:?}"
                );
            }
        }
    }

    /// Layer `il`'s mixture over the rows of `x` in one pass of `n_rows`-row buffers.
    fn run_ffn(m: &Model, il: usize, x: &[f32], numerics: Numerics) -> Vec<f32> {
        run_ffn_with(m, il, x, numerics, None)
    }

    fn run_ffn_with(m: &Model, il: usize, x: &[f32], numerics: Numerics, peer: Option<&dyn RemoteExperts>) -> Vec<f32> {
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
            experts: peer,
        };
        let mut b = Buffers::new(hp, n, 8, 2);
        b.xn[..x.len()].copy_from_slice(x);
        let Ffn::Moe(w) = &m.layer(il).ffn else {
            panic!("layer {il} has no experts")
        };
        ffn(&step, w, &mut b);
        b.xn[..x.len()].to_vec()
    }

    /// Experts left on disk stay in the map; by default they go wherever loading puts the other multiplied weights
    /// (this F32 model repacks nothing, so all stay mapped here; a quantized one moves them into the arena); both
    /// compute the same mixture.
    #[test]
    fn experts_on_disk_stay_mapped_and_compute_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let resident = crate::engine::batch::tests::tiny(crate::model::Arch::Qwen3Moe, dir.path());
        let on_disk = Model::from_file_placed(resident.file.clone(), None, true).unwrap();
        let is_mapped = |x: &Matrix| matches!(x.data, Bytes::Mapped { .. });
        let experts_mapped = |m: &Model| {
            let Ffn::Moe(w) = &m.layer(0).ffn else { unreachable!() };
            let all = || w.gate.mats.iter().chain(&w.up.mats).chain(&w.down.mats);
            (all().all(is_mapped), all().any(is_mapped))
        };
        assert_eq!(
            experts_mapped(&on_disk),
            (true, true),
            "--experts-on-disk moved experts out of the map"
        );
        let others = is_mapped(&resident.layer(0).wq);
        assert_eq!(
            experts_mapped(&resident),
            (others, others),
            "the experts did not follow the other weights"
        );
        let e = resident.hp.n_embd;
        let mut rng = StdRng::seed_from_u64(9);
        let x: Vec<f32> = (0..5 * e).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
        assert_eq!(
            run_ffn(&resident, 1, &x, Numerics::Fast),
            run_ffn(&on_disk, 1, &x, Numerics::Fast)
        );
    }

    /// `down(silu(gate · x) * (up · x))` with f64 dot products: a feed-forward computed the plain way.
    fn plain_glu(gate: &Matrix, up: &Matrix, down: &Matrix, x: &[f32]) -> Vec<f64> {
        let (g, u, d) = (gate.to_f32(), up.to_f32(), down.to_f32());
        let dot = |m: &[f32], v: &[f32], i: usize| -> f64 {
            m[i * v.len()..(i + 1) * v.len()]
                .iter()
                .zip(v)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum()
        };
        let h: Vec<f32> = (0..gate.rows)
            .map(|i| {
                let (gv, uv) = (dot(&g, x, i), dot(&u, x, i));
                (gv / (1.0 + (-gv).exp()) * uv) as f32
            })
            .collect();
        (0..down.rows).map(|o| dot(&d, &h, o)).collect()
    }

    /// On a random-weight qwen3moe and on the generated dots1 (sigmoid gating, selection bias, groups, scale, two
    /// shared experts): a batch of rows grouped by expert gives each row the bits it gets alone (a decode step), and
    /// both are the mixture computed the plain way (every expert's matrices as f32, f64 sums, the shared experts'
    /// output added).
    #[test]
    fn grouped_batch_matches_rows_alone_and_the_plain_sum() {
        let dir = tempfile::tempdir().unwrap();
        let qwen = crate::engine::batch::tests::tiny(crate::model::Arch::Qwen3Moe, dir.path());
        let dots = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/dots1.gguf");
        let dots = Arc::new(Model::load(&dots).unwrap());
        assert!(dots.hp.moe.as_ref().unwrap().routing.n_shared > 0);
        for (m, layers) in [(&qwen, [0, 3]), (&dots, [1, 2])] {
            let (e, n) = (m.hp.n_embd, 40);
            let moe = m.hp.moe.clone().unwrap();
            let mut rng = StdRng::seed_from_u64(7);
            let x: Vec<f32> = (0..n * e).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
            let arch = m.hp.arch.name();
            for numerics in [Numerics::Fast, Numerics::Ggml] {
                for il in layers {
                    let batch = run_ffn(m, il, &x, numerics);
                    let mut used = vec![false; moe.n_expert];
                    for t in 0..n {
                        let row = &x[t * e..(t + 1) * e];
                        let alone = run_ffn(m, il, row, numerics);
                        assert!(
                            alone == batch[t * e..(t + 1) * e],
                            "{arch} {numerics:?} layer {il} row {t}: the batch changed its bits"
                        );

                        let Ffn::Moe(w) = &m.layer(il).ffn else { unreachable!() };
                        let router = w.router.to_f32();
                        let logits: Vec<f32> = router
                            .chunks(e)
                            .map(|r| r.iter().zip(row).map(|(a, b)| f64::from(a * b)).sum::<f64>() as f32)
                            .collect();
                        let mut picks = vec![(0, 0.0); moe.n_expert_used];
                        routed(&logits, w.bias.as_deref(), &moe.routing, &mut picks);
                        let mut want = match &w.shared {
                            Some(d) => plain_glu(&d.gate, &d.up, &d.down, row),
                            None => vec![0.0f64; e],
                        };
                        for &(ex, wt) in &picks {
                            used[ex] = true;
                            let y = plain_glu(&w.gate.mats[ex], &w.up.mats[ex], &w.down.mats[ex], row);
                            for (wo, yo) in want.iter_mut().zip(y) {
                                *wo += f64::from(wt) * yo;
                            }
                        }
                        let err = want
                            .iter()
                            .zip(&alone)
                            .map(|(a, b)| (*a as f32 - b).abs())
                            .fold(0.0, f32::max);
                        assert!(
                            err < 1e-3,
                            "{arch} {numerics:?} layer {il} row {t}: differs from the plain sum by {err}"
                        );
                    }
                    // The rows spread over several experts, so the grouping is exercised.
                    assert!(used.iter().filter(|&&u| u).count() >= 4, "{arch}: {used:?}");
                }
            }
        }
    }

    /// A peer in this process: runs the picks it is sent on its own copy of the layer (as a node would), or fails
    /// as told, counting what it ran.
    struct FakePeer {
        model: Arc<Model>,
        fail: Option<&'static str>,
        sent: std::sync::Mutex<Vec<Pick>>,
    }

    impl RemoteExperts for FakePeer {
        fn available(&self) -> bool {
            true
        }

        fn run(&self, layer: usize, x: &[f32], picks: &[Pick], local: &mut dyn FnMut()) -> Result<Vec<f32>> {
            self.sent.lock().unwrap().extend_from_slice(picks);
            match self.fail {
                Some("before") => bail!("connection refused"),
                Some("after") => {
                    local();
                    bail!("closed")
                }
                _ => {}
            }
            local();
            let hp = &self.model.hp;
            let (pool, rope) = (ThreadPool::new(1), RopeTable::new(hp.rope_base, hp.n_rot, 8));
            let step = Step {
                hp,
                pool: &pool,
                rope: &rope,
                il: layer,
                n_tok: x.len() / hp.n_embd,
                be: crate::backend::for_numerics(Numerics::Fast),
                experts: None,
            };
            let mut b = Buffers::new(hp, 64, 8, 1);
            let Ffn::Moe(w) = &self.model.layer(layer).ffn else {
                bail!("layer {layer} has no experts")
            };
            serve_picks(&step, w, x, picks, &mut b)
        }
    }

    /// Half the experts on a peer: the same bits as all here, for a batch and for single rows, whether the peer
    /// answers or fails before or after this side's share; the peer got about half of the picks.
    #[test]
    fn split_with_a_peer_gives_the_bits_of_one_process() {
        let dir = tempfile::tempdir().unwrap();
        let m = crate::engine::batch::tests::tiny(crate::model::Arch::Qwen3Moe, dir.path());
        let (e, n) = (m.hp.n_embd, 40);
        let k = m.hp.moe.as_ref().unwrap().n_expert_used;
        let mut rng = StdRng::seed_from_u64(11);
        let x: Vec<f32> = (0..n * e).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
        for fail in [None, Some("before"), Some("after")] {
            let peer = FakePeer {
                model: m.clone(),
                fail,
                sent: Default::default(),
            };
            for rows in [&x[..], &x[..e]] {
                let alone = run_ffn(&m, 1, rows, Numerics::Fast);
                let split = run_ffn_with(&m, 1, rows, Numerics::Fast, Some(&peer));
                assert!(
                    alone == split,
                    "{fail:?}, {} rows: the split changed the bits",
                    rows.len() / e
                );
            }
            let sent = peer.sent.lock().unwrap().len();
            let all = (n + 1) * k;
            assert!(
                sent * 10 >= all * 3 && sent * 10 <= all * 7,
                "{fail:?}: the peer got {sent} of {all} picks"
            );
        }
    }

    /// Experts split by load: a decode step's k experts go k/2 each way; a batch's rows about evenly.
    #[test]
    fn experts_split_by_rows() {
        let pick = |row, expert| Pick {
            row,
            expert,
            weight: 1.0,
        };
        let (mut by, mut load, mut remote) = (Vec::new(), vec![0; 9], vec![false; 8]);
        split_experts(
            &[pick(0, 5), pick(0, 2), pick(0, 7), pick(0, 1)],
            8,
            &mut by,
            &mut load,
            &mut remote,
        );
        assert_eq!(remote.iter().filter(|&&r| r).count(), 2, "{remote:?}");
        // Expert 3 has 5 rows, 0 has 3, 6 has 2: 3 alone here, 0 and 6 there (5 rows each).
        let mut picks = vec![];
        for (ex, rows) in [(3, 5), (0, 3), (6, 2)] {
            picks.extend((0..rows).map(|r| pick(r, ex)));
        }
        split_experts(&picks, 8, &mut by, &mut load, &mut remote);
        assert_eq!((0..8).filter(|&ex| remote[ex]).collect::<Vec<_>>(), [0, 6]);
    }

    /// What a node is sent is checked: rows beyond the scratch, experts and rows out of range, non-finite weights.
    #[test]
    fn served_picks_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let m = crate::engine::batch::tests::tiny(crate::model::Arch::Qwen3Moe, dir.path());
        let hp = &m.hp;
        let (pool, rope) = (ThreadPool::new(1), RopeTable::new(hp.rope_base, hp.n_rot, 8));
        let step = Step {
            hp,
            pool: &pool,
            rope: &rope,
            il: 0,
            n_tok: 2,
            be: crate::backend::for_numerics(Numerics::Fast),
            experts: None,
        };
        let Ffn::Moe(w) = &m.layer(0).ffn else { unreachable!() };
        let mut b = Buffers::new(hp, 2, 8, 1);
        let x = vec![0.5; 2 * hp.n_embd];
        let n_x = hp.moe.as_ref().unwrap().n_expert as u32;
        let ok = Pick {
            row: 1,
            expert: n_x - 1,
            weight: 0.5,
        };
        assert_eq!(
            serve_picks(&step, w, &x, &[ok, ok], &mut b).unwrap().len(),
            2 * hp.n_embd
        );
        let bad = [
            Pick { expert: n_x, ..ok },
            Pick { row: 2, ..ok },
            Pick { weight: f32::NAN, ..ok },
        ];
        for p in bad {
            let err = serve_picks(&step, w, &x, &[p], &mut b).unwrap_err().to_string();
            assert!(err.contains("out of range"), "{p:?}: {err}");
        }
        let err = serve_picks(&step, w, &vec![0.5; 3 * hp.n_embd], &[ok], &mut b).unwrap_err();
        assert!(err.to_string().contains("rows"), "{err}");
        let many = vec![ok; 2 * hp.moe.as_ref().unwrap().n_expert_used + 1];
        assert!(serve_picks(&step, w, &x, &many, &mut b).is_err());
    }
}
