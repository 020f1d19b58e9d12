//! Attention over the f16 KV cache (`shaders/attention.wgsl`); the writes into it are `rope.rs`'s.
//!
//! The cache is one layer's K `[n_head_kv, n_ctx, hdk]` and V `[n_head_kv, n_ctx, hdv]`, f16, as the CPU keeps it
//! (`backend::LayerKv`), so a handoff or snapshot reads the same layout from either backend.

use super::buffers::{Halves, Tensor, U32s};
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

impl Pass<'_> {
    /// Causal attention of the `a.n_tok` rows of `q` (`[n_tok, n_head, hdk]`), row `t` at position `pos[t]`, over
    /// the cache `k`/`v` of `n_ctx` positions per head, into `out` (`[n_tok, n_head, hdv]`).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &mut self,
        a: &AttnShape,
        q: &Tensor,
        k: &Halves,
        v: &Halves,
        n_ctx: usize,
        pos: &U32s,
        out: &Tensor,
    ) -> Result<()> {
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
        ensure!(q.len() >= a.n_tok * a.n_head * a.hdk, "attention queries too small");
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
        if a.n_tok == 0 {
            return Ok(());
        }
        let rows = rows_for(a.n_tok);
        let (red, key) = if rows == 1 {
            ("f32", "attention")
        } else {
            ("vec4<f32>", "attention4")
        };
        let source = || module(&[&rows_head(rows), wgsl::REDUCE, wgsl::ATTENTION]);
        let pipeline = self.reducing_pipeline_of(red, key, "attend", &[], source)?;
        let window = match a.window {
            Some(w) => u32_of(w.max(1), "window")?,
            None => 0,
        };
        let tiles = a.n_tok.div_ceil(rows);
        let (split, n_split) = attention_splits(tiles * a.n_head, pos.max() as usize + 1);
        let params = [
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
        // Without splits the partials are never written, but a buffer (not `out`: no two writable bindings of
        // one buffer) is bound there all the same.
        let part = match n_split {
            1 => self.scratch(1)?,
            n => self.scratch(a.n_tok * a.n_head * n as usize * (a.hdv + 2))?,
        };
        let bufs = [
            (1, &q.buf),
            (2, &k.buf),
            (3, &v.buf),
            (4, &pos.buf),
            (5, &out.buf),
            (6, &part.buf),
        ];
        self.dispatch(&pipeline, &params, &bufs, (a.n_head as u32, tiles as u32, n_split));
        if n_split > 1 {
            let merge = self.reducing_pipeline_of(red, key, "merge", &[], source)?;
            let bufs = [(5, &out.buf), (6, &part.buf)];
            self.dispatch(&merge, &params, &bufs, (a.n_head as u32, a.n_tok as u32, 1));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::backend::AttnShape;
    use crate::kernels::attention::{self, Group};
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
                pass.attend(&a, &gq, &gk, &gv, n_ctx, &gp, &out).unwrap();
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
