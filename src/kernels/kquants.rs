//! The 256-weight "K" super-block formats (Q2_K..Q6_K, and Q8_K, the activation type they are dotted with):
//! ggml's byte layouts, scalar dequantization, the Q8_K quantizer and the scalar reference dot products.
//!
//! Layouts (little-endian, packed, offsets in bytes):
//! - Q2_K (84): `scales[16]` (low nibble scale, high nibble min, one per 16 weights) `qs[64]` `d:f16` `dmin:f16`
//! - Q3_K (110): `hmask[32]` `qs[64]` `scales[12]` (sixteen 6-bit scales, biased by 32) `d:f16`
//! - Q4_K (144): `d:f16` `dmin:f16` `scales[12]` (eight 6-bit scale/min pairs) `qs[128]`
//! - Q5_K (176): `d:f16` `dmin:f16` `scales[12]` `qh[32]` `qs[128]`
//! - Q6_K (210): `ql[128]` `qh[64]` `scales:i8[16]` `d:f16`
//! - Q8_K (292): `d:f32` `qs:i8[256]` `bsums:i16[16]` (sums of each 16 quants)

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use super::blocks32::f16_at;

/// Weights per super-block.
pub const QK_K: usize = 256;
pub const Q2_K_BYTES: usize = 84;
pub const Q3_K_BYTES: usize = 110;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;
pub const Q8_K_BYTES: usize = 292;

fn check(src: &[u8], dst: &[f32], bytes: usize) {
    assert!(
        dst.len().is_multiple_of(QK_K),
        "row length {} is not a multiple of {QK_K}",
        dst.len()
    );
    assert_eq!(
        src.len(),
        dst.len() / QK_K * bytes,
        "source bytes do not match the row length"
    );
}

/// Scale and min `j` (0..8) of the 12-byte packed 6-bit table of Q4_K/Q5_K.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen signed scales of a Q3_K block (6-bit values minus 32).
#[inline(always)]
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for j in 0..16 {
        let low = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = ((low | (high << 4)) as i8) - 32;
    }
    out
}

pub fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q2_K_BYTES);
    for (b, y) in src.chunks_exact(Q2_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_at(b, 80), f16_at(b, 82));
        let sc = &b[0..16];
        let mut is = 0;
        for half in 0..2 {
            let q = &b[16 + 32 * half..16 + 32 * half + 32];
            for j in 0..4 {
                let shift = 2 * j;
                for part in 0..2 {
                    let s = sc[is];
                    is += 1;
                    let (dl, ml) = (d * (s & 0xf) as f32, min * (s >> 4) as f32);
                    for l in 0..16 {
                        let v = (q[16 * part + l] >> shift) & 3;
                        y[128 * half + 32 * j + 16 * part + l] = dl * v as f32 - ml;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q3_K_BYTES);
    for (b, y) in src.chunks_exact(Q3_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d_all = f16_at(b, 108);
        let hm = &b[0..32];
        let scales = q3k_scales(&b[96..108]);
        let mut is = 0;
        let mut m = 1u8;
        for half in 0..2 {
            let q = &b[32 + 32 * half..32 + 32 * half + 32];
            for j in 0..4 {
                let shift = 2 * j;
                for part in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for l in 16 * part..16 * part + 16 {
                        let v = ((q[l] >> shift) & 3) as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                        y[128 * half + 32 * j + l] = dl * v as f32;
                    }
                }
                m <<= 1;
            }
        }
    }
}

pub fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q4_K_BYTES);
    for (b, y) in src.chunks_exact(Q4_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_at(b, 0), f16_at(b, 2));
        let scales = &b[4..16];
        for j in 0..4 {
            let q = &b[16 + 32 * j..48 + 32 * j];
            let (s1, m1) = scale_min_k4(2 * j, scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, scales);
            let (d1, m1) = (d * s1 as f32, min * m1 as f32);
            let (d2, m2) = (d * s2 as f32, min * m2 as f32);
            for l in 0..32 {
                y[64 * j + l] = d1 * (q[l] & 0xf) as f32 - m1;
                y[64 * j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q5_K_BYTES);
    for (b, y) in src.chunks_exact(Q5_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let (d, min) = (f16_at(b, 0), f16_at(b, 2));
        let scales = &b[4..16];
        let qh = &b[16..48];
        for j in 0..4 {
            let ql = &b[48 + 32 * j..80 + 32 * j];
            let (s1, m1) = scale_min_k4(2 * j, scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, scales);
            let (d1, m1) = (d * s1 as f32, min * m1 as f32);
            let (d2, m2) = (d * s2 as f32, min * m2 as f32);
            let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                y[64 * j + l] = d1 * ((ql[l] & 0xf) + h1) as f32 - m1;
                y[64 * j + 32 + l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

/// The 6-bit quant `l` (0..128) of half `half` of a Q6_K block, minus 32, in the four interleaved groups.
#[inline(always)]
fn q6k_quants(b: &[u8], half: usize, l: usize) -> [i32; 4] {
    let ql = &b[64 * half..64 * half + 64];
    let qh = b[128 + 32 * half + l];
    [
        ((ql[l] & 0xf) | ((qh & 3) << 4)) as i32 - 32,
        ((ql[l + 32] & 0xf) | (((qh >> 2) & 3) << 4)) as i32 - 32,
        ((ql[l] >> 4) | (((qh >> 4) & 3) << 4)) as i32 - 32,
        ((ql[l + 32] >> 4) | (((qh >> 6) & 3) << 4)) as i32 - 32,
    ]
}

pub fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q6_K_BYTES);
    for (b, y) in src.chunks_exact(Q6_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 208);
        let sc = &b[192..208];
        for half in 0..2 {
            for l in 0..32 {
                let is = l / 16;
                let q = q6k_quants(b, half, l);
                for (k, qk) in q.iter().enumerate() {
                    let s = sc[8 * half + is + 2 * k] as i8 as f32;
                    y[128 * half + 32 * k + l] = d * s * *qk as f32;
                }
            }
        }
    }
}

pub fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q8_K_BYTES);
    for (b, y) in src.chunks_exact(Q8_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for j in 0..QK_K {
            y[j] = d * b[4 + j] as i8 as f32;
        }
    }
}

/// Activations to Q8_K, as ggml's reference: the value of largest magnitude maps to -127 (so `d` may be
/// negative), round half to even, and the sums of each 16 quants are kept for the min terms of the dots.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(QK_K),
        "row length {} is not a multiple of {QK_K}",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len() / QK_K * Q8_K_BYTES,
        "output bytes do not match the row length"
    );
    for (v, b) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q8_K_BYTES)) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &a in v {
            if a.abs() > amax {
                amax = a.abs();
                max = a;
            }
        }
        if amax == 0.0 {
            b.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for j in 0..QK_K {
            b[4 + j] = ((iscale * v[j]).round_ties_even() as i32).min(127) as i8 as u8;
        }
        for g in 0..16 {
            let s: i32 = b[4 + 16 * g..20 + 16 * g].iter().map(|&q| q as i8 as i32).sum();
            b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// Weights to Q4_K (`baton quantize`): each 32-weight sub-block fitted as `scale · q + min` (q in 0..16, min ≤ 0)
/// by least squares over a few trial scales, then the eight scales and mins put on 6-bit grids of the block's `d`
/// and `dmin`, and the weights quantized again against the scales as stored.
pub fn quantize_row_q4_k(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        x.len() / QK_K * Q4_K_BYTES,
        "output bytes do not match the row length"
    );
    for (v, b) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(Q4_K_BYTES)) {
        let fits: Vec<(f32, f32)> = v.chunks_exact(32).map(fit_scale_min).collect();
        let max_scale = fits.iter().fold(0.0f32, |m, f| m.max(f.0));
        let max_min = fits.iter().fold(0.0f32, |m, f| m.max(-f.1));
        let d = super::blocks32::f16_bytes(max_scale / 63.0);
        let dmin = super::blocks32::f16_bytes(max_min / 63.0);
        let (df, dminf) = (f16_at(&d, 0), f16_at(&dmin, 0));
        let q6 = |v: f32, step: f32| {
            if step > 0.0 {
                (v / step).round().clamp(0.0, 63.0) as u8
            } else {
                0
            }
        };
        let sc: Vec<u8> = fits.iter().map(|f| q6(f.0, df)).collect();
        let mn: Vec<u8> = fits.iter().map(|f| q6(-f.1, dminf)).collect();
        b.fill(0);
        b[0..2].copy_from_slice(&d);
        b[2..4].copy_from_slice(&dmin);
        for j in 0..4 {
            b[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
            b[8 + j] = mn[j] | (mn[j + 4] >> 4) << 6;
            b[12 + j] = (sc[j + 4] & 0xf) | (mn[j + 4] & 0xf) << 4;
        }
        for s in 0..8 {
            let (dl, ml) = (df * sc[s] as f32, dminf * mn[s] as f32);
            let id = if dl > 0.0 { 1.0 / dl } else { 0.0 };
            for l in 0..32 {
                let q = ((v[32 * s + l] + ml) * id).round().clamp(0.0, 15.0) as u8;
                b[16 + 32 * (s / 2) + l] |= q << (4 * (s % 2));
            }
        }
    }
}

/// The `(scale, min)` with `x ≈ scale · q + min`, q in 0..16 and min ≤ 0, of least squared error among the
/// least-squares fits of the quants that a few trial scales over the block's range give.
fn fit_scale_min(x: &[f32]) -> (f32, f32) {
    let lo = x.iter().fold(0.0f32, |m, &v| m.min(v));
    let hi = x.iter().fold(f32::MIN, |m, &v| m.max(v));
    if hi <= lo {
        return (0.0, lo);
    }
    let n = x.len() as f32;
    let mut best = (f32::MAX, (hi - lo) / 15.0, lo);
    for step in -6..=6 {
        let iscale = (15.0 + 0.25 * step as f32) / (hi - lo);
        let (mut sl, mut sl2, mut sx, mut slx) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        let qs: Vec<f32> = x
            .iter()
            .map(|&v| ((v - lo) * iscale).round().clamp(0.0, 15.0))
            .collect();
        for (&q, &v) in qs.iter().zip(x) {
            sl += q;
            sl2 += q * q;
            sx += v;
            slx += q * v;
        }
        let det = n * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let (mut scale, mut min) = ((n * slx - sl * sx) / det, (sl2 * sx - sl * slx) / det);
        if min > 0.0 {
            (scale, min) = (slx / sl2, 0.0);
        }
        if scale <= 0.0 {
            continue;
        }
        let err: f32 = qs.iter().zip(x).map(|(&q, &v)| (scale * q + min - v).powi(2)).sum();
        if err < best.0 {
            best = (err, scale, min);
        }
    }
    (best.1, best.2)
}

/// The parts of a Q8_K block the dots read.
#[inline(always)]
pub fn q8k_parts(y: &[u8]) -> (f32, &[u8], [i32; 16]) {
    let d = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
    let mut bs = [0i32; 16];
    for (g, s) in bs.iter_mut().enumerate() {
        *s = i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32;
    }
    (d, &y[4..260], bs)
}

pub fn dot_q2_k_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q2_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, bsums) = q8k_parts(y);
        let sc = &b[0..16];
        let summs: i32 = (0..16).map(|j| (sc[j] >> 4) as i32 * bsums[j]).sum();
        let mut isum = 0i32;
        for half in 0..2 {
            let q = &b[16 + 32 * half..48 + 32 * half];
            for j in 0..4 {
                for part in 0..2 {
                    let g = 8 * half + 2 * j + part;
                    let base = 128 * half + 32 * j + 16 * part;
                    let s: i32 = (0..16)
                        .map(|l| ((q[16 * part + l] >> (2 * j)) & 3) as i32 * q8[base + l] as i8 as i32)
                        .sum();
                    isum += (sc[g] & 0xf) as i32 * s;
                }
            }
        }
        sum += yd * f16_at(b, 80) * isum as f32 - yd * f16_at(b, 82) * summs as f32;
    }
    sum
}

pub fn dot_q3_k_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q3_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, _) = q8k_parts(y);
        let scales = q3k_scales(&b[96..108]);
        let hm = &b[0..32];
        let mut isum = 0i32;
        for half in 0..2 {
            let q = &b[32 + 32 * half..64 + 32 * half];
            for j in 0..4 {
                let m = 1u8 << (4 * half + j);
                for part in 0..2 {
                    let g = 8 * half + 2 * j + part;
                    let base = 128 * half + 32 * j;
                    let s: i32 = (16 * part..16 * part + 16)
                        .map(|l| {
                            let v = ((q[l] >> (2 * j)) & 3) as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                            v * q8[base + l] as i8 as i32
                        })
                        .sum();
                    isum += scales[g] as i32 * s;
                }
            }
        }
        sum += f16_at(b, 108) * yd * isum as f32;
    }
    sum
}

pub fn dot_q4_k_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q4_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, bsums) = q8k_parts(y);
        let scales = &b[4..16];
        let (mut isum, mut summs) = (0i32, 0i32);
        for j in 0..4 {
            let q = &b[16 + 32 * j..48 + 32 * j];
            let (s1, m1) = scale_min_k4(2 * j, scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, scales);
            let mut a1 = 0i32;
            let mut a2 = 0i32;
            for l in 0..32 {
                a1 += (q[l] & 0xf) as i32 * q8[64 * j + l] as i8 as i32;
                a2 += (q[l] >> 4) as i32 * q8[64 * j + 32 + l] as i8 as i32;
            }
            isum += s1 as i32 * a1 + s2 as i32 * a2;
            summs += m1 as i32 * (bsums[4 * j] + bsums[4 * j + 1]) + m2 as i32 * (bsums[4 * j + 2] + bsums[4 * j + 3]);
        }
        sum += yd * f16_at(b, 0) * isum as f32 - yd * f16_at(b, 2) * summs as f32;
    }
    sum
}

pub fn dot_q5_k_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q5_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, bsums) = q8k_parts(y);
        let scales = &b[4..16];
        let qh = &b[16..48];
        let (mut isum, mut summs) = (0i32, 0i32);
        for j in 0..4 {
            let ql = &b[48 + 32 * j..80 + 32 * j];
            let (s1, m1) = scale_min_k4(2 * j, scales);
            let (s2, m2) = scale_min_k4(2 * j + 1, scales);
            let mut a1 = 0i32;
            let mut a2 = 0i32;
            for l in 0..32 {
                let v1 = (ql[l] & 0xf) as i32 + (((qh[l] >> (2 * j)) & 1) as i32) * 16;
                let v2 = (ql[l] >> 4) as i32 + (((qh[l] >> (2 * j + 1)) & 1) as i32) * 16;
                a1 += v1 * q8[64 * j + l] as i8 as i32;
                a2 += v2 * q8[64 * j + 32 + l] as i8 as i32;
            }
            isum += s1 as i32 * a1 + s2 as i32 * a2;
            summs += m1 as i32 * (bsums[4 * j] + bsums[4 * j + 1]) + m2 as i32 * (bsums[4 * j + 2] + bsums[4 * j + 3]);
        }
        sum += yd * f16_at(b, 0) * isum as f32 - yd * f16_at(b, 2) * summs as f32;
    }
    sum
}

pub fn dot_q6_k_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q6_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, _) = q8k_parts(y);
        let sc = &b[192..208];
        let mut acc = [0i32; 16];
        for half in 0..2 {
            for l in 0..32 {
                let q = q6k_quants(b, half, l);
                for (k, qk) in q.iter().enumerate() {
                    let pos = 128 * half + 32 * k + l;
                    acc[pos / 16] += qk * q8[pos] as i8 as i32;
                }
            }
        }
        let isum: i32 = (0..16).map(|g| sc[g] as i8 as i32 * acc[g]).sum();
        sum += f16_at(b, 208) * yd * isum as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{Rng, random_blocks, rel_close};

    #[test]
    fn q3k_scale_unpacking_matches_ggml_bit_shuffle() {
        // ggml unpacks with 32-bit masks; do the same here independently and compare.
        let mut rng = Rng(5);
        for _ in 0..100 {
            let s: Vec<u8> = (0..12).map(|_| rng.next() as u8).collect();
            let mut aux = [0u32; 4];
            for (i, a) in aux.iter_mut().take(3).enumerate() {
                *a = u32::from_le_bytes(s[4 * i..4 * i + 4].try_into().unwrap());
            }
            let (k1, k2) = (0x03030303u32, 0x0f0f0f0fu32);
            let tmp = aux[2];
            aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
            aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
            aux[0] = (aux[0] & k2) | ((tmp & k1) << 4);
            aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
            let want: Vec<i8> = aux.iter().flat_map(|a| a.to_le_bytes()).map(|b| b as i8 - 32).collect();
            assert_eq!(q3k_scales(&s).to_vec(), want);
        }
    }

    #[test]
    fn hand_built_q4_k_block() {
        // d = 1, dmin = 0.5; scale/min pair j = (j + 1, j) for j < 4, and (j + 1 + 16, j + 32) for j >= 4 so the
        // high bits are exercised; every quant nibble = 3 (low) and 5 (high).
        let mut b = vec![0x00, 0x3c, 0x00, 0x38];
        let sc: Vec<u8> = (0..8).map(|j| if j < 4 { j as u8 + 1 } else { j as u8 + 17 }).collect();
        let mn: Vec<u8> = (0..8).map(|j| if j < 4 { j as u8 } else { j as u8 + 32 }).collect();
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 0xf) | ((mn[j + 4] & 0xf) << 4);
        }
        b.extend(s);
        b.extend([0x53u8; 128]);
        let mut y = vec![0.0; 256];
        dequantize_q4_k(&b, &mut y);
        for j in 0..8 {
            let q = if j % 2 == 0 { 3.0 } else { 5.0 };
            let want = sc[j] as f32 * q - 0.5 * mn[j] as f32;
            assert!(y[32 * j..32 * j + 32].iter().all(|&v| v == want), "sub-block {j}");
        }
    }

    #[test]
    fn hand_built_q6_k_block() {
        // d = 0.5; scale g = g - 8; weight i has 6-bit quant i % 64.
        let mut b = vec![0u8; Q6_K_BYTES];
        for i in 0..256usize {
            let q = (i % 64) as u8;
            let (half, k, l) = (i / 128, (i % 128) / 32, i % 32);
            let ql = &mut b[64 * half..64 * half + 64];
            let idx = l + if k % 2 == 1 { 32 } else { 0 };
            ql[idx] |= if k >= 2 { (q & 0xf) << 4 } else { q & 0xf };
            b[128 + 32 * half + l] |= (q >> 4) << (2 * k);
        }
        for g in 0..16 {
            b[192 + g] = (g as i8 - 8) as u8;
        }
        b[208..210].copy_from_slice(&[0x00, 0x38]);
        let mut y = vec![0.0; 256];
        dequantize_q6_k(&b, &mut y);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(
                *v,
                0.5 * ((i / 16) as f32 - 8.0) * ((i % 64) as f32 - 32.0),
                "weight {i}"
            );
        }
    }

    #[test]
    fn q8_k_round_trip_and_bsums() {
        let mut rng = Rng(9);
        let x: Vec<f32> = (0..512).map(|_| rng.normal()).collect();
        let mut q = vec![0u8; 2 * Q8_K_BYTES];
        quantize_row_q8_k(&x, &mut q);
        let mut y = vec![0.0; 512];
        dequantize_q8_k(&q, &mut y);
        for (xb, (yb, qb)) in x.chunks(256).zip(y.chunks(256).zip(q.chunks(Q8_K_BYTES))) {
            let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= amax / 127.0 * 0.501);
            }
            let (_, qs, bs) = q8k_parts(qb);
            for g in 0..16 {
                assert_eq!(
                    bs[g],
                    qs[16 * g..16 * g + 16].iter().map(|&v| v as i8 as i32).sum::<i32>()
                );
            }
        }
    }

    /// Q4_K round trip: within Q4_1's error (8 + 8 bits of scale and min per 32 weights against Q4_K's 6 + 6 and
    /// two f16 per 256), and zeros stay zeros.
    #[test]
    fn q4_k_quantizer_round_trip() {
        use super::super::blocks32::{dequantize_q4_1, quantize_row_q4_1};
        let mut rng = Rng(12);
        let mut x: Vec<f32> = (0..4096).map(|_| rng.normal() * 0.02 + 0.003).collect();
        for i in (0..x.len()).step_by(89) {
            x[i] *= 5.0;
        }
        let rmse = |y: &[f32]| (x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / x.len() as f32).sqrt();
        let mut q = vec![0u8; 16 * Q4_K_BYTES];
        quantize_row_q4_k(&x, &mut q);
        let mut y = vec![0.0; x.len()];
        dequantize_q4_k(&q, &mut y);
        let mut q1 = vec![0u8; 128 * 20];
        quantize_row_q4_1(&x, &mut q1);
        let mut y1 = vec![0.0; x.len()];
        dequantize_q4_1(&q1, &mut y1);
        let (e, e1) = (rmse(&y), rmse(&y1));
        assert!(e < 1.1 * e1, "Q4_K rmse {e} vs Q4_1 {e1}");
        let zeros = vec![0.0f32; 256];
        quantize_row_q4_k(&zeros, &mut q[..Q4_K_BYTES]);
        dequantize_q4_k(&q[..Q4_K_BYTES], &mut y[..256]);
        assert!(y[..256].iter().all(|v| *v == 0.0));
    }

    #[test]
    fn dots_match_dequantized() {
        type D = fn(&[u8], &mut [f32]);
        type Dot = fn(usize, &[u8], &[u8]) -> f32;
        let cases: [(D, usize, &[usize], Dot); 5] = [
            (dequantize_q2_k, Q2_K_BYTES, &[80, 82], dot_q2_k_q8_k),
            (dequantize_q3_k, Q3_K_BYTES, &[108], dot_q3_k_q8_k),
            (dequantize_q4_k, Q4_K_BYTES, &[0, 2], dot_q4_k_q8_k),
            (dequantize_q5_k, Q5_K_BYTES, &[0, 2], dot_q5_k_q8_k),
            (dequantize_q6_k, Q6_K_BYTES, &[208], dot_q6_k_q8_k),
        ];
        let mut rng = Rng(13);
        let n = 3;
        for (deq, bytes, f16s, dot) in cases {
            let w = random_blocks(&mut rng, n, bytes, f16s);
            let x: Vec<f32> = (0..QK_K * n).map(|_| rng.normal()).collect();
            let mut xq = vec![0u8; n * Q8_K_BYTES];
            quantize_row_q8_k(&x, &mut xq);
            let (mut wd, mut xd) = (vec![0.0; x.len()], vec![0.0; x.len()]);
            deq(&w, &mut wd);
            dequantize_q8_k(&xq, &mut xd);
            let want: f64 = wd.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let got = dot(n, &w, &xq) as f64;
            assert!((got - want).abs() <= 1e-5 * scale, "{got} vs {want}");
            assert!(rel_close(got as f32, want as f32, 1e-2) || (got - want).abs() <= 1e-5 * scale);
        }
    }
}
