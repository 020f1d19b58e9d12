//! Q4_1 weights repacked 16 rows at a time, for AVX-512.
//!
//! Why: the row-major kernel spends most of its instructions per 32-weight block on things that are not
//! multiply-adds — two scalar f16 conversions, a scale vector built from scalars, a horizontal sum per row. With 16
//! rows interleaved, one 512-bit register holds the same 4 quants of 16 rows, so each multiply-add instruction
//! serves 16 rows against one broadcast activation quad, the 16 scales convert in one instruction, and the 16 sums
//! stay in one register until the end of the row: about 4× fewer instructions per weight, which is what decode on
//! a few cores needs to reach the memory-bandwidth bound.
//!
//! Layout of one group of 16 rows: for each block column `b`, 320 bytes —
//! `d[16]: f16`, `m[16]: f16`, then for `k` in 0..4: `qs_r[4k..4k+4]` for `r` in 0..16 (64 bytes).
//! The group's blocks follow each other; groups follow each other; rows past the last whole group stay row-major
//! after the groups. The integer sums are the same as the row-major kernel's; only the f32 summation order differs.

use super::legacy::{Q4_1_BYTES, Q8_1_BYTES};

/// Rows per group.
pub const ROWS: usize = 16;
/// Bytes of one block column of one group.
pub const GROUP_BLOCK: usize = ROWS * Q4_1_BYTES;

/// Repacks row-major Q4_1 data (`rows` rows of `nb` blocks) into the interleaved layout.
pub fn repack_q4_1(src: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let rb = nb * Q4_1_BYTES;
    assert_eq!(src.len(), rows * rb, "Q4_1 data does not match its shape");
    let groups = rows / ROWS;
    let mut out = vec![0u8; src.len()];
    for g in 0..groups {
        for b in 0..nb {
            let o = &mut out[(g * nb + b) * GROUP_BLOCK..(g * nb + b + 1) * GROUP_BLOCK];
            for r in 0..ROWS {
                let blk = &src[(g * ROWS + r) * rb + b * Q4_1_BYTES..][..Q4_1_BYTES];
                o[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                o[32 + 2 * r..34 + 2 * r].copy_from_slice(&blk[2..4]);
                for k in 0..4 {
                    o[64 + 64 * k + 4 * r..64 + 64 * k + 4 * r + 4].copy_from_slice(&blk[4 + 4 * k..8 + 4 * k]);
                }
            }
        }
    }
    let tail = groups * ROWS * rb;
    out[tail..].copy_from_slice(&src[tail..]);
    out
}

/// Row `r` of an interleaved group block back in Q4_1 block form (the scalar reference and row lookups).
pub fn unpack_block(gb: &[u8], r: usize) -> [u8; Q4_1_BYTES] {
    let mut blk = [0u8; Q4_1_BYTES];
    blk[0..2].copy_from_slice(&gb[2 * r..2 * r + 2]);
    blk[2..4].copy_from_slice(&gb[32 + 2 * r..34 + 2 * r]);
    for k in 0..4 {
        blk[4 + 4 * k..8 + 4 * k].copy_from_slice(&gb[64 + 64 * k + 4 * r..64 + 64 * k + 4 * r + 4]);
    }
    blk
}

/// Scalar reference: the 16 dots of one group (`nb` group blocks at `w`) with one Q8_1 activation row.
pub fn dot_group_scalar(nb: usize, w: &[u8], x: &[u8], out: &mut [f32; ROWS]) {
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<u8> = (0..nb)
            .flat_map(|b| unpack_block(&w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK], r))
            .collect();
        *o = super::legacy::dot_q4_1_q8_1(nb, &row, x);
    }
}

/// The 16 dots of one group with `N` (1..=4) Q8_1 activation rows `xs` bytes apart: `out[t][r]`.
///
/// # Safety
/// The CPU must have AVX-512F/BW; `w` must hold `nb` group blocks and `x` `N` rows of `nb` Q8_1 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn dot_group_avx512<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    use std::arch::x86_64::*;
    unsafe {
        let m4 = _mm512_set1_epi8(0x0f);
        let ones = _mm512_set1_epi16(1);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let gb = w.add(b * GROUP_BLOCK);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(gb as *const __m256i));
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(gb.add(32) as *const __m256i));
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let q = _mm512_loadu_si512(gb.add(64 + 64 * k) as *const __m512i);
                lo[k] = _mm512_and_si512(q, m4);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = x.add(t * xs + b * Q8_1_BYTES);
                let yq = y.add(4);
                let quad = |o: usize| _mm512_set1_epi32(std::ptr::read_unaligned(yq.add(o) as *const i32));
                // Each lane pair: two products of ≤ 15·127; eight such sums stay within i16.
                let mut s = _mm512_maddubs_epi16(lo[0], quad(0));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[1], quad(4)));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[2], quad(8)));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[3], quad(12)));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[0], quad(16)));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[1], quad(20)));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[2], quad(24)));
                s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[3], quad(28)));
                let sum = _mm512_cvtepi32_ps(_mm512_madd_epi16(s, ones));
                let dy = _mm512_set1_ps(f16_at(y));
                let sy = _mm512_set1_ps(f16_at(y.add(2)));
                *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, dy), *acc);
                *acc = _mm512_fmadd_ps(m, sy, *acc);
            }
        }
        for t in 0..N {
            _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    half::f16::from_bits(unsafe { std::ptr::read_unaligned(p as *const u16) }).to_f32()
}

/// Whether this CPU runs the interleaved kernel (repacking is pointless otherwise).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::kernels().isa == "avx512"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The 16 dots of group `g` for `n` (1..=4) activation rows, with the fastest kernel available.
pub fn dot_group(nb: usize, w: &[u8], x: &[u8], xs: usize, n: usize, out: &mut [[f32; ROWS]; 4]) {
    assert!((1..=4).contains(&n) && w.len() >= nb * GROUP_BLOCK && x.len() >= (n - 1) * xs + nb * Q8_1_BYTES);
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: AVX-512 checked; lengths asserted above.
        unsafe {
            let (w, x) = (w.as_ptr(), x.as_ptr());
            match n {
                1 => dot_group_avx512::<1>(nb, w, x, xs, (&mut out[..1]).try_into().unwrap()),
                2 => dot_group_avx512::<2>(nb, w, x, xs, (&mut out[..2]).try_into().unwrap()),
                3 => dot_group_avx512::<3>(nb, w, x, xs, (&mut out[..3]).try_into().unwrap()),
                _ => dot_group_avx512::<4>(nb, w, x, xs, out),
            }
        }
        return;
    }
    for t in 0..n {
        dot_group_scalar(nb, w, &x[t * xs..], &mut out[t]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::legacy::{dot_q4_1_q8_1, quantize_row_q8_1};
    use crate::kernels::testutil::{Rng, random_blocks};

    #[test]
    fn repack_round_trips_every_row() {
        let mut rng = Rng(5);
        let (rows, nb) = (37, 3);
        let src = random_blocks(&mut rng, rows * nb, Q4_1_BYTES, &[0, 2]);
        let packed = repack_q4_1(&src, rows, nb);
        for r in 0..32 {
            for b in 0..nb {
                let gb = &packed[((r / 16) * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                assert_eq!(unpack_block(gb, r % 16), src[(r * nb + b) * Q4_1_BYTES..][..Q4_1_BYTES]);
            }
        }
        assert_eq!(
            packed[32 * nb * Q4_1_BYTES..],
            src[32 * nb * Q4_1_BYTES..],
            "tail rows stay row-major"
        );
    }

    /// The SIMD group kernel against the row-major scalar dot, 1..=4 tokens, ragged block counts.
    #[test]
    fn group_kernel_matches_the_row_dots() {
        let mut rng = Rng(8);
        for nb in [1, 2, 5, 18] {
            let src = random_blocks(&mut rng, 16 * nb, Q4_1_BYTES, &[0, 2]);
            let packed = repack_q4_1(&src, 16, nb);
            let xs = nb * Q8_1_BYTES;
            let mut xq = vec![0u8; 4 * xs];
            for t in 0..4 {
                let x: Vec<f32> = (0..nb * 32).map(|_| rng.normal()).collect();
                quantize_row_q8_1(&x, &mut xq[t * xs..(t + 1) * xs]);
            }
            for n in 1..=4 {
                let mut out = [[0.0f32; ROWS]; 4];
                dot_group(nb, &packed, &xq, xs, n, &mut out);
                for t in 0..n {
                    for r in 0..16 {
                        let want = dot_q4_1_q8_1(nb, &src[r * nb * Q4_1_BYTES..], &xq[t * xs..]);
                        let got = out[t][r];
                        assert!(
                            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "nb {nb} n {n} t {t} r {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
