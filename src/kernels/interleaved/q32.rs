//! Q4_1, Q5_0 and Q8_0 (the 32-weight block formats) interleaved 16 rows at a time, and their AVX-512 group kernels
//! (with VNNI's `vpdpbusd` where the CPU has it: one instruction for what `maddubs` + `madd` do in two or three;
//! Gemma 3 pp512 +8-12%). The AVX2 kernels on this layout are in [`super::avx2`].
//!
//! Layout of one group of 16 rows, for each block column `b` (the same bytes as the 16 blocks, rearranged):
//! each f16 header field for the 16 rows (Q4_1: `d[16]`, `m[16]`; Q8_0: `d[16]`), then for each 4-byte quad `k` of
//! the quants: `qs_r[4k..4k+4]` for `r` in 0..16 (64 bytes). Q4_1 has 4 quads (low nibbles pair with activations
//! 4k.., high nibbles with 16+4k..), Q8_0 has 8.
//! Q5_0 (`d`, 4 bytes `qh` of fifth bits, 16 bytes of nibbles) keeps that shape with one change: the 16 rows' `qh`
//! words (64 bytes) are stored as eight 64-bit masks, mask `2k` holding the fifth bits of the low-nibble values of
//! quad `k` (bit `4r + i`: row `r`, byte `i`) and mask `2k + 1` those of its high-nibble values, so the kernel turns
//! each into byte form with one masked add instead of shifting bits per row.
//! The group's blocks follow each other; groups follow each other; rows past the last whole group stay row-major
//! after the groups. The integer sums are the same as the row-major kernel's; only the f32 summation order differs.
//! The Q8_0 kernel sums each block's products exactly in i32 and meets the two scales once per block. It used to add
//! in llama.cpp's order (one f32 accumulator per 4-value lane, then its `hsum_float_8`), which raised Gemma 3's
//! argmax agreement with llama.cpp by half a point; measured again in session 19 that order cost 33–51% of Q8_0
//! prefill (`cargo bench --bench kernels Q8_0`, Zen 4), so it went, as it had for Q4_1 (15-20% of SmolLM2's
//! prefill, no gain in agreement). `--numerics ggml` keeps llama.cpp's order.

use super::group::ROWS;
use crate::gguf::GgmlType;
#[cfg(target_arch = "x86_64")]
use crate::kernels::blocks32::Q8_1_BYTES;
use crate::kernels::blocks32::{self, Q4_1_BYTES, Q5_0_BYTES, Q8_0_BYTES};

/// Bytes of one block of `ty` and of its f16 header.
pub(super) fn block_shape(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q4_1 => (Q4_1_BYTES, 4),
        GgmlType::Q5_0 => (Q5_0_BYTES, 2),
        GgmlType::Q8_0 => (Q8_0_BYTES, 2),
        _ => panic!("no interleaved layout for {ty}"),
    }
}

/// Bytes of one block column of one group.
pub(super) fn group_block(ty: GgmlType) -> usize {
    ROWS * block_shape(ty).0
}

/// Repacks row-major data of `ty` (`rows` rows of `nb` blocks) into the interleaved layout.
pub(super) fn repack(ty: GgmlType, src: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let (bb, hdr) = block_shape(ty);
    let (rb, gbb) = (nb * bb, ROWS * bb);
    assert_eq!(src.len(), rows * rb, "{ty} data does not match its shape");
    let groups = rows / ROWS;
    let mut out = vec![0u8; src.len()];
    for g in 0..groups {
        for b in 0..nb {
            let o = &mut out[(g * nb + b) * gbb..(g * nb + b + 1) * gbb];
            for r in 0..ROWS {
                let blk = &src[(g * ROWS + r) * rb + b * bb..][..bb];
                scatter(o, blk, r, hdr);
            }
            if ty == GgmlType::Q5_0 {
                qh_to_masks(&mut o[2 * ROWS..6 * ROWS]);
            }
        }
    }
    let tail = groups * ROWS * rb;
    out[tail..].copy_from_slice(&src[tail..]);
    out
}

/// Where byte `i` of row `r`'s block goes in its group block.
#[inline]
fn position(i: usize, r: usize, hdr: usize) -> usize {
    if i < hdr {
        (i / 2) * 2 * ROWS + 2 * r + i % 2
    } else {
        let q = i - hdr;
        hdr * ROWS + (q / 4) * 4 * ROWS + 4 * r + q % 4
    }
}

/// Row `r`'s block into its group block: the bytes [`position`] gives, copied a header field or a quad at a time
/// (loading repacks every multiplied matrix; byte by byte took 0.6 s of CPU for Gemma 3).
fn scatter(gb: &mut [u8], blk: &[u8], r: usize, hdr: usize) {
    for (f, v) in blk[..hdr].chunks_exact(2).enumerate() {
        gb[f * 2 * ROWS + 2 * r..][..2].copy_from_slice(v);
    }
    for (k, q) in blk[hdr..].chunks_exact(4).enumerate() {
        gb[hdr * ROWS + k * 4 * ROWS + 4 * r..][..4].copy_from_slice(q);
    }
}

/// Row `r`'s block of a group block, back in the file's block form, into `blk`; returns the block's length.
pub(super) fn unpack_block_into(ty: GgmlType, gb: &[u8], r: usize, blk: &mut [u8]) -> usize {
    let (bb, hdr) = block_shape(ty);
    for (i, b) in blk[..bb].iter_mut().enumerate() {
        *b = gb[position(i, r, hdr)];
    }
    if ty == GgmlType::Q5_0 {
        // Bytes 2..6 were scattered from the masks; rebuild the row's qh word from them.
        let mask = |m: usize| u64::from_le_bytes(gb[2 * ROWS + 8 * m..][..8].try_into().unwrap());
        let mut qh = 0u32;
        for k in 0..4 {
            for i in 0..4 {
                qh |= ((mask(2 * k) >> (4 * r + i) & 1) as u32) << (4 * k + i);
                qh |= ((mask(2 * k + 1) >> (4 * r + i) & 1) as u32) << (16 + 4 * k + i);
            }
        }
        blk[2..6].copy_from_slice(&qh.to_le_bytes());
    }
    bb
}

/// The 16 rows' `qh` words (row `r` at bytes `4r..4r+4`) rewritten as the eight masks described above.
fn qh_to_masks(qh: &mut [u8]) {
    let word = |r: usize| u32::from_le_bytes(qh[4 * r..4 * r + 4].try_into().unwrap());
    let mut masks = [0u64; 8];
    for r in 0..ROWS {
        let w = word(r);
        for k in 0..4 {
            for i in 0..4 {
                masks[2 * k] |= ((w >> (4 * k + i) & 1) as u64) << (4 * r + i);
                masks[2 * k + 1] |= ((w >> (16 + 4 * k + i) & 1) as u64) << (4 * r + i);
            }
        }
    }
    for (m, out) in masks.iter().zip(qh.chunks_exact_mut(8)) {
        out.copy_from_slice(&m.to_le_bytes());
    }
}

/// Scalar reference: the 16 dots of one group (`nb` group blocks at `w`) with one activation row.
pub(super) fn dot_group_scalar(ty: GgmlType, nb: usize, w: &[u8], x: &[u8], out: &mut [f32; ROWS]) {
    let gbb = group_block(ty);
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<u8> = (0..nb)
            .flat_map(|b| {
                let mut blk = vec![0u8; block_shape(ty).0];
                unpack_block_into(ty, &w[b * gbb..(b + 1) * gbb], r, &mut blk);
                blk
            })
            .collect();
        *o = match ty {
            GgmlType::Q4_1 => blocks32::dot_q4_1_q8_1(nb, &row, x),
            GgmlType::Q5_0 => blocks32::dot_q5_0_q8_0(nb, &row, x),
            _ => blocks32::dot_q8_0_q8_0(nb, &row, x),
        };
    }
}

/// The 16 dots of one group with `N` (1..=4) Q8_1 activation rows `xs` bytes apart: `out[t][r]`.
///
/// # Safety
/// The CPU must have AVX-512F/BW; `w` must hold `nb` group blocks and `x` `N` rows of `nb` Q8_1 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn q4_1_group_avx512<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { q4_1_group::<N, false>(nb, w, x, xs, out) }
}

/// [`q4_1_group_avx512`] with VNNI's `vpdpbusd` (byte products summed straight into i32): the same integer sums.
///
/// # Safety
/// As [`q4_1_group_avx512`], and the CPU must have AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q4_1_group_vnni<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { q4_1_group::<N, true>(nb, w, x, xs, out) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q4_1_group<const N: usize, const VNNI: bool>(
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
            let gb = w.add(b * ROWS * Q4_1_BYTES);
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
                let sum = if VNNI {
                    let mut s = _mm512_setzero_si512();
                    for k in 0..4 {
                        s = _mm512_dpbusd_epi32(s, lo[k], quad(4 * k));
                        s = _mm512_dpbusd_epi32(s, hi[k], quad(16 + 4 * k));
                    }
                    s
                } else {
                    // Each lane pair: two products of ≤ 15·127; eight such sums stay within i16.
                    let mut s = _mm512_maddubs_epi16(lo[0], quad(0));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[1], quad(4)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[2], quad(8)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[3], quad(12)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[0], quad(16)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[1], quad(20)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[2], quad(24)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[3], quad(28)));
                    _mm512_madd_epi16(s, ones)
                };
                let sum = _mm512_cvtepi32_ps(sum);
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

/// The 16 dots of one Q5_0 group with `N` (1..=4) Q8_0 activation rows `xs` bytes apart: `out[t][r]`. The weights
/// enter `maddubs` as unsigned 0..31 (nibble plus fifth bit); their offset of 16 is taken off once per block as
/// 16 · Σx, the same for all 16 rows.
///
/// # Safety
/// As [`q4_1_group_avx512`], with Q5_0 group blocks and Q8_0 activation rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn q5_0_group_avx512<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { q5_0_group::<N, false>(nb, w, x, xs, out) }
}

/// [`q5_0_group_avx512`] with VNNI: the same integer sums.
///
/// # Safety
/// As [`q5_0_group_avx512`], and the CPU must have AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q5_0_group_vnni<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { q5_0_group::<N, true>(nb, w, x, xs, out) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q5_0_group<const N: usize, const VNNI: bool>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    use std::arch::x86_64::*;
    unsafe {
        let m4 = _mm512_set1_epi8(0x0f);
        let b16 = _mm512_set1_epi8(0x10);
        let ones = _mm512_set1_epi16(1);
        let ones8 = _mm256_set1_epi8(1);
        let ones16 = _mm256_set1_epi16(1);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let gb = w.add(b * ROWS * Q5_0_BYTES);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(gb as *const __m256i));
            let mask = |m: usize| std::ptr::read_unaligned(gb.add(2 * ROWS + 8 * m) as *const u64);
            let mut lo = [_mm512_setzero_si512(); 4];
            let mut hi = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let q = _mm512_loadu_si512(gb.add(6 * ROWS + 64 * k) as *const __m512i);
                let l = _mm512_and_si512(q, m4);
                let h = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                lo[k] = _mm512_mask_add_epi8(l, mask(2 * k), l, b16);
                hi[k] = _mm512_mask_add_epi8(h, mask(2 * k + 1), h, b16);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = x.add(t * xs + b * Q8_0_BYTES);
                let yq = y.add(2);
                let quad = |o: usize| _mm512_set1_epi32(std::ptr::read_unaligned(yq.add(o) as *const i32));
                let sum = if VNNI {
                    let mut s = _mm512_setzero_si512();
                    for k in 0..4 {
                        s = _mm512_dpbusd_epi32(s, lo[k], quad(4 * k));
                        s = _mm512_dpbusd_epi32(s, hi[k], quad(16 + 4 * k));
                    }
                    s
                } else {
                    // Four products pairs of ≤ 31·127 per i16 lane stay below 32767; then i32.
                    let mut s = _mm512_maddubs_epi16(lo[0], quad(0));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[1], quad(4)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[2], quad(8)));
                    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[3], quad(12)));
                    let mut s2 = _mm512_maddubs_epi16(hi[0], quad(16));
                    s2 = _mm512_add_epi16(s2, _mm512_maddubs_epi16(hi[1], quad(20)));
                    s2 = _mm512_add_epi16(s2, _mm512_maddubs_epi16(hi[2], quad(24)));
                    s2 = _mm512_add_epi16(s2, _mm512_maddubs_epi16(hi[3], quad(28)));
                    _mm512_add_epi32(_mm512_madd_epi16(s, ones), _mm512_madd_epi16(s2, ones))
                };
                // Σx of the block: 32 signed bytes summed in pairs, then in i32.
                let xv = _mm256_loadu_si256(yq as *const __m256i);
                let sx = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones16);
                let sx = _mm_add_epi32(_mm256_castsi256_si128(sx), _mm256_extracti128_si256(sx, 1));
                let sx = _mm_add_epi32(sx, _mm_shuffle_epi32(sx, 0b01_00_11_10));
                let sx = _mm_cvtsi128_si32(_mm_add_epi32(sx, _mm_shuffle_epi32(sx, 0b10_11_00_01)));
                let sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(16 * sx));
                let dy = _mm512_set1_ps(f16_at(y));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dy), *acc);
            }
        }
        for t in 0..N {
            _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]);
        }
    }
}

/// The 16 dots of one Q8_0 group with `N` (1..=4) Q8_0 activation rows `xs` bytes apart: `out[t][r]`.
///
/// # Safety
/// As [`q4_1_group_avx512`], with Q8_0 group blocks and activation rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn q8_0_group_avx512<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { q8_0_group::<N, false>(nb, w, x, xs, out) }
}

/// [`q8_0_group_avx512`] with VNNI: the same integer sums.
///
/// # Safety
/// As [`q8_0_group_avx512`], and the CPU must have AVX512-VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn q8_0_group_vnni<const N: usize>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    unsafe { q8_0_group::<N, true>(nb, w, x, xs, out) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q8_0_group<const N: usize, const VNNI: bool>(
    nb: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [[f32; ROWS]; N],
) {
    use std::arch::x86_64::*;
    unsafe {
        let ones = _mm512_set1_epi16(1);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let gb = w.add(b * ROWS * Q8_0_BYTES);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(gb as *const __m256i));
            // maddubs takes unsigned × signed: |w| against the activation with w's sign moved onto it.
            let mut aw = [zero; 8];
            let mut neg = [0u64; 8];
            for k in 0..8 {
                let q = _mm512_loadu_si512(gb.add(32 + 64 * k) as *const __m512i);
                aw[k] = _mm512_abs_epi8(q);
                neg[k] = _mm512_movepi8_mask(q);
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let y = x.add(t * xs + b * Q8_0_BYTES);
                let dd = _mm512_mul_ps(d, _mm512_set1_ps(f16_at(y)));
                // The block's 32 products per row summed exactly in i32 (|sum| ≤ 32·128·127), in four chains.
                let mut s = [zero; 4];
                for k in 0..8 {
                    let yk = _mm512_set1_epi32(std::ptr::read_unaligned(y.add(2 + 4 * k) as *const i32));
                    let sy = _mm512_mask_sub_epi8(yk, neg[k], zero, yk);
                    s[k % 4] = if VNNI {
                        _mm512_dpbusd_epi32(s[k % 4], aw[k], sy)
                    } else {
                        // Two products of ≤ 128·127 per i16 lane: no saturation.
                        _mm512_add_epi32(s[k % 4], _mm512_madd_epi16(_mm512_maddubs_epi16(aw[k], sy), ones))
                    };
                }
                let isum = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
                *acc = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum), *acc);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::blocks32::{quantize_row_q8_0, quantize_row_q8_1};
    use crate::kernels::interleaved::{Level, TILE, act_block, dot_group_with, levels, repack, unpack_block};
    use crate::kernels::testutil::{Rng, random_blocks};

    #[test]
    fn repack_round_trips_every_row() {
        let mut rng = Rng(5);
        for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            let (bb, hdr) = block_shape(ty);
            let (rows, nb) = (37, 3);
            let offs: Vec<usize> = (0..hdr / 2).map(|i| 2 * i).collect();
            let src = random_blocks(&mut rng, rows * nb, bb, &offs);
            let packed = repack(ty, &src, rows, nb);
            for r in 0..32 {
                for b in 0..nb {
                    let gb = &packed[((r / 16) * nb + b) * group_block(ty)..][..group_block(ty)];
                    assert_eq!(unpack_block(ty, gb, r % 16), src[(r * nb + b) * bb..][..bb]);
                }
            }
            assert_eq!(packed[32 * nb * bb..], src[32 * nb * bb..], "tail rows stay row-major");
        }
    }

    /// The group kernels of every level this CPU runs against the row-major scalar dots, 1..=8 tokens, ragged block
    /// counts; the SIMD levels (AVX2, AVX-512, VNNI) do the same f32 operations per row in the same order, so they
    /// give the same bits.
    #[test]
    fn group_kernels_match_the_row_dots() {
        let mut rng = Rng(8);
        let levels = levels();
        eprintln!("levels: {levels:?}");
        for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
            let (bb, hdr) = block_shape(ty);
            let offs: Vec<usize> = (0..hdr / 2).map(|i| 2 * i).collect();
            // The extreme case: every weight at its largest magnitude (the i16 sums' bounds) against activations of
            // ±127.
            for (nb, extreme) in [(1, false), (2, false), (5, false), (18, false), (3, true)] {
                let mut src = random_blocks(&mut rng, 16 * nb, bb, &offs);
                if extreme {
                    for blk in src.chunks_exact_mut(bb) {
                        blk[hdr..].fill(if ty == GgmlType::Q8_0 { 0x80 } else { 0xff });
                    }
                }
                let packed = repack(ty, &src, 16, nb);
                let xs = nb * act_block(ty);
                let mut xq = vec![0u8; TILE * xs];
                for t in 0..TILE {
                    let sign = if t % 2 == 0 { 1.0 } else { -1.0 };
                    let x: Vec<f32> = (0..nb * 32)
                        .map(|_| if extreme { sign } else { rng.normal() })
                        .collect();
                    match ty {
                        GgmlType::Q4_1 => quantize_row_q8_1(&x, &mut xq[t * xs..(t + 1) * xs]),
                        _ => quantize_row_q8_0(&x, &mut xq[t * xs..(t + 1) * xs]),
                    }
                }
                for n in 1..=TILE {
                    let mut simd: Option<(Level, [[f32; ROWS]; TILE])> = None;
                    for &lvl in &levels {
                        let mut out = [[0.0f32; ROWS]; TILE];
                        dot_group_with(lvl, ty, nb, &packed, &xq, xs, n, &mut out);
                        if lvl != Level::Scalar {
                            match &simd {
                                Some((first, bits)) => {
                                    assert_eq!(&out, bits, "{ty} nb {nb} n {n}: {lvl:?} differs from {first:?}")
                                }
                                None => simd = Some((lvl, out)),
                            }
                        }
                        for t in 0..n {
                            let mut want = [0.0f32; ROWS];
                            dot_group_scalar(ty, nb, &packed, &xq[t * xs..], &mut want);
                            for r in 0..16 {
                                let (row, xt) = (&src[r * nb * bb..], &xq[t * xs..]);
                                let direct = match ty {
                                    GgmlType::Q4_1 => blocks32::dot_q4_1_q8_1(nb, row, xt),
                                    GgmlType::Q5_0 => blocks32::dot_q5_0_q8_0(nb, row, xt),
                                    _ => blocks32::dot_q8_0_q8_0(nb, row, xt),
                                };
                                assert_eq!(want[r], direct, "the reference reads the repacked rows");
                                let got = out[t][r];
                                assert!(
                                    (got - direct).abs() <= 1e-4 * direct.abs().max(1.0),
                                    "{ty} nb {nb} n {n} t {t} r {r} {lvl:?}: {got} vs {direct}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
