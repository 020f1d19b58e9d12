//! The i-quants (IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S): ggml's byte layouts, scalar
//! dequantization (the same f32 operations as the `gguf` Python package, so the same bits), the scalar reference
//! dots against Q8_0 (IQ4_NL) or Q8_K (the rest), summed as ggml's reference does, and the IQ4 quantizers.
//!
//! Layouts (little-endian, packed, offsets in bytes; `d` is an f16 scale; "sign index" selects one of the 128 sign
//! patterns of 8 weights with an even number of minus signs, [`KSIGNS`]):
//! - IQ4_NL (18, 32 weights): `d` `qs[16]`: 4-bit indices into [`KVALUES_IQ4NL`]; weight j in the low nibble of
//!   byte j, weight j+16 in its high nibble.
//! - IQ4_XS (136): `d` `scales_h:u16` `scales_l[4]` `qs[128]`: eight 32-weight sub-blocks laid out as IQ4_NL's,
//!   each with a 6-bit scale biased by 32 (low 4 bits in `scales_l`, high 2 in `scales_h`).
//! - IQ2_XXS (66): `d` then per 32 weights two u32: four byte indices into [`IQ2XXS_GRID`] (8 magnitudes each),
//!   then four 7-bit sign indices and a 4-bit scale in the top bits.
//! - IQ2_XS (74): `d` `qs:u16[32]` `scales[8]`: per 8 weights a 9-bit index into [`IQ2XS_GRID`] and a 7-bit sign
//!   index; a 4-bit scale per 16 weights.
//! - IQ2_S (82): `d` `qs[32]` `signs[32]` `qh[8]` `scales[8]`: per 8 weights a 10-bit index into [`IQ2S_GRID`]
//!   (low 8 bits in `qs`, 2 in `qh`) and a byte of sign bits; a 4-bit scale per 16 weights.
//! - IQ3_XXS (98): `d` `qs[64]` `aux:u32[8]`: byte indices into [`IQ3XXS_GRID`] (4 magnitudes each); per 32
//!   weights a u32 of four 7-bit sign indices and a 4-bit scale.
//! - IQ3_S (110): `d` `qs[64]` `qh[8]` `signs[32]` `scales[4]`: 9-bit indices into [`IQ3S_GRID`], a byte of sign
//!   bits per 8 weights, a 4-bit scale per 32.
//! - IQ1_S (50): `d` `qs[32]` `qh:u16[8]`: per 8 weights an 11-bit index into [`IQ1S_GRID`] (-1, 0, 1); per 32 a
//!   3-bit scale and the sign of a ±1/8 shift.

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

#[rustfmt::skip] // generated, one line per few entries
mod grids;

pub use grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

use super::blocks32::{Q8_0_BYTES, QK, f16_at, f16_bytes};
use super::kquants::{Q8_K_BYTES, QK_K, q8k_parts};

pub const IQ4_NL_BYTES: usize = 18;
pub const IQ4_XS_BYTES: usize = 136;
pub const IQ2_XXS_BYTES: usize = 66;
pub const IQ2_XS_BYTES: usize = 74;
pub const IQ2_S_BYTES: usize = 82;
pub const IQ3_XXS_BYTES: usize = 98;
pub const IQ3_S_BYTES: usize = 110;
pub const IQ1_S_BYTES: usize = 50;

/// The sixteen non-uniform levels of IQ4_NL and IQ4_XS (the format's definition), ascending.
pub const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// Sign pattern `i` of 8 weights: the 7 bits of `i`, and an eighth that makes the count of minus signs even.
pub const KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | (((i as u8).count_ones() as u8 & 1) << 7);
        i += 1;
    }
    t
};

/// The shift IQ1_S adds to every grid value, with the sign its block chooses.
pub const IQ1S_DELTA: f32 = 0.125;

fn check(src: &[u8], dst: &[f32], block: usize, bytes: usize) {
    assert!(
        dst.len().is_multiple_of(block),
        "row length {} is not a multiple of {block}",
        dst.len()
    );
    assert_eq!(
        src.len(),
        dst.len() / block * bytes,
        "source bytes do not match the row length"
    );
}

#[inline(always)]
fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline(always)]
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Byte `j` of a grid entry.
#[inline(always)]
fn grid_byte(entry: u64, j: usize) -> u8 {
    (entry >> (8 * j)) as u8
}

/// The 6-bit scale (0..64) of sub-block `ib` of an IQ4_XS block.
#[inline(always)]
pub fn iq4_xs_scale(b: &[u8], ib: usize) -> i32 {
    let low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf;
    let high = (u16_at(b, 2) >> (2 * ib)) & 3;
    (low as u16 | high << 4) as i32
}

/// The 10-bit grid index of group `k` (0..32) of an IQ2_S block.
#[inline(always)]
fn iq2_s_index(b: &[u8], k: usize) -> usize {
    b[2 + k] as usize | (((b[66 + k / 4] >> (2 * (k % 4))) & 3) as usize) << 8
}

/// The 9-bit grid index of entry `e` (0..64) of an IQ3_S block.
#[inline(always)]
fn iq3_s_index(b: &[u8], e: usize) -> usize {
    b[2 + e] as usize | (((b[66 + e / 8] >> (e % 8)) & 1) as usize) << 8
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantization.

pub fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    check(src, dst, QK, IQ4_NL_BYTES);
    for (b, y) in src.chunks_exact(IQ4_NL_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for j in 0..16 {
            y[j] = d * KVALUES_IQ4NL[(b[2 + j] & 0xf) as usize] as f32;
            y[j + 16] = d * KVALUES_IQ4NL[(b[2 + j] >> 4) as usize] as f32;
        }
    }
}

pub fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    check(src, dst, QK_K, IQ4_XS_BYTES);
    for (b, y) in src.chunks_exact(IQ4_XS_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            let dl = d * (iq4_xs_scale(b, ib) - 32) as f32;
            let qs = &b[8 + 16 * ib..24 + 16 * ib];
            for j in 0..16 {
                y[32 * ib + j] = dl * KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as f32;
                y[32 * ib + 16 + j] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
            }
        }
    }
}

/// Dequantizes a grid format as gguf-py does: `d · (ls / 2) · 2·factor` per 16 weights (the same f32 value as its
/// `d · (0.5 + s) · 0.25` and the like), times each magnitude, times its sign.
fn dequantize_grid(f: GridFormat, src: &[u8], dst: &mut [f32]) {
    check(src, dst, QK_K, f.bytes);
    for (b, y) in src.chunks_exact(f.bytes).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            let g = (f.sub)(b, ib);
            for j in 0..32 {
                let db = d * (g.scales[j / 16] as f32 * 0.5) * (2.0 * f.factor);
                let sign = if g.signs >> j & 1 != 0 { -1.0 } else { 1.0 };
                y[32 * ib + j] = db * grid_byte(g.grid[j / 8], j % 8) as f32 * sign;
            }
        }
    }
}

pub fn dequantize_iq2_xxs(src: &[u8], dst: &mut [f32]) {
    dequantize_grid(IQ2_XXS, src, dst)
}

pub fn dequantize_iq2_xs(src: &[u8], dst: &mut [f32]) {
    dequantize_grid(IQ2_XS, src, dst)
}

pub fn dequantize_iq2_s(src: &[u8], dst: &mut [f32]) {
    dequantize_grid(IQ2_S, src, dst)
}

pub fn dequantize_iq3_xxs(src: &[u8], dst: &mut [f32]) {
    dequantize_grid(IQ3_XXS, src, dst)
}

pub fn dequantize_iq3_s(src: &[u8], dst: &mut [f32]) {
    dequantize_grid(IQ3_S, src, dst)
}

/// One 32-weight sub-block of IQ1_S: its values (signed bytes -1, 0, 1; weight `j` in byte `j % 8` of
/// `grid[j / 8]`), the odd scale and the sign (±1) of the ±1/8 shift added to every value. Dequantization, the scalar
/// dot and the SIMD kernels read the blocks only through this.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Iq1Sub {
    pub grid: [u64; 4],
    pub scale: i32,
    pub delta: i32,
}

#[inline(always)]
pub fn iq1_s_sub(b: &[u8], ib: usize) -> Iq1Sub {
    let h = u16_at(b, 34 + 2 * ib);
    Iq1Sub {
        grid: [0, 1, 2, 3].map(|l| IQ1S_GRID[b[2 + 4 * ib + l] as usize | (((h >> (3 * l)) & 7) as usize) << 8]),
        scale: 2 * ((h >> 12) & 7) as i32 + 1,
        delta: if h & 0x8000 != 0 { -1 } else { 1 },
    }
}

pub fn dequantize_iq1_s(src: &[u8], dst: &mut [f32]) {
    check(src, dst, QK_K, IQ1_S_BYTES);
    for (b, y) in src.chunks_exact(IQ1_S_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        for ib in 0..8 {
            let g = iq1_s_sub(b, ib);
            let dl = d * g.scale as f32;
            let delta = g.delta as f32 * IQ1S_DELTA;
            for j in 0..32 {
                y[32 * ib + j] = dl * (grid_byte(g.grid[j / 8], j % 8) as i8 as f32 + delta);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Scalar reference dots: integer sums per sub-block times its integer scale, then one float scale per block.

pub fn dot_iq4_nl_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_NL_BYTES).zip(x.chunks_exact(Q8_0_BYTES)).take(n) {
        let mut s = 0i32;
        for j in 0..16 {
            s += KVALUES_IQ4NL[(b[2 + j] & 0xf) as usize] as i32 * y[2 + j] as i8 as i32;
            s += KVALUES_IQ4NL[(b[2 + j] >> 4) as usize] as i32 * y[18 + j] as i8 as i32;
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

pub fn dot_iq4_xs_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(IQ4_XS_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, _) = q8k_parts(y);
        let mut isum = 0i32;
        for ib in 0..8 {
            let qs = &b[8 + 16 * ib..24 + 16 * ib];
            let mut s = 0i32;
            for j in 0..16 {
                s += KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as i32 * q8[32 * ib + j] as i8 as i32;
                s += KVALUES_IQ4NL[(qs[j] >> 4) as usize] as i32 * q8[32 * ib + 16 + j] as i8 as i32;
            }
            isum += (iq4_xs_scale(b, ib) - 32) * s;
        }
        sum += f16_at(b, 0) * yd * isum as f32;
    }
    sum
}

/// One 32-weight sub-block of a sign-and-magnitude grid i-quant (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), unpacked
/// for a dot product: the magnitudes (grid bytes, weight `j` in byte `j % 8` of `grid[j / 8]`), the sign of each
/// weight (bit `j`, 1 = minus) and the integer scales of its first and last 16 weights. The scalar dots and the SIMD
/// kernels read the blocks only through these, so both decode them one way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GridSub {
    pub grid: [u64; 4],
    pub signs: u32,
    pub scales: [i32; 2],
}

/// A grid i-quant's block bytes, sub-block unpacker and the factor its integer sums are scaled by.
#[derive(Clone, Copy)]
pub struct GridFormat {
    pub bytes: usize,
    pub sub: fn(&[u8], usize) -> GridSub,
    pub factor: f32,
}

pub const IQ2_XXS: GridFormat = GridFormat {
    bytes: IQ2_XXS_BYTES,
    sub: iq2_xxs_sub,
    factor: 0.125,
};
pub const IQ2_XS: GridFormat = GridFormat {
    bytes: IQ2_XS_BYTES,
    sub: iq2_xs_sub,
    factor: 0.125,
};
pub const IQ2_S: GridFormat = GridFormat {
    bytes: IQ2_S_BYTES,
    sub: iq2_s_sub,
    factor: 0.125,
};
pub const IQ3_XXS: GridFormat = GridFormat {
    bytes: IQ3_XXS_BYTES,
    sub: iq3_xxs_sub,
    factor: 0.25,
};
pub const IQ3_S: GridFormat = GridFormat {
    bytes: IQ3_S_BYTES,
    sub: iq3_s_sub,
    factor: 1.0,
};

/// Four sign indices (7 bits each, from bit 0) as the 32 sign bits of their patterns.
#[inline(always)]
fn ksigns4(aux: u32) -> u32 {
    (0..4)
        .map(|l| (KSIGNS[((aux >> (7 * l)) & 127) as usize] as u32) << (8 * l))
        .fold(0, |a, v| a | v)
}

/// The 4-bit scale `i` (0..16) of a byte array of nibbles, as the odd integer `2s + 1`.
#[inline(always)]
fn odd_scale(scales: &[u8], i: usize) -> i32 {
    2 * ((scales[i / 2] >> (4 * (i % 2))) & 0xf) as i32 + 1
}

/// Two 4-value grid entries as one 8-value entry.
#[inline(always)]
fn grid_pair(a: u32, b: u32) -> u64 {
    a as u64 | (b as u64) << 32
}

#[inline(always)]
pub fn iq2_xxs_sub(b: &[u8], ib: usize) -> GridSub {
    let q = &b[2 + 8 * ib..10 + 8 * ib];
    let aux = u32_at(q, 4);
    let ls = 2 * (aux >> 28) as i32 + 1;
    GridSub {
        grid: [0, 1, 2, 3].map(|l| IQ2XXS_GRID[q[l] as usize]),
        signs: ksigns4(aux),
        scales: [ls, ls],
    }
}

#[inline(always)]
pub fn iq2_xs_sub(b: &[u8], ib: usize) -> GridSub {
    let q = [0, 1, 2, 3].map(|l| u16_at(b, 2 + 2 * (4 * ib + l)));
    GridSub {
        grid: q.map(|q| IQ2XS_GRID[(q & 511) as usize]),
        signs: (0..4).fold(0, |a, l| a | (KSIGNS[(q[l] >> 9) as usize] as u32) << (8 * l)),
        scales: [odd_scale(&b[66..74], 2 * ib), odd_scale(&b[66..74], 2 * ib + 1)],
    }
}

#[inline(always)]
pub fn iq2_s_sub(b: &[u8], ib: usize) -> GridSub {
    GridSub {
        grid: [0, 1, 2, 3].map(|l| IQ2S_GRID[iq2_s_index(b, 4 * ib + l)]),
        signs: u32_at(b, 34 + 4 * ib),
        scales: [odd_scale(&b[74..82], 2 * ib), odd_scale(&b[74..82], 2 * ib + 1)],
    }
}

#[inline(always)]
pub fn iq3_xxs_sub(b: &[u8], ib: usize) -> GridSub {
    let aux = u32_at(b, 66 + 4 * ib);
    let ls = 2 * (aux >> 28) as i32 + 1;
    let e = |k: usize| IQ3XXS_GRID[b[2 + 8 * ib + k] as usize];
    GridSub {
        grid: [0, 1, 2, 3].map(|l| grid_pair(e(2 * l), e(2 * l + 1))),
        signs: ksigns4(aux),
        scales: [ls, ls],
    }
}

#[inline(always)]
pub fn iq3_s_sub(b: &[u8], ib: usize) -> GridSub {
    let ls = odd_scale(&b[106..110], ib);
    let e = |k: usize| IQ3S_GRID[iq3_s_index(b, 8 * ib + k)];
    GridSub {
        grid: [0, 1, 2, 3].map(|l| grid_pair(e(2 * l), e(2 * l + 1))),
        signs: u32_at(b, 74 + 4 * ib),
        scales: [ls, ls],
    }
}

/// The scalar dot of `n` blocks of a grid format with Q8_K activations: exact integer sums per 16 weights times
/// their scales, one float scale per block, as ggml's reference.
pub fn dot_grid_q8_k(f: GridFormat, n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(f.bytes).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, _) = q8k_parts(y);
        let mut bsum = 0i32;
        for ib in 0..8 {
            let g = (f.sub)(b, ib);
            for half in 0..2 {
                let s: i32 = (16 * half..16 * half + 16)
                    .map(|j| {
                        let sign = if g.signs >> j & 1 != 0 { -1 } else { 1 };
                        grid_byte(g.grid[j / 8], j % 8) as i32 * q8[32 * ib + j] as i8 as i32 * sign
                    })
                    .sum();
                bsum += s * g.scales[half];
            }
        }
        sum += f16_at(b, 0) * yd * bsum as f32;
    }
    f.factor * sum
}

pub fn dot_iq2_xxs_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_grid_q8_k(IQ2_XXS, n, w, x)
}

pub fn dot_iq2_xs_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_grid_q8_k(IQ2_XS, n, w, x)
}

pub fn dot_iq2_s_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_grid_q8_k(IQ2_S, n, w, x)
}

pub fn dot_iq3_xxs_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_grid_q8_k(IQ3_XXS, n, w, x)
}

pub fn dot_iq3_s_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    dot_grid_q8_k(IQ3_S, n, w, x)
}

pub fn dot_iq1_s_q8_k(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(IQ1_S_BYTES).zip(x.chunks_exact(Q8_K_BYTES)).take(n) {
        let (yd, q8, bsums) = q8k_parts(y);
        let (mut sumi, mut sumi1) = (0i32, 0i32);
        for ib in 0..8 {
            let g = iq1_s_sub(b, ib);
            let s: i32 = (0..32)
                .map(|j| grid_byte(g.grid[j / 8], j % 8) as i8 as i32 * q8[32 * ib + j] as i8 as i32)
                .sum();
            sumi += g.scale * s;
            sumi1 += g.scale * g.delta * (bsums[2 * ib] + bsums[2 * ib + 1]);
        }
        sum += f16_at(b, 0) * yd * (sumi as f32 + IQ1S_DELTA * sumi1 as f32);
    }
    sum
}

// ---------------------------------------------------------------------------------------------------------------
// The IQ4 quantizers (`baton quantize`).

/// Index of the IQ4 level nearest `v` (in units of the block scale).
#[inline]
fn nearest_iq4(v: f32) -> u8 {
    let k = &KVALUES_IQ4NL;
    if v <= k[0] as f32 {
        return 0;
    }
    if v >= k[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if v < k[mid] as f32 { hi = mid } else { lo = mid }
    }
    if v - k[lo] as f32 <= k[hi] as f32 - v {
        lo as u8
    } else {
        hi as u8
    }
}

/// The scale of one 32-weight block on the IQ4 levels: the best, by weighted least squares (weights `x²`, so the
/// large weights that matter most are fitted first), of the fits on 15 trial scales around the one that maps the
/// largest weight onto -127, as llama.cpp's quantizer searches.
fn iq4_block_scale(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-30 {
        return 0.0;
    }
    let (mut best_d, mut best) = (0.0f32, 0.0f32);
    for itry in -7..=7 {
        let id = (itry as f32 + KVALUES_IQ4NL[0] as f32) / max;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = KVALUES_IQ4NL[nearest_iq4(id * v) as usize] as f32;
            let w = v * v;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            best_d = sumqx / sumq2;
            best = best_d * sumqx;
        }
    }
    best_d
}

/// Packs 32 weights on the levels of scale `d` as IQ4_NL/IQ4_XS nibbles.
fn pack_iq4(x: &[f32], d: f32, qs: &mut [u8]) {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for j in 0..16 {
        qs[j] = nearest_iq4(id * x[j]) | nearest_iq4(id * x[j + 16]) << 4;
    }
}

pub fn quantize_row_iq4_nl(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        x.len() / QK * IQ4_NL_BYTES,
        "output bytes do not match the row length"
    );
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(IQ4_NL_BYTES)) {
        let d = f16_bytes(iq4_block_scale(v));
        b[0..2].copy_from_slice(&d);
        pack_iq4(v, f16_at(&d, 0), &mut b[2..18]);
    }
}

pub fn quantize_row_iq4_xs(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        x.len() / QK_K * IQ4_XS_BYTES,
        "output bytes do not match the row length"
    );
    for (v, b) in x.chunks_exact(QK_K).zip(out.chunks_exact_mut(IQ4_XS_BYTES)) {
        let scales: Vec<f32> = v.chunks_exact(32).map(iq4_block_scale).collect();
        let max_scale = scales
            .iter()
            .fold(0.0f32, |m, &s| if s.abs() > m.abs() { s } else { m });
        b.fill(0);
        if max_scale == 0.0 {
            // Scale 0: every level decodes to 0. The biased sub-scales are written as 0 too.
            continue;
        }
        let d = f16_bytes(-max_scale / 32.0);
        b[0..2].copy_from_slice(&d);
        let d = f16_at(&d, 0);
        let mut sh = 0u16;
        for (ib, &s) in scales.iter().enumerate() {
            let l = (s / d).round().clamp(-32.0, 31.0) as i32;
            let ls = (l + 32) as u8;
            b[4 + ib / 2] |= (ls & 0xf) << (4 * (ib % 2));
            sh |= ((ls >> 4) as u16) << (2 * ib);
            pack_iq4(
                &v[32 * ib..32 * ib + 32],
                d * l as f32,
                &mut b[8 + 16 * ib..24 + 16 * ib],
            );
        }
        b[2..4].copy_from_slice(&sh.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::super::kquants::{dequantize_q8_k, quantize_row_q8_k};
    use super::super::testutil::{Rng, random_blocks};
    use super::super::{blocks32, dequantize_row};
    use super::*;
    use crate::gguf::GgmlType;

    type Deq = fn(&[u8], &mut [f32]);
    type Dot = fn(usize, &[u8], &[u8]) -> f32;

    /// (type, dequantizer, dot) of every i-quant.
    const ALL: [(GgmlType, Deq, Dot); 8] = [
        (GgmlType::IQ4NL, dequantize_iq4_nl, dot_iq4_nl_q8_0),
        (GgmlType::IQ4XS, dequantize_iq4_xs, dot_iq4_xs_q8_k),
        (GgmlType::IQ2XXS, dequantize_iq2_xxs, dot_iq2_xxs_q8_k),
        (GgmlType::IQ2XS, dequantize_iq2_xs, dot_iq2_xs_q8_k),
        (GgmlType::IQ2S, dequantize_iq2_s, dot_iq2_s_q8_k),
        (GgmlType::IQ3XXS, dequantize_iq3_xxs, dot_iq3_xxs_q8_k),
        (GgmlType::IQ3S, dequantize_iq3_s, dot_iq3_s_q8_k),
        (GgmlType::IQ1S, dequantize_iq1_s, dot_iq1_s_q8_k),
    ];

    fn vectors(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/kernels/testdata/iquants/");
        let read = |ext: &str| {
            let p = format!("{dir}{}.{ext}", ty.name());
            std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e} (written by scripts/gen-iquant-tables.py)"))
        };
        let want = read("f32")
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (read("bin"), want)
    }

    /// Random blocks (any bit pattern of indices, signs and scales) decode to exactly gguf-py's floats.
    #[test]
    fn dequantization_matches_gguf_py_bit_for_bit() {
        for (ty, deq, _) in ALL {
            let (raw, want) = vectors(ty);
            assert_eq!(raw.len() / ty.type_size() * ty.block_size(), want.len(), "{ty}");
            let mut got = vec![0.0f32; want.len()];
            deq(&raw, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{ty} weight {i}: {g} vs gguf-py {w}");
            }
            // And through the dispatching entry point the model loader uses.
            let mut via = vec![0.0f32; want.len()];
            dequantize_row(ty, &raw, &mut via);
            assert_eq!(via, got, "{ty}");
        }
    }

    #[test]
    fn sign_table_has_even_minus_counts() {
        assert_eq!(&KSIGNS[..4], &[0x00, 0x81, 0x82, 0x03]);
        assert!(KSIGNS.iter().all(|s| s.count_ones() % 2 == 0));
        assert_eq!(KSIGNS[127], 0xff);
    }

    /// Each integer dot equals the f64 dot of the dequantized weights and activations (up to f32 rounding).
    #[test]
    fn dots_match_dequantized() {
        let mut rng = Rng(31);
        for (ty, deq, dot) in ALL {
            let nb = 3;
            let w = random_blocks(&mut rng, nb, ty.type_size(), &[0]);
            let cols = nb * ty.block_size();
            let x: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
            let (mut wd, mut xd) = (vec![0.0; cols], vec![0.0; cols]);
            deq(&w, &mut wd);
            let xq = if ty == GgmlType::IQ4NL {
                let mut q = vec![0u8; nb * Q8_0_BYTES];
                blocks32::quantize_row_q8_0(&x, &mut q);
                blocks32::dequantize_q8_0(&q, &mut xd);
                q
            } else {
                let mut q = vec![0u8; nb * Q8_K_BYTES];
                quantize_row_q8_k(&x, &mut q);
                dequantize_q8_k(&q, &mut xd);
                q
            };
            let want: f64 = wd.iter().zip(&xd).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f64 = wd.iter().zip(&xd).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let got = dot(nb, &w, &xq) as f64;
            assert!(
                (got - want).abs() <= 2e-6 * scale,
                "{ty}: {got} vs {want} (scale {scale})"
            );
        }
    }

    fn rmse(a: &[f32], b: &[f32]) -> f32 {
        (a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>() / a.len() as f32).sqrt()
    }

    /// Round trips through the IQ4 quantizers: the error of normal weights with a few outliers stays below Q4_0's
    /// (the non-uniform levels are the point of the format), and an all-zero block stays zero.
    #[test]
    fn iq4_quantizers_round_trip() {
        let mut rng = Rng(8);
        let mut x: Vec<f32> = (0..4096).map(|_| rng.normal() * 0.02).collect();
        for i in (0..x.len()).step_by(97) {
            x[i] *= 6.0;
        }
        let q4_0 = {
            let mut q = vec![0u8; x.len() / 32 * 18];
            blocks32::quantize_row_q4_0(&x, &mut q);
            let mut y = vec![0.0; x.len()];
            blocks32::dequantize_q4_0(&q, &mut y);
            rmse(&x, &y)
        };
        for (ty, quant, deq) in [
            (
                GgmlType::IQ4NL,
                quantize_row_iq4_nl as fn(&[f32], &mut [u8]),
                dequantize_iq4_nl as Deq,
            ),
            (GgmlType::IQ4XS, quantize_row_iq4_xs, dequantize_iq4_xs),
        ] {
            let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            quant(&x, &mut q);
            let mut y = vec![0.0; x.len()];
            deq(&q, &mut y);
            let e = rmse(&x, &y);
            assert!(e < 0.95 * q4_0, "{ty}: rmse {e} vs Q4_0 {q4_0}");
            let zeros = vec![0.0f32; 256];
            let mut q = vec![0xffu8; ty.row_bytes(256).unwrap()];
            quant(&zeros, &mut q);
            deq(&q, &mut y[..256]);
            assert!(y[..256].iter().all(|v| *v == 0.0), "{ty}: zeros");
        }
    }

    #[test]
    fn nearest_level_is_nearest() {
        for i in -1400..1400 {
            let v = i as f32 * 0.1;
            let got = KVALUES_IQ4NL[nearest_iq4(v) as usize] as f32;
            let best = KVALUES_IQ4NL
                .iter()
                .map(|&k| (k as f32 - v).abs())
                .fold(f32::MAX, f32::min);
            assert_eq!((got - v).abs(), best, "{v}");
        }
    }
}
