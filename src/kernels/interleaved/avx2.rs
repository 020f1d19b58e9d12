//! AVX2 (+FMA, F16C) group kernels on the interleaved layouts of [`super::q32`] (Q4_1, Q5_0, Q8_0),
//! [`super::q4k`] (Q4_K) and [`super::q6k`] (Q6_K, which AVX-512 CPUs run here too), for CPUs without AVX-512.
//!
//! Why: the row-major AVX2 kernels (1 row × ≤ 4 tokens) spend most of their instructions per block on scalar scale
//! conversions and a horizontal sum per row, as the AVX-512 ones did before the layouts existed. A 256-bit register
//! holds one quad (4 bytes) of 8 rows, so a 16-row group is two 8-row halves: the 64 bytes of a quad are two 32-byte
//! loads, each multiply-add serves 8 rows against one broadcast activation quad, the 8 scales of a half convert in
//! one `cvtph`, and the sums stay in registers to the end of the row.
//!
//! Loop order: for each block, the per-token scalars (activation scales, `Σx`, the Q8_K block sums) are read once for
//! both halves; within a half, quad by quad, the weight nibbles are unpacked once and multiplied with every token's
//! quads. The Q8_0 kernel instead runs over all blocks one half at a time (both at once for one token).
//!
//! Tokens per call (thread CPU time of each kernel on 8 groups × 64 tokens, AMD EPYC Zen 3): Q4_1 N = 4 and 8 within
//! 3% (4 kept), Q5_0 8 (+10% over 4: its fifth-bit unpacking is dearer), Q6_K 8 (+10%, the same reason), Q4_K 4
//! (+15% over 8), Q8_0 either.
//!
//! Exactness: the integer sums are the row-major kernels' (the i16 bounds are argued at each `maddubs` chain), and
//! every f32 operation per row is the AVX-512 group kernel's, in the same order, so both levels give the same bits.
//! Q8_0 sums each block's 32 products exactly in i32, then one FMA per block with the two scales (as the scalar
//! `dot_q8_0_q8_0` does); the row-major AVX2 kernel (the tail rows) keeps llama.cpp's order of one f32 accumulator
//! per 4-value lane, so the two differ in the last bits.

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts and the token tile

use super::group::ROWS;
use super::q4k::{GROUP_BLOCK as Q4_K_GROUP, MN, QS, SC};
use super::q6k::{GROUP_BLOCK as Q6_K_GROUP, QH as Q6_QH, QL as Q6_QL, SC as Q6_SC};
use crate::kernels::blocks32::{Q4_1_BYTES, Q5_0_BYTES, Q8_0_BYTES, Q8_1_BYTES};
use crate::kernels::kquants::Q8_K_BYTES;
use std::arch::x86_64::*;

/// One f16 at `p` as f32 (exact, as `half`'s conversion is).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_at(p: *const u8) -> f32 {
    unsafe {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

/// The 4 bytes at `p` in every 32-bit lane (`vpbroadcastd` from memory).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn quad(p: *const u8) -> __m256i {
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// The 8 f16 at `p` as f32 (the scales of one half).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16x8(p: *const u8) -> __m256 {
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
}

/// Stores the two halves' 8 sums as the group's 16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn store(out: &mut [f32; ROWS], lo: __m256, hi: __m256) {
    let (a, b) = out.split_at_mut(8);
    // SAFETY: 8 floats each.
    unsafe {
        _mm256_storeu_ps(a.as_mut_ptr(), lo);
        _mm256_storeu_ps(b.as_mut_ptr(), hi);
    }
}

/// The 16 dots of one Q4_1 group with `N` Q8_1 activation rows `xs` bytes apart: `out[t][r]`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must hold `nb` group blocks and `x` `N` rows of `nb` Q8_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_1_group<const N: usize>(nb: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [[f32; ROWS]; N]) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..nb {
            let gb = w.add(b * ROWS * Q4_1_BYTES);
            let y = |t: usize| x.add(t * xs + b * Q8_1_BYTES);
            let (mut dy, mut sy) = ([0.0f32; N], [0.0f32; N]);
            for t in 0..N {
                (dy[t], sy[t]) = (f16_at(y(t)), f16_at(y(t).add(2)));
            }
            for h in 0..2 {
                // An opaque copy of `x`: the same quads are broadcast again for the second half rather than kept
                // from the first (LLVM would spill them to the stack, N · 8 stores per block).
                let x = std::hint::black_box(x);
                let y = |t: usize| x.add(t * xs + b * Q8_1_BYTES);
                // Each i16 lane: four pairs of products ≤ 15·127 from the low nibbles, four from the high ones,
                // 8 · 3810 = 30480 < 32767: no saturation.
                let mut s = [_mm256_setzero_si256(); N];
                for k in 0..4 {
                    let q = load(gb.add(64 + 64 * k + 32 * h));
                    let lo = _mm256_and_si256(q, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    for t in 0..N {
                        let yq = y(t).add(4);
                        let p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, quad(yq.add(4 * k))),
                            _mm256_maddubs_epi16(hi, quad(yq.add(16 + 4 * k))),
                        );
                        s[t] = _mm256_add_epi16(s[t], p);
                    }
                }
                let d = f16x8(gb.add(16 * h));
                let m = f16x8(gb.add(32 + 16 * h));
                for t in 0..N {
                    let sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[t], ones));
                    let a = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(dy[t])), acc[t][h]);
                    acc[t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sy[t]), a);
                }
            }
        }
        for t in 0..N {
            store(&mut out[t], acc[t][0], acc[t][1]);
        }
    }
}

/// The sum of the 32 signed bytes at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sum_bytes(p: *const u8) -> i32 {
    unsafe {
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), load(p)), _mm256_set1_epi16(1));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)))
    }
}

/// The 16 dots of one Q5_0 group with `N` Q8_0 activation rows `xs` bytes apart: `out[t][r]`. As in the AVX-512
/// kernel, the weights enter `maddubs` as unsigned 0..31 and their offset of 16 comes off once per block as 16 · Σx.
///
/// # Safety
/// As [`q4_1_group`], with Q5_0 group blocks and Q8_0 activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_0_group<const N: usize>(nb: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [[f32; ROWS]; N]) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let b16 = _mm256_set1_epi8(0x10);
        let ones = _mm256_set1_epi16(1);
        // Byte j of a 32-bit mask word: its byte j / 8, and the bit j % 8 of it.
        let spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..nb {
            let gb = w.add(b * ROWS * Q5_0_BYTES);
            let y = |t: usize| x.add(t * xs + b * Q8_0_BYTES);
            let (mut dy, mut sx16) = ([0.0f32; N], [0i32; N]);
            for t in 0..N {
                (dy[t], sx16[t]) = (f16_at(y(t)), 16 * sum_bytes(y(t).add(2)));
            }
            for h in 0..2 {
                // Broadcast the quads again for this half (see `q4_1_group`).
                let x = std::hint::black_box(x);
                let y = |t: usize| x.add(t * xs + b * Q8_0_BYTES);
                // Mask `m`'s bits of this half's 8 rows (bit 4r + i: row r, byte i) as 0x10 in the bytes they set.
                let fifth = |m: usize| {
                    let sel =
                        _mm256_and_si256(_mm256_shuffle_epi8(quad(gb.add(2 * ROWS + 8 * m + 4 * h)), spread), bit);
                    _mm256_and_si256(_mm256_cmpeq_epi8(sel, bit), b16)
                };
                // Each i16 lane of one sum: four pairs of products ≤ 31·127, 4 · 7874 = 31496 < 32767.
                let mut s = [[_mm256_setzero_si256(); 2]; N];
                for k in 0..4 {
                    let q = load(gb.add(6 * ROWS + 64 * k + 32 * h));
                    let lo = _mm256_or_si256(_mm256_and_si256(q, m4), fifth(2 * k));
                    let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), fifth(2 * k + 1));
                    for t in 0..N {
                        let yq = y(t).add(2);
                        s[t][0] = _mm256_add_epi16(s[t][0], _mm256_maddubs_epi16(lo, quad(yq.add(4 * k))));
                        s[t][1] = _mm256_add_epi16(s[t][1], _mm256_maddubs_epi16(hi, quad(yq.add(16 + 4 * k))));
                    }
                }
                let d = f16x8(gb.add(16 * h));
                for t in 0..N {
                    let sum = _mm256_add_epi32(_mm256_madd_epi16(s[t][0], ones), _mm256_madd_epi16(s[t][1], ones));
                    let sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(sx16[t]));
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(dy[t]));
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), dd, acc[t][h]);
                }
            }
        }
        for t in 0..N {
            store(&mut out[t], acc[t][0], acc[t][1]);
        }
    }
}

/// The 16 dots of one Q8_0 group with `N` Q8_0 activation rows `xs` bytes apart: `out[t][r]`. One half at a time
/// over all blocks (one token: [`q8_0_group_whole`]). Each block's integer sum comes first and meets the scales
/// once: llama.cpp's order (a convert and an FMA per 4 products, 8 f32 accumulators) cost 14–50% of prefill on both
/// levels (`cargo bench --bench kernels Q8_0`, Zen 4, session 19).
///
/// # Safety
/// As [`q4_1_group`], with Q8_0 group blocks and activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_0_group<const N: usize>(nb: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [[f32; ROWS]; N]) {
    if N == 1 {
        // SAFETY: as this function's.
        return unsafe { q8_0_group_whole(nb, w, x, xs, out) };
    }
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let zero = _mm256_setzero_si256();
        let mut res = [[_mm256_setzero_ps(); 2]; N];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); N];
            for b in 0..nb {
                let gb = w.add(b * ROWS * Q8_0_BYTES);
                let y = |t: usize| x.add(t * xs + b * Q8_0_BYTES);
                let d = f16x8(gb.add(16 * h));
                // The block's 32 products per row summed exactly in i32 (|sum| ≤ 32·128·127), in two chains.
                let mut s = [[zero; 2]; N];
                for k in 0..8 {
                    // maddubs takes unsigned × signed: |w| against the activation with w's sign moved onto it.
                    let q = load(gb.add(2 * ROWS + 64 * k + 32 * h));
                    let aw = _mm256_abs_epi8(q);
                    for t in 0..N {
                        let sy = _mm256_sign_epi8(quad(y(t).add(2 + 4 * k)), q);
                        // Two products of ≤ 128·127 per i16 lane: no saturation.
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), ones);
                        s[t][k % 2] = _mm256_add_epi32(s[t][k % 2], p);
                    }
                }
                for t in 0..N {
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(f16_at(y(t))));
                    let isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s[t][0], s[t][1]));
                    acc[t] = _mm256_fmadd_ps(dd, isum, acc[t]);
                }
            }
            for t in 0..N {
                res[t][h] = acc[t];
            }
        }
        for t in 0..N {
            store(&mut out[t], res[t][0], res[t][1]);
        }
    }
}

/// [`q8_0_group`] for one token (decode): both 8-row halves in one pass over the blocks, so each 64-byte
/// line of weights is used whole when it arrives from memory and each activation quad is broadcast once. The
/// operations of each row are [`q8_0_group`]'s, so the bits are too. Its own function because with more tokens the
/// accumulators of both halves do not fit the 16 registers (already at two they spill; a body shared with
/// [`q8_0_group`] spilled at four too: GEMM −20%).
///
/// # Safety
/// As [`q8_0_group`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_group_whole<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let zero = _mm256_setzero_si256();
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..nb {
            let gb = w.add(b * ROWS * Q8_0_BYTES);
            let y = |t: usize| x.add(t * xs + b * Q8_0_BYTES);
            // Per token and half, the block's 32 products per row in i32, in two chains.
            let mut s = [[[zero; 2]; 2]; N];
            for k in 0..8 {
                let q = [load(gb.add(2 * ROWS + 64 * k)), load(gb.add(2 * ROWS + 64 * k + 32))];
                let aw = [_mm256_abs_epi8(q[0]), _mm256_abs_epi8(q[1])];
                for t in 0..N {
                    let yq = quad(y(t).add(2 + 4 * k));
                    for h in 0..2 {
                        let sy = _mm256_sign_epi8(yq, q[h]);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], sy), ones);
                        s[t][h][k % 2] = _mm256_add_epi32(s[t][h][k % 2], p);
                    }
                }
            }
            for h in 0..2 {
                let d = f16x8(gb.add(16 * h));
                for t in 0..N {
                    let dd = _mm256_mul_ps(d, _mm256_set1_ps(f16_at(y(t))));
                    let isum = _mm256_cvtepi32_ps(_mm256_add_epi32(s[t][h][0], s[t][h][1]));
                    acc[t][h] = _mm256_fmadd_ps(dd, isum, acc[t][h]);
                }
            }
        }
        for t in 0..N {
            store(&mut out[t], acc[t][0], acc[t][1]);
        }
    }
}

/// The 16 dots of one Q4_K group with `N` Q8_K activation rows `xs` bytes apart: `out[t][r]`.
///
/// # Safety
/// As [`q4_1_group`], with Q4_K group blocks ([`super::q4k`]) and Q8_K activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k_group<const N: usize>(nb: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [[f32; ROWS]; N]) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..nb {
            let gb = w.add(b * Q4_K_GROUP);
            let y = |t: usize| x.add(t * xs + b * Q8_K_BYTES);
            // Per token: its scale, and for each 32-byte chunk j the activation sums of sub-blocks 2j and 2j + 1
            // (each ≤ 32 · 127 in magnitude) as an i16 pair.
            let (mut yd, mut bsum) = ([0.0f32; N], [[0i32; 4]; N]);
            for t in 0..N {
                yd[t] = std::ptr::read_unaligned(y(t) as *const f32);
                let bs = |i: usize| std::ptr::read_unaligned((y(t).add(260) as *const i16).add(i)) as i32;
                for j in 0..4 {
                    let (lo, hi) = (bs(4 * j) + bs(4 * j + 1), bs(4 * j + 2) + bs(4 * j + 3));
                    bsum[t][j] = (lo & 0xffff) | (hi << 16);
                }
            }
            for h in 0..2 {
                // Broadcast the quads again for this half (see `q4_1_group`).
                let x = std::hint::black_box(x);
                let y = |t: usize| x.add(t * xs + b * Q8_K_BYTES);
                let mut isum = [_mm256_setzero_si256(); N];
                let mut msum = [_mm256_setzero_si256(); N];
                for j in 0..4 {
                    // The 8 rows' scale of sub-block s in both i16 halves of each row's lane, so that one `madd`
                    // sums a row's pair of products and scales it (the same integer as `madd` by 1, then `mullo`).
                    let scale = |s: usize| {
                        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(gb.add(SC + s * ROWS + 8 * h) as *const __m128i));
                        _mm256_or_si256(v, _mm256_slli_epi32(v, 16))
                    };
                    let (sc_lo, sc_hi) = (scale(2 * j), scale(2 * j + 1));
                    // The 8 rows' mins of sub-blocks 2j and 2j + 1 as an i16 pair per row.
                    let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(
                        _mm_loadl_epi64(gb.add(MN + 2 * j * ROWS + 8 * h) as *const __m128i),
                        _mm_loadl_epi64(gb.add(MN + (2 * j + 1) * ROWS + 8 * h) as *const __m128i),
                    ));
                    // Each i16 lane: eight pairs of products ≤ 15·127, 8 · 3810 = 30480 < 32767.
                    let (mut sl, mut sh) = ([_mm256_setzero_si256(); N], [_mm256_setzero_si256(); N]);
                    for k in 0..8 {
                        let q = load(gb.add(QS + (8 * j + k) * 4 * ROWS + 32 * h));
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        for t in 0..N {
                            let yq = y(t).add(4 + 64 * j);
                            sl[t] = _mm256_add_epi16(sl[t], _mm256_maddubs_epi16(lo, quad(yq.add(4 * k))));
                            sh[t] = _mm256_add_epi16(sh[t], _mm256_maddubs_epi16(hi, quad(yq.add(32 + 4 * k))));
                        }
                    }
                    for t in 0..N {
                        let p = _mm256_add_epi32(_mm256_madd_epi16(sl[t], sc_lo), _mm256_madd_epi16(sh[t], sc_hi));
                        isum[t] = _mm256_add_epi32(isum[t], p);
                        msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(mins, _mm256_set1_epi32(bsum[t][j])));
                    }
                }
                let d = f16x8(gb.add(16 * h));
                let dmin = f16x8(gb.add(32 + 16 * h));
                for t in 0..N {
                    let ydv = _mm256_set1_ps(yd[t]);
                    let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(ydv, d), acc[t][h]);
                    acc[t][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[t]), _mm256_mul_ps(ydv, dmin), a);
                }
            }
        }
        for t in 0..N {
            store(&mut out[t], acc[t][0], acc[t][1]);
        }
    }
}

/// The 16 dots of one Q6_K group ([`super::q6k`]) with `N` Q8_K activation rows `xs` bytes apart: `out[t][r]`.
/// The 6-bit weights enter `maddubs` unsigned (0..63); their offset of 32 comes off once per super-block as
/// 32 · Σ_s sc_s · bsum_s, the activation sums of each 16 values that Q8_K carries.
///
/// # Safety
/// As [`q4_1_group`], with Q6_K group blocks and Q8_K activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6_k_group<const N: usize>(nb: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [[f32; ROWS]; N]) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..nb {
            let gb = w.add(b * Q6_K_GROUP);
            let mut yd = [0.0f32; N];
            for t in 0..N {
                yd[t] = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
            }
            for h in 0..2 {
                // Broadcast the quads again for this half (see `q4_1_group`).
                let x = std::hint::black_box(x);
                let y = |t: usize| x.add(t * xs + b * Q8_K_BYTES);
                // The 8 rows' scales of sub-block s (i8).
                let sc8 = |s: usize| _mm_loadl_epi64(gb.add(Q6_SC + s * ROWS + 8 * h) as *const __m128i);
                let mut isum = [_mm256_setzero_si256(); N];
                for n in 0..2 {
                    for kp in 0..4 {
                        // Quads 2kp and 2kp + 1 of the four 32-value runs of this 128-value half (values
                        // 128n + 32j + 4·quad), as 6-bit bytes: wv[j][e].
                        let mut wv = [[_mm256_setzero_si256(); 2]; 4];
                        for e in 0..2 {
                            let kq = 2 * kp + e;
                            let ql = |q: usize| load(gb.add(Q6_QL + q * 4 * ROWS + 32 * h));
                            let (qa, qb) = (ql(16 * n + kq), ql(16 * n + 8 + kq));
                            let qh = load(gb.add(Q6_QH + (8 * n + kq) * 4 * ROWS + 32 * h));
                            let hi = |v: __m256i| _mm256_and_si256(v, m30);
                            wv[0][e] = _mm256_or_si256(_mm256_and_si256(qa, m4), hi(_mm256_slli_epi16(qh, 4)));
                            wv[1][e] = _mm256_or_si256(_mm256_and_si256(qb, m4), hi(_mm256_slli_epi16(qh, 2)));
                            wv[2][e] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), hi(qh));
                            wv[3][e] = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                                hi(_mm256_srli_epi16(qh, 2)),
                            );
                        }
                        for j in 0..4 {
                            // The scale of sub-block 8n + 2j + kp / 2, in both i16 halves of each row's lane.
                            let s = sc8(8 * n + 2 * j + kp / 2);
                            let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
                            for t in 0..N {
                                let yq = y(t).add(4 + 128 * n + 32 * j + 8 * kp);
                                // Each i16 lane: two pairs of products ≤ 63·127, 4 · 8001 = 32004 < 32767.
                                let p = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(wv[j][0], quad(yq)),
                                    _mm256_maddubs_epi16(wv[j][1], quad(yq.add(4))),
                                );
                                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, sc));
                            }
                        }
                    }
                }
                let d = f16x8(gb.add(16 * h));
                for t in 0..N {
                    // Σ_s sc_s · bsum_s, two sub-blocks per `madd` (scales ≤ 128, sums ≤ 16 · 127 in magnitude).
                    let bs = y(t).add(260);
                    let mut off = _mm256_setzero_si256();
                    for p in 0..8 {
                        let scp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8(2 * p), sc8(2 * p + 1)));
                        off = _mm256_add_epi32(off, _mm256_madd_epi16(scp, quad(bs.add(4 * p))));
                    }
                    let sum = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(off, 5));
                    acc[t][h] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(sum),
                        _mm256_mul_ps(_mm256_set1_ps(yd[t]), d),
                        acc[t][h],
                    );
                }
            }
        }
        for t in 0..N {
            store(&mut out[t], acc[t][0], acc[t][1]);
        }
    }
}
