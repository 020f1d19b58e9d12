//! ggml's CPU flash attention as llama.cpp runs it for a prompt: `ggml_compute_forward_flash_attn_ext_tiled`
//! (ops.cpp), taken when a batch has at least `GGML_FA_TILE_Q` = 64 query rows and K/V are F16.
//!
//! Per query row: Q stays f32, K and V are the f16 values of the cache widened to f32; positions go in tiles of
//! `GGML_FA_TILE_KV` = 64 from position 0. For each tile, the scores are a chain of FMAs over the head dimension
//! (`simd_gemm`), times the scale; the running maximum is updated from the tile's maximum (`expf` of the old minus
//! the new rescales the accumulator and the sum); the tile's softmax numerators come from [`v_expf`], summed per
//! 16 lanes by `_mm512_reduce_add_ps` into an f64 that is added to the f32 sum; the output accumulates
//! `p · V` as a chain of FMAs over the tile's positions (`simd_gemm` again). At the end it is divided by the sum.
//! Masked positions contribute exactly nothing in ggml (their numerators are 0 and `fma(0, v, acc) = acc`), so
//! only the positions `lo..hi` are visited here. Independent of how ggml groups rows into tiles and threads.

use super::ops::v_expf;
use super::reduce_add16;
use half::f16;

/// Positions per KV tile (`GGML_FA_TILE_KV`).
pub const KV_TILE: usize = 64;

/// Scratch for [`attend_row`]: the transposed K tile and the tile's scores.
pub struct Scratch {
    kt: Vec<f32>,
    kq: [f32; KV_TILE],
}

impl Scratch {
    pub fn new(hdk: usize) -> Scratch {
        Scratch {
            kt: vec![0.0; hdk * KV_TILE],
            kq: [0.0; KV_TILE],
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_row_body(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    (hdk, hdv): (usize, usize),
    (lo, hi): (usize, usize),
    scale: f32,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    let out = &mut out[..hdv];
    out.fill(0.0);
    let (mut m, mut s) = (f32::NEG_INFINITY, 0.0f32);
    let mut tile = lo / KV_TILE * KV_TILE;
    while tile < hi {
        let (a, b) = (lo.max(tile) - tile, hi.min(tile + KV_TILE) - tile);
        // K tile transposed ([dk][kv]), as ggml packs it, then the score chains, vectorised over positions.
        for tk in a..b {
            let kr = &k[(tile + tk) * hdk..(tile + tk + 1) * hdk];
            for (dk, &kv) in kr.iter().enumerate() {
                sc.kt[dk * KV_TILE + tk] = kv.to_f32();
            }
        }
        let mut acc = [0.0f32; KV_TILE];
        for (dk, &qd) in q[..hdk].iter().enumerate() {
            let kt = &sc.kt[dk * KV_TILE..(dk + 1) * KV_TILE];
            for tk in a..b {
                acc[tk] = kt[tk].mul_add(qd, acc[tk]);
            }
        }
        let kq = &mut sc.kq;
        let mut tile_max = f32::NEG_INFINITY;
        for tk in 0..KV_TILE {
            kq[tk] = if tk >= a && tk < b {
                acc[tk] * scale + 0.0
            } else {
                f32::NEG_INFINITY
            };
            if kq[tk] > tile_max {
                tile_max = kq[tk];
            }
        }
        let m_new = m.max(tile_max);
        if m_new > m {
            let ms = (m - m_new).exp();
            for o in out.iter_mut() {
                *o *= ms;
            }
            s *= ms;
        }
        m = m_new;
        // ggml_vec_soft_max_f32: 16 lanes at a time, each group's sum reduced in f32 then added in f64.
        let mut sum = 0.0f64;
        for c in 0..KV_TILE / 16 {
            let mut lanes = [0.0f32; 16];
            for (i, l) in lanes.iter_mut().enumerate() {
                let x = kq[16 * c + i];
                *l = if x == f32::NEG_INFINITY { 0.0 } else { v_expf(x - m_new) };
            }
            sum += reduce_add16(&lanes) as f64;
            kq[16 * c..16 * c + 16].copy_from_slice(&lanes);
        }
        s = (s as f64 + sum) as f32;
        for tk in a..b {
            let p = kq[tk];
            let vr = &v[(tile + tk) * hdv..(tile + tk + 1) * hdv];
            for (o, &vv) in out.iter_mut().zip(vr) {
                *o = p.mul_add(vv.to_f32(), *o);
            }
        }
        tile += KV_TILE;
    }
    let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
    for o in out.iter_mut() {
        *o *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn attend_row_fma(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    hd: (usize, usize),
    range: (usize, usize),
    scale: f32,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    attend_row_body(q, k, v, hd, range, scale, sc, out)
}

/// One query row of one head: `q` (`hdk` values) over the cached positions `lo..hi` of one KV head (`k`, `v`: rows
/// of `hdk`/`hdv` f16 values from position 0, as the cache holds them), written to `out` (`hdv` values).
#[allow(clippy::too_many_arguments)]
pub fn attend_row(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    hdk: usize,
    hdv: usize,
    lo: usize,
    hi: usize,
    scale: f32,
    sc: &mut Scratch,
    out: &mut [f32],
) {
    assert!(lo < hi && q.len() >= hdk && k.len() >= hi * hdk && v.len() >= hi * hdv && out.len() >= hdv);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA.
        unsafe { attend_row_fma(q, k, v, (hdk, hdv), (lo, hi), scale, sc, out) };
        return;
    }
    attend_row_body(q, k, v, (hdk, hdv), (lo, hi), scale, sc, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    /// Close to a plain softmax attention in f64, across tile boundaries and windows.
    #[test]
    fn tiled_attention_is_attention() {
        let mut rng = Rng(3);
        let (hdk, hdv) = (64, 48);
        for (lo, hi) in [(0, 1), (0, 64), (0, 65), (10, 200), (130, 131), (5, 512)] {
            let q: Vec<f32> = (0..hdk).map(|_| rng.normal()).collect();
            let k: Vec<f16> = (0..hi * hdk).map(|_| f16::from_f32(rng.normal())).collect();
            let v: Vec<f16> = (0..hi * hdv).map(|_| f16::from_f32(rng.normal())).collect();
            let mut out = vec![0.0; hdv];
            let mut sc = Scratch::new(hdk);
            attend_row(&q, &k, &v, hdk, hdv, lo, hi, 0.125, &mut sc, &mut out);
            let s: Vec<f64> = (lo..hi)
                .map(|j| (0..hdk).map(|d| q[d] as f64 * k[j * hdk + d].to_f64()).sum::<f64>() * 0.125)
                .collect();
            let mx = s.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let tot: f64 = e.iter().sum();
            for d in 0..hdv {
                let want: f64 = (lo..hi).map(|j| e[j - lo] * v[j * hdv + d].to_f64()).sum::<f64>() / tot;
                assert!(
                    (out[d] as f64 - want).abs() < 1e-5,
                    "{lo}..{hi} [{d}]: {} vs {want}",
                    out[d]
                );
            }
        }
    }
}
