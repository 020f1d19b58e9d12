//! Q4_K weights repacked 16 rows at a time, for the AVX-512 kernels here and the AVX2 one in [`super::avx2`] (the
//! K-quant sibling of [`super::q32`]).
//!
//! Why: Gemma 3's Q4_K matrices went through the row-major kernel, one row against up to four tokens, unpacking
//! each super-block's packed 6-bit scales per row and summing per row horizontally. Interleaved, one 512-bit
//! multiply-add serves 16 rows (a 256-bit one 8), the rows' scales of a sub-block are one byte vector, and the sums
//! stay in registers to the end of the row.
//!
//! Layout of one group of 16 rows, per super-block column (256 weights; 2368 bytes against 16 × 144, +2.8%):
//! `d[16]` and `dmin[16]` (f16), the 6-bit scales and mins unpacked to bytes as `sc[8][16]` and `m[8][16]`
//! (sub-block major), then for each 32-byte chunk `j` of the quants (sub-blocks `2j` in its low nibbles, `2j + 1`
//! in its high ones) and each 4-byte quad `k` of it, `qs_r[32j + 4k..32j + 4k + 4]` for `r` in 0..16. Rows past the
//! last whole group stay row-major after the groups.

use super::group::ROWS;
#[cfg(any(target_arch = "x86_64", test))]
use crate::kernels::kquants::Q8_K_BYTES;
use crate::kernels::kquants::{Q4_K_BYTES, scale_min_k4};

/// Bytes of one super-block column of one group.
pub const GROUP_BLOCK: usize = 64 + 2 * 8 * ROWS + ROWS * 128;
/// Offsets in a group block: the unpacked scales, the unpacked mins, the quants.
pub(crate) const SC: usize = 64;
pub(crate) const MN: usize = SC + 8 * ROWS;
pub(crate) const QS: usize = MN + 8 * ROWS;

/// Repacks `rows` rows of `nb` Q4_K super-blocks into the interleaved layout.
pub fn repack(src: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let rb = nb * Q4_K_BYTES;
    assert_eq!(src.len(), rows * rb, "Q4_K data does not match its shape");
    let groups = rows / ROWS;
    let mut out = vec![0u8; groups * nb * GROUP_BLOCK + (rows - groups * ROWS) * rb];
    for g in 0..groups {
        for b in 0..nb {
            let o = &mut out[(g * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
            for r in 0..ROWS {
                let blk = &src[(g * ROWS + r) * rb + b * Q4_K_BYTES..][..Q4_K_BYTES];
                o[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                o[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                for s in 0..8 {
                    let (sc, m) = scale_min_k4(s, &blk[4..16]);
                    o[SC + s * ROWS + r] = sc;
                    o[MN + s * ROWS + r] = m;
                }
                for q in 0..32 {
                    o[QS + q * 4 * ROWS + 4 * r..][..4].copy_from_slice(&blk[16 + 4 * q..16 + 4 * q + 4]);
                }
            }
        }
    }
    let tail = groups * ROWS * rb;
    out[groups * nb * GROUP_BLOCK..].copy_from_slice(&src[tail..]);
    out
}

/// Row `r`'s super-block of an interleaved group block, back in the file's form (references, row lookups): the
/// 6-bit scales and mins packed again exactly as `scale_min_k4` reads them.
pub fn unpack_block(gb: &[u8], r: usize) -> Vec<u8> {
    let mut blk = vec![0u8; Q4_K_BYTES];
    unpack_block_into(gb, r, &mut blk);
    blk
}

/// [`unpack_block`] into `blk` (at least `Q4_K_BYTES`), without allocating. Returns the block's length.
pub fn unpack_block_into(gb: &[u8], r: usize, blk: &mut [u8]) -> usize {
    blk[0..2].copy_from_slice(&gb[2 * r..2 * r + 2]);
    blk[2..4].copy_from_slice(&gb[32 + 2 * r..32 + 2 * r + 2]);
    let sc = |s: usize| gb[SC + s * ROWS + r];
    let m = |s: usize| gb[MN + s * ROWS + r];
    let q = &mut blk[4..16];
    for j in 0..4 {
        q[j] = sc(j) | ((sc(j + 4) >> 4) << 6);
        q[j + 4] = m(j) | ((m(j + 4) >> 4) << 6);
        q[j + 8] = (sc(j + 4) & 0xf) | ((m(j + 4) & 0xf) << 4);
    }
    for k in 0..32 {
        blk[16 + 4 * k..16 + 4 * k + 4].copy_from_slice(&gb[QS + k * 4 * ROWS + 4 * r..][..4]);
    }
    Q4_K_BYTES
}

/// Scalar reference: the 16 dots of one group (`nb` group blocks at `w`) with one Q8_K activation row.
pub fn dot_group_scalar(nb: usize, w: &[u8], x: &[u8], out: &mut [f32; ROWS]) {
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<u8> = (0..nb)
            .flat_map(|b| unpack_block(&w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK], r))
            .collect();
        *o = crate::kernels::kquants::dot_q4_k_q8_k(nb, &row, x);
    }
}

/// The 16 dots of one group with `N` (1..=4) Q8_K activation rows `xs` bytes apart: `out[t][r]`.
///
/// # Safety
/// The CPU must have AVX-512F/BW; `w` must hold `nb` group blocks and `x` `N` rows of `nb` Q8_K blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn dot_group_avx512<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { dot_group::<N, false>(nb, w, x, xs, out) }
}

/// [`dot_group_avx512`] with VNNI: the same integer sums.
///
/// # Safety
/// As [`dot_group_avx512`], and the CPU must have AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn dot_group_vnni<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { dot_group::<N, true>(nb, w, x, xs, out) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_group<const N: usize, const VNNI: bool>(
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
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(gb.add(32) as *const __m256i));
            let bytes16 = |o: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(gb.add(o) as *const __m128i));
            let mut isum = [_mm512_setzero_si512(); N];
            let mut msum = [_mm512_setzero_si512(); N];
            for j in 0..4 {
                let (sc_lo, sc_hi) = (bytes16(SC + 2 * j * ROWS), bytes16(SC + (2 * j + 1) * ROWS));
                let (m_lo, m_hi) = (bytes16(MN + 2 * j * ROWS), bytes16(MN + (2 * j + 1) * ROWS));
                let mut lo = [_mm512_setzero_si512(); 8];
                let mut hi = [_mm512_setzero_si512(); 8];
                for k in 0..8 {
                    let q = _mm512_loadu_si512(gb.add(QS + (8 * j + k) * 4 * ROWS) as *const __m512i);
                    lo[k] = _mm512_and_si512(q, m4);
                    hi[k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                }
                for t in 0..N {
                    let y = x.add(t * xs + b * Q8_K_BYTES);
                    let yq = y.add(4 + 64 * j);
                    let quad = |o: usize| _mm512_set1_epi32(std::ptr::read_unaligned(yq.add(o) as *const i32));
                    let (sl, sh) = if VNNI {
                        let (mut sl, mut sh) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                        for k in 0..8 {
                            sl = _mm512_dpbusd_epi32(sl, lo[k], quad(4 * k));
                            sh = _mm512_dpbusd_epi32(sh, hi[k], quad(32 + 4 * k));
                        }
                        (sl, sh)
                    } else {
                        // Eight products pairs of ≤ 15·127 per i16 lane stay below 32767.
                        let mut sl = _mm512_maddubs_epi16(lo[0], quad(0));
                        let mut sh = _mm512_maddubs_epi16(hi[0], quad(32));
                        for k in 1..8 {
                            sl = _mm512_add_epi16(sl, _mm512_maddubs_epi16(lo[k], quad(4 * k)));
                            sh = _mm512_add_epi16(sh, _mm512_maddubs_epi16(hi[k], quad(32 + 4 * k)));
                        }
                        (_mm512_madd_epi16(sl, ones), _mm512_madd_epi16(sh, ones))
                    };
                    let pl = _mm512_mullo_epi32(sl, sc_lo);
                    let ph = _mm512_mullo_epi32(sh, sc_hi);
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(pl, ph));
                    let bs = y.add(260 + 8 * j) as *const i16;
                    let b_lo = std::ptr::read_unaligned(bs) as i32 + std::ptr::read_unaligned(bs.add(1)) as i32;
                    let b_hi = std::ptr::read_unaligned(bs.add(2)) as i32 + std::ptr::read_unaligned(bs.add(3)) as i32;
                    let mm = _mm512_add_epi32(
                        _mm512_mullo_epi32(m_lo, _mm512_set1_epi32(b_lo)),
                        _mm512_mullo_epi32(m_hi, _mm512_set1_epi32(b_hi)),
                    );
                    msum[t] = _mm512_add_epi32(msum[t], mm);
                }
            }
            for t in 0..N {
                let yd = _mm512_set1_ps(std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(yd, d), acc[t]);
                acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[t]), _mm512_mul_ps(yd, dmin), acc[t]);
            }
        }
        for t in 0..N {
            _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::kquants::{dot_q4_k_q8_k, quantize_row_q8_k};
    use crate::kernels::testutil::{Rng, random_blocks};

    #[test]
    fn repack_round_trips_every_row() {
        let mut rng = Rng(21);
        let (rows, nb) = (35, 2);
        let src = random_blocks(&mut rng, rows * nb, Q4_K_BYTES, &[0, 2]);
        let packed = repack(&src, rows, nb);
        for r in 0..32 {
            for b in 0..nb {
                let gb = &packed[((r / 16) * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                assert_eq!(
                    unpack_block(gb, r % 16),
                    src[(r * nb + b) * Q4_K_BYTES..][..Q4_K_BYTES],
                    "row {r}"
                );
            }
        }
        assert_eq!(
            packed[2 * nb * GROUP_BLOCK..],
            src[32 * nb * Q4_K_BYTES..],
            "tail rows stay row-major"
        );
    }

    /// The group kernels of every level this CPU runs against the row-major dot; the SIMD levels give the same
    /// bits (the same integer sums, the same f32 operations per row in the same order).
    #[test]
    fn group_kernel_matches_the_row_dots() {
        use crate::kernels::interleaved::TILE;
        use crate::kernels::testutil::check_group_levels;
        let ty = crate::gguf::GgmlType::Q4K;
        let mut rng = Rng(22);
        for nb in [1, 3] {
            let src = random_blocks(&mut rng, 16 * nb, Q4_K_BYTES, &[0, 2]);
            let packed = repack(&src, 16, nb);
            let xs = nb * Q8_K_BYTES;
            let mut xq = vec![0u8; TILE * xs];
            for t in 0..TILE {
                let x: Vec<f32> = (0..nb * 256).map(|_| rng.normal()).collect();
                quantize_row_q8_k(&x, &mut xq[t * xs..(t + 1) * xs]);
            }
            check_group_levels(ty, nb, &packed, &xq, xs, dot_group_scalar, |t, r| {
                dot_q4_k_q8_k(nb, &src[r * nb * Q4_K_BYTES..], &xq[t * xs..])
            });
        }
    }
}
