//! Attention over the f16 KV cache (`shaders/attention.wgsl`); the writes into it are `rope.rs`'s.
//!
//! The cache is one layer's K `[n_head_kv, n_ctx, hdk]` and V `[n_head_kv, n_ctx, hdv]`, f16, as the CPU keeps it
//! (`backend::LayerKv`), so a handoff or snapshot reads the same layout from either backend.

use super::buffers::{Halves, Tensor, U32s};
use super::rope::Ready;
use super::{Pass, env_number, module, u32_of, wgsl};
use crate::backend::AttnShape;
use anyhow::{Result, ensure};
use std::sync::OnceLock;

/// Largest head the attention shader takes (its query and output live in 256-float workgroup arrays).
const MAX_HEAD: usize = 256;

/// Workgroups an attention dispatch should reach for a GPU to be busy: a decode step's (head, row) pairs are split
/// over positions until there are about this many (`BATON_GPU_ATTN_BUSY` sets it, to measure).
fn busy() -> usize {
    static BUSY: OnceLock<usize> = OnceLock::new();
    *BUSY.get_or_init(|| env_number("BATON_GPU_ATTN_BUSY", |&v: &usize| v >= 1, 1024))
}

/// Rows a workgroup attends for a batch of `n_tok` (the shader's ROWS): 4 from 4 rows on, which share the keys
/// and values it loads, else 1. `BATON_GPU_ATTN_ROWS=1` keeps one row a workgroup, to measure.
fn rows_for(n_tok: usize) -> usize {
    static ROWS: OnceLock<usize> = OnceLock::new();
    let most = *ROWS.get_or_init(|| env_number("BATON_GPU_ATTN_ROWS", |&v: &usize| v == 1 || v == 4, 4));
    if n_tok >= 4 { most } else { 1 }
}

/// The module's head for `rows` rows a workgroup: ROWS, and the helpers that set (`lane`) and get (`pick`) a row's
/// component of a `Red` (f32 for one row, vec4<f32> for 4).
fn rows_head(rows: usize) -> String {
    let (set, get) = if rows == 1 {
        ("*v = x;", "v")
    } else {
        ("(*v)[r] = x;", "v[r]")
    };
    format!(
        "const ROWS: u32 = {rows}u;\n\
         fn lane(v: ptr<function, Red>, r: u32, x: f32) {{ {set} }}\n\
         fn pick(v: Red, r: u32) -> f32 {{ return {get}; }}\n"
    )
}

/// Positions per split and splits per (head, group of rows) for `pairs` such pairs over the first `span` positions:
/// one split when the pairs alone keep the GPU busy or the span is one chunk, else up to `busy() / pairs` splits of
/// whole 256-position chunks (the shader's).
fn attention_splits(pairs: usize, span: usize) -> (u32, u32) {
    const CHUNK: usize = 256;
    let chunks = span.div_ceil(CHUNK);
    let want = busy().div_ceil(pairs.max(1)).min(chunks);
    if want <= 1 {
        return (u32::MAX, 1);
    }
    let split = chunks.div_ceil(want) * CHUNK;
    (split as u32, span.div_ceil(split) as u32)
}

/// Where an attention dispatch's queries come from.
pub enum Queries<'a> {
    /// Rotated already (`[n_tok, n_head, hdk]`, [`Pass::rope_store`]'s), every row's K and V in the cache.
    Rotated(&'a Tensor),
    /// A decode step's projections: the dispatch makes its query heads, and the row's K and V, ready itself and
    /// stores K and V into the cache (`shaders/attention_fresh.wgsl`), one dispatch where there were two. It binds
    /// nine storage buffers, so it takes an adapter that allows that ([`Pass::attends_fresh`]).
    Fresh(&'a Ready<'a>),
}

/// Storage buffers [`Queries::Fresh`]'s dispatch binds.
const FRESH_BUFFERS: u32 = 9;

/// Whether a decode step's attention readies its queries and its own K and V itself ([`Queries::Fresh`]):
/// `BATON_GPU_FRESH=0` keeps `rope_store` a dispatch of its own, to compare; else on. It saves a dispatch a layer
/// and costs each workgroup its query head's and the row's K and V heads' loads and rotations, and 3 to 6
/// reductions (on lavapipe, whose barriers are slow, SmolLM2's attention took 1.50 ms a call against 0.98 + 0.25
/// for `attend` and `rope_store`). Read once.
fn fresh_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| env_number("BATON_GPU_FRESH", |v| *v <= 1, 1) == 1)
}

impl Pass<'_> {
    /// Whether a batch of `n_tok` rows takes [`Queries::Fresh`]: a decode step that folds its dispatches
    /// ([`Pass::folds`]) on an adapter with storage buffers enough, unless `BATON_GPU_FRESH=0`.
    pub fn attends_fresh(&self, n_tok: usize) -> bool {
        fresh_on() && self.folds(n_tok) && self.gpu().storage_buffers() >= FRESH_BUFFERS
    }

    /// Causal attention of the `a.n_tok` rows of `queries`, row `t` at position `pos[t]`, over the cache `kv` (K
    /// and V) of `n_ctx` positions per head, into `out` (`[n_tok, n_head, hdv]`).
    pub fn attend(
        &mut self,
        a: &AttnShape,
        queries: Queries,
        kv: [&Halves; 2],
        n_ctx: usize,
        pos: &U32s,
        out: &Tensor,
    ) -> Result<()> {
        let [k, v] = kv;
        ensure!(
            a.n_head_kv > 0 && a.n_head.is_multiple_of(a.n_head_kv),
            "{} query heads do not share {} KV heads evenly",
            a.n_head,
            a.n_head_kv
        );
        ensure!(
            a.hdk > 0
                && a.hdv > 0
                && a.hdk.is_multiple_of(2)
                && a.hdv.is_multiple_of(2)
                && a.hdk <= MAX_HEAD
                && a.hdv <= MAX_HEAD,
            "GPU attention takes even head sizes from 2 to {MAX_HEAD}, not {} and {}",
            a.hdk,
            a.hdv
        );
        ensure!(out.len() >= a.n_tok * a.n_head * a.hdv, "attention output too small");
        ensure!(
            k.len() >= a.n_head_kv * n_ctx * a.hdk && v.len() >= a.n_head_kv * n_ctx * a.hdv,
            "KV cache smaller than {} heads of {n_ctx} positions",
            a.n_head_kv
        );
        ensure!(
            pos.len() >= a.n_tok,
            "attention of {} rows given {} positions",
            a.n_tok,
            pos.len()
        );
        ensure!(
            (pos.max() as usize) < n_ctx,
            "attention at position {} of a cache of {n_ctx}",
            pos.max()
        );
        ensure!(a.n_head <= 65535 && a.n_tok <= 65535, "attention grid too large");
        // The words of qkv_head.wgsl's Params (zeros where the module has none of it), the snippets before
        // attention.wgsl, and the buffers.
        let (ready, snippets, mut bufs) = match &queries {
            Queries::Rotated(q) => {
                ensure!(q.len() >= a.n_tok * a.n_head * a.hdk, "attention queries too small");
                let bufs = vec![(1, &q.buf), (4, &k.buf), (5, &v.buf)];
                ([0; 11], &[wgsl::REDUCE, wgsl::ATTENTION_CACHED][..], bufs)
            }
            Queries::Fresh(r) => {
                ensure!(
                    a.n_tok == 1,
                    "attention from the projections takes one row, not {}",
                    a.n_tok
                );
                let limit = self.gpu().storage_buffers();
                ensure!(
                    limit >= FRESH_BUFFERS,
                    "attention from the projections binds {FRESH_BUFFERS} storage buffers; the adapter allows {limit}"
                );
                let snippets = &[wgsl::F16, wgsl::REDUCE, wgsl::QKV_HEAD, wgsl::ATTENTION_FRESH][..];
                (r.words(a, kv, n_ctx, pos)?, snippets, r.bufs(kv).to_vec())
            }
        };
        if a.n_tok == 0 {
            return Ok(());
        }
        let rows = rows_for(a.n_tok);
        let fresh = matches!(queries, Queries::Fresh(_));
        let (red, key) = match (rows, fresh) {
            (1, false) => ("f32", "attention"),
            (1, true) => ("f32", "attention-fresh"),
            _ => ("vec4<f32>", "attention4"),
        };
        let source = || {
            let head = rows_head(rows);
            let mut parts = vec![head.as_str()];
            parts.extend(snippets);
            parts.push(wgsl::ATTENTION);
            module(&parts)
        };
        let pipeline = self.reducing_pipeline_of(red, key, "attend", &[], source)?;
        let window = match a.window {
            Some(w) => u32_of(w.max(1), "window")?,
            None => 0,
        };
        let tiles = a.n_tok.div_ceil(rows);
        let (split, n_split) = attention_splits(tiles * a.n_head, pos.max() as usize + 1);
        let mut params = vec![
            u32_of(a.n_tok, "rows")?,
            u32_of(a.n_head, "heads")?,
            u32_of(a.n_head_kv, "KV heads")?,
            u32_of(a.hdk, "head size")?,
            u32_of(a.hdv, "head size")?,
            u32_of(n_ctx, "context")?,
            window,
            a.scale.to_bits(),
            split,
            n_split,
        ];
        params.extend(ready);
        // Without splits the partials are never written, but a buffer (not `out`: no two writable bindings of
        // one buffer) is bound there all the same.
        let part = match n_split {
            1 => self.scratch(1)?,
            n => self.scratch(a.n_tok * a.n_head * n as usize * (a.hdv + 2))?,
        };
        bufs.extend([(7, &pos.buf), (9, &out.buf), (10, &part.buf)]);
        self.dispatch(&pipeline, &params, &bufs, (a.n_head as u32, tiles as u32, n_split));
        if n_split > 1 {
            let merge = self.reducing_pipeline_of(red, key, "merge", &[], source)?;
            let bufs = [(9, &out.buf), (10, &part.buf)];
            self.dispatch(&merge, &params, &bufs, (a.n_head as u32, a.n_tok as u32, 1));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::rope::{Ready, fresh_halves};
    use super::super::test_gpu;
    use super::Queries;
    use crate::backend::AttnShape;
    use crate::kernels::attention::{self, Group};
    use crate::kernels::ops::RopeTable;
    use crate::kernels::testutil::Rng;
    use half::f16;

    /// The CPU's attention of every row and query head (the scalar reference, chunk by chunk).
    fn cpu_attend(a: &AttnShape, q: &[f32], k: &[f16], v: &[f16], n_ctx: usize, pos: &[u32]) -> Vec<f32> {
        let group = a.group();
        let mut out = vec![0.0; a.n_tok * a.n_head * a.hdv];
        let mut scratch = vec![0.0; attention::scratch_len(group, a.hdv)];
        for (t, &p) in pos.iter().enumerate().take(a.n_tok) {
            let p = p as usize;
            for kvh in 0..a.n_head_kv {
                let g = Group {
                    n_q: group,
                    hdk: a.hdk,
                    hdv: a.hdv,
                    lo: a.lo(p),
                    hi: p + 1,
                    scale: a.scale,
                };
                let h0 = t * a.n_head + kvh * group;
                attention::attend(
                    &g,
                    &q[h0 * a.hdk..(h0 + group) * a.hdk],
                    &k[kvh * n_ctx * a.hdk..(kvh + 1) * n_ctx * a.hdk],
                    &v[kvh * n_ctx * a.hdv..(kvh + 1) * n_ctx * a.hdv],
                    &mut scratch,
                    &mut out[h0 * a.hdv..(h0 + group) * a.hdv],
                );
            }
        }
        out
    }

    /// Decode (one row) and batches of rows (one and four a workgroup), with GQA, contexts shorter and longer than
    /// one 256-position chunk, a sliding window, and head sizes of 32 to 256: within 2e-5 of the CPU. Outputs are
    /// weighted means of V values of magnitude ≤ 1; the two sum the scores and weights in another order, and the
    /// exponentials differ by an ulp or two.
    #[test]
    fn attention_matches_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2140);
        let n_ctx = 700;
        let cases = [
            // (n_head, n_head_kv, hd, positions, window)
            (9, 3, 64, vec![5u32], None),
            (9, 3, 64, vec![699], None),
            (4, 1, 256, vec![600], Some(512)),
            (8, 2, 32, vec![0, 1, 255, 256, 300, 511], None),
            (8, 2, 32, vec![100, 600, 601], Some(300)),
            // Heads that leave threads idle in the weighted sum (256 / 96 = 2 groups of 96), or an odd number of
            // key words (70 = 35 words: the score's tail).
            (6, 2, 96, vec![300], None),
            (4, 2, 70, vec![2, 400], None),
            // Batches of 4 rows a workgroup: a last group of 1 row; rows far apart in one group (row 10's range
            // ends chunks before row 690's), with and without a window that starts every row's range elsewhere;
            // and few groups on a long context, split over positions and merged.
            (8, 2, 64, (0..17).map(|i| i * 41).collect(), None),
            (4, 2, 64, vec![10, 600, 20, 690, 300], None),
            (4, 2, 64, vec![10, 600, 20, 690, 300], Some(100)),
            (2, 1, 128, vec![696, 697, 698, 699], None),
        ];
        for (n_head, n_head_kv, hd, pos, window) in cases {
            let a = AttnShape {
                n_tok: pos.len(),
                n_head,
                n_head_kv,
                hdk: hd,
                hdv: hd,
                window,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let q: Vec<f32> = (0..a.n_tok * n_head * hd).map(|_| rng.normal()).collect();
            let k: Vec<f16> = (0..n_head_kv * n_ctx * hd)
                .map(|_| f16::from_f32(rng.normal()))
                .collect();
            let v: Vec<f16> = (0..n_head_kv * n_ctx * hd)
                .map(|_| f16::from_f32(2.0 * rng.uniform() - 1.0))
                .collect();
            let want = cpu_attend(&a, &q, &k, &v, n_ctx, &pos);
            let (gq, gk, gv) = (
                gpu.upload(&q).unwrap(),
                gpu.upload_halves(&k).unwrap(),
                gpu.upload_halves(&v).unwrap(),
            );
            let gp = gpu.upload_u32(&pos).unwrap();
            // The maxima and sums by subgroups and by the workgroup-memory trees.
            for sg in [true, false] {
                let out = gpu.zeros(want.len()).unwrap();
                let mut pass = gpu.pass().with_subgroups(sg);
                pass.attend(&a, Queries::Rotated(&gq), [&gk, &gv], n_ctx, &gp, &out)
                    .unwrap();
                pass.finish().unwrap();
                let got = gpu.read(&out).unwrap();
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 2e-5,
                        "heads {n_head}/{n_head_kv} hd {hd} pos {pos:?} window {window:?} subgroups {sg} at {i}: \
                         {g} vs {e}"
                    );
                }
            }
        }
    }

    /// A decode step's attention from the projections (`Queries::Fresh`) against `rope_store` then attention of
    /// the rotated queries, on the same inputs: biases and head norms or none, both RoPE styles, partial rotation,
    /// GQA, the row's position first in the cache, first in a split (its cached range empty), last of a cache
    /// split three ways, under windows of 100 and 1, heads of 64 to 256 and of 96 (threads idle in the weighted
    /// sum), and DeepSeek's K heads wider than V heads that end in their rotated part (48 = 32 + 16 with V 24,
    /// and V2-Lite's 192 = 128 + 64 with V 128). The cache and the host's run within one f16 step of the other path's (the head norm's sum is over 256
    /// threads here, 64 there), the outputs within 2e-5·(1 + |x|).
    #[test]
    fn fresh_attention_matches_rotated() {
        let Some(gpu) = test_gpu() else { return };
        let mut rng = Rng(2160);
        let n_ctx = 700;
        let cases = [
            // (n_head, n_head_kv, (hdk, hdv), (n_rot, from), position, window, biased, normed, neox)
            (8, 2, (64, 64), (64, 0), 5, None, false, false, false),
            (4, 1, (128, 128), (64, 0), 699, None, true, true, true),
            (6, 2, (64, 64), (32, 0), 512, Some(100), false, true, false),
            (2, 2, (256, 256), (256, 0), 0, None, true, false, true),
            (4, 2, (96, 96), (64, 0), 300, None, true, true, false),
            (3, 3, (64, 64), (64, 0), 40, Some(1), false, false, true),
            (4, 4, (48, 24), (16, 32), 300, None, false, false, false),
            (2, 2, (192, 128), (64, 128), 650, None, false, false, false),
        ];
        for (n_head, n_head_kv, (hdk, hdv), (n_rot, rot_at), at, window, biased, normed, neox) in cases {
            let a = AttnShape {
                n_tok: 1,
                n_head,
                n_head_kv,
                hdk,
                hdv,
                window,
                scale: 1.0 / (hdk as f32).sqrt(),
            };
            let normal = |rng: &mut Rng, len: usize, s: f32| (0..len).map(|_| rng.normal() * s).collect::<Vec<f32>>();
            let qkv = gpu.upload(&normal(&mut rng, a.qkv_width(), 1.5)).unwrap();
            let bias = [n_head * hdk, n_head_kv * hdk, n_head_kv * hdv].map(|len| normal(&mut rng, len, 0.5));
            let norm = [0, 1].map(|_| (0..hdk).map(|_| 1.0 + rng.normal() * 0.2).collect::<Vec<f32>>());
            let extras = gpu
                .upload_qkv_extras(
                    [0, 1, 2].map(|i| biased.then_some(&bias[i][..])),
                    normed.then_some([&norm[0][..], &norm[1][..]]),
                )
                .unwrap();
            let table = gpu.upload_rope(&RopeTable::new(10000.0, n_rot, n_ctx)).unwrap();
            let mut old = |hd: usize| -> Vec<f16> {
                (0..n_head_kv * n_ctx * hd)
                    .map(|_| f16::from_f32(rng.normal()))
                    .collect()
            };
            let (old_k, old_v) = (old(hdk), old(hdv));
            let gp = gpu.upload_u32(&[at]).unwrap();
            // The run for the host's copy, this layer's after another's.
            let run_at = 2 * fresh_halves(&a);
            let case = format!(
                "heads {n_head}/{n_head_kv} hd {hdk}/{hdv} rot {n_rot} from {rot_at} at {at} window {window:?}"
            );
            for sg in [true, false] {
                // (out, K, V, the host's run) of each path.
                let mut got = vec![];
                for fresh_path in [false, true] {
                    let (kc, vc) = (gpu.upload_halves(&old_k).unwrap(), gpu.upload_halves(&old_v).unwrap());
                    let run = gpu.zero_halves(run_at + fresh_halves(&a)).unwrap();
                    let (q, out) = (gpu.zeros(n_head * hdk).unwrap(), gpu.zeros(n_head * hdv).unwrap());
                    let ready = Ready {
                        qkv: &qkv,
                        extras: &extras,
                        eps: 1e-6,
                        table: &table,
                        neox,
                        rot_at,
                        fresh: (&run, run_at),
                    };
                    let mut pass = gpu.pass().with_subgroups(sg);
                    if fresh_path {
                        pass.attend(&a, Queries::Fresh(&ready), [&kc, &vc], n_ctx, &gp, &out)
                            .unwrap();
                        let two = AttnShape { n_tok: 2, ..a };
                        let two_pos = gpu.upload_u32(&[at, at]).unwrap();
                        assert!(
                            pass.attend(&two, Queries::Fresh(&ready), [&kc, &vc], n_ctx, &two_pos, &out)
                                .is_err(),
                            "two rows from the projections are refused"
                        );
                    } else {
                        pass.rope_store(&ready, &a, &q, [&kc, &vc], n_ctx, &gp).unwrap();
                        pass.attend(&a, Queries::Rotated(&q), [&kc, &vc], n_ctx, &gp, &out)
                            .unwrap();
                    }
                    pass.finish().unwrap();
                    let halves = |h| gpu.read_halves(h).unwrap();
                    got.push((gpu.read(&out).unwrap(), halves(&kc), halves(&vc), halves(&run)));
                }
                let (want, fresh) = (&got[0], &got[1]);
                for (i, (g, e)) in fresh.0.iter().zip(&want.0).enumerate() {
                    assert!(
                        (g - e).abs() <= 2e-5 * (1.0 + e.abs()),
                        "{case} subgroups {sg}: out {i}: {g} vs {e}"
                    );
                }
                for (what, g, e) in [
                    ("K", &fresh.1, &want.1),
                    ("V", &fresh.2, &want.2),
                    ("run", &fresh.3, &want.3),
                ] {
                    for (i, (g, e)) in g.iter().zip(e).enumerate() {
                        let step = (e.to_f32().abs() * 2f32.powi(-10)).max(6e-8);
                        assert!(
                            (g.to_f32() - e.to_f32()).abs() <= step,
                            "{case} subgroups {sg}: {what} at {i}: {g} vs {e}"
                        );
                    }
                }
                assert!(
                    fresh.3[run_at..].iter().any(|h| h.to_f32() != 0.0),
                    "{case}: the run is written"
                );
            }
        }
    }

    /// Decode steps are split over positions in whole chunks until about `busy()` (1024) workgroups run; batches
    /// that fill the GPU by themselves, and spans of one chunk, are not.
    #[test]
    fn attention_splits_fill_the_gpu() {
        assert_eq!(super::attention_splits(32, 4096), (256, 16));
        assert_eq!(super::attention_splits(8, 40000), (512, 79));
        assert_eq!(super::attention_splits(9, 700), (256, 3));
        assert_eq!(super::attention_splits(32, 256), (u32::MAX, 1));
        assert_eq!(super::attention_splits(16384, 4096), (u32::MAX, 1));
        assert_eq!(super::attention_splits(512, 4096), (2048, 2));
    }

    /// Four rows a workgroup from batches of four on; the module heads set and get a row's component.
    #[test]
    fn rows_a_workgroup() {
        assert_eq!((super::rows_for(1), super::rows_for(3)), (1, 1));
        if std::env::var("BATON_GPU_ATTN_ROWS").is_err() {
            assert_eq!((super::rows_for(4), super::rows_for(512)), (4, 4));
        }
        assert!(super::rows_head(1).contains("const ROWS: u32 = 1u;") && super::rows_head(1).contains("*v = x;"));
        assert!(super::rows_head(4).contains("(*v)[r] = x;") && super::rows_head(4).contains("return v[r];"));
    }
}
