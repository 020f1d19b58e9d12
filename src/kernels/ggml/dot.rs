//! Block dot products in the lane order of ggml's x86 kernels.
//!
//! ggml's AVX2 `ggml_vec_dot_q4_1_q8_1` and `ggml_vec_dot_q8_0_q8_0`, and tinyBLAS's `tinyBLAS_Q0_AVX` (which
//! llama.cpp uses for Q8_0 weights at batch sizes ≥ 2), all keep eight f32 accumulators: lane `j` of block `b` gets
//! the integer sum of the products of elements `4j..4j+4` (for Q4_1 the low nibbles are elements 0–15 and the high
//! ones 16–31, which keeps that mapping), multiplied by the product of the two block scales and added with one FMA.
//! The eight lanes are summed by `hsum_float_8` at the end. Q4_1 adds `Σ m·s` kept in one scalar, updated with an
//! FMA (GCC contracts `summs += m * s`).

use super::{f16_to_f32, hsum8};

/// Bytes of one block of each type.
pub const Q4_1: usize = 20;
pub const Q8_0: usize = 34;
pub const Q8_1: usize = 36;
pub const Q5_0: usize = 22;

#[inline]
fn h(b: &[u8], o: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
}

/// Scalar reference of ggml's `ggml_vec_dot_q4_1_q8_1` (x86 AVX2 branch): `nb` blocks of Q4_1 against Q8_1.
pub fn dot_q4_1_q8_1_scalar(nb: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for b in 0..nb {
        let (wb, xb) = (&w[b * Q4_1..(b + 1) * Q4_1], &x[b * Q8_1..(b + 1) * Q8_1]);
        let (d0, m, d1, s) = (h(wb, 0), h(wb, 2), h(xb, 0), h(xb, 2));
        summs = m.mul_add(s, summs);
        let d = d0 * d1;
        for (j, a) in acc.iter_mut().enumerate() {
            let mut isum = 0i32;
            for e in 4 * j..4 * j + 4 {
                let q = if e < 16 { wb[4 + e] & 15 } else { wb[4 + e - 16] >> 4 };
                isum += q as i32 * xb[4 + e] as i8 as i32;
            }
            *a = d.mul_add(isum as f32, *a);
        }
    }
    hsum8(&acc) + summs
}

/// Scalar reference of ggml's `ggml_vec_dot_q8_0_q8_0` (x86 AVX2 branch) and of each output of
/// `tinyBLAS_Q0_AVX<block_q8_0>`: `nb` blocks of Q8_0 against Q8_0.
pub fn dot_q8_0_q8_0_scalar(nb: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for b in 0..nb {
        let (wb, xb) = (&w[b * Q8_0..(b + 1) * Q8_0], &x[b * Q8_0..(b + 1) * Q8_0]);
        let d = h(wb, 0) * h(xb, 0);
        for (j, a) in acc.iter_mut().enumerate() {
            let mut isum = 0i32;
            for e in 4 * j..4 * j + 4 {
                isum += wb[2 + e] as i8 as i32 * xb[2 + e] as i8 as i32;
            }
            *a = d.mul_add(isum as f32, *a);
        }
    }
    hsum8(&acc)
}

/// Scalar reference of ggml's `ggml_vec_dot_q5_0_q8_0` (x86 AVX2 branch) and of each output of
/// `tinyBLAS_Q0_AVX<block_q5_0>`: the weights `(nibble | high bit << 4) − 16`, else as Q8_0.
pub fn dot_q5_0_q8_0_scalar(nb: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for b in 0..nb {
        let (wb, xb) = (&w[b * Q5_0..(b + 1) * Q5_0], &x[b * Q8_0..(b + 1) * Q8_0]);
        let d = h(wb, 0) * h(xb, 0);
        let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
        for (j, a) in acc.iter_mut().enumerate() {
            let mut isum = 0i32;
            for e in 4 * j..4 * j + 4 {
                let nib = if e < 16 { wb[6 + e] & 15 } else { wb[6 + e - 16] >> 4 };
                let q = (nib as i32 | ((qh >> e & 1) as i32) << 4) - 16;
                isum += q * xb[2 + e] as i8 as i32;
            }
            *a = d.mul_add(isum as f32, *a);
        }
    }
    hsum8(&acc)
}

/// [`dot_q5_0_q8_0_scalar`], with AVX2 and FMA when the CPU has them (same bits).
pub fn dot_q5_0_q8_0(nb: usize, w: &[u8], x: &[u8]) -> f32 {
    assert!(w.len() >= nb * Q5_0 && x.len() >= nb * Q8_0);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { x86::dot_q5_0_q8_0(nb, w, x) };
    }
    dot_q5_0_q8_0_scalar(nb, w, x)
}

/// [`dot_q4_1_q8_1_scalar`], with AVX2 and FMA when the CPU has them (same bits).
pub fn dot_q4_1_q8_1(nb: usize, w: &[u8], x: &[u8]) -> f32 {
    assert!(w.len() >= nb * Q4_1 && x.len() >= nb * Q8_1);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present; the lengths were checked.
        return unsafe { x86::dot_q4_1_q8_1(nb, w, x) };
    }
    dot_q4_1_q8_1_scalar(nb, w, x)
}

/// [`dot_q8_0_q8_0_scalar`], with AVX2 and FMA when the CPU has them (same bits).
pub fn dot_q8_0_q8_0(nb: usize, w: &[u8], x: &[u8]) -> f32 {
    assert!(w.len() >= nb * Q8_0 && x.len() >= nb * Q8_0);
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { x86::dot_q8_0_q8_0(nb, w, x) };
    }
    dot_q8_0_q8_0_scalar(nb, w, x)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Q4_1, Q5_0, Q8_0, Q8_1};
    use crate::kernels::ggml::hsum8;
    use std::arch::x86_64::*;

    /// An f16 at byte `o` of `b`, widened exactly (a table lookup: the same value as F16C's).
    #[inline(always)]
    fn f16(t: &[f32], b: &[u8], o: usize) -> f32 {
        t[u16::from_le_bytes([b[o], b[o + 1]]) as usize]
    }

    #[target_feature(enable = "avx2,fma")]
    fn finish(acc: __m256) -> f32 {
        let mut a = [0.0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc) };
        hsum8(&a)
    }

    /// # Safety
    /// AVX2 and FMA; `w` holds `nb` Q4_1 blocks and `x` `nb` Q8_1 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_q8_1(nb: usize, w: &[u8], x: &[u8]) -> f32 {
        let t = crate::kernels::ggml::f16_table();
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0.0f32;
        let ones = _mm256_set1_epi16(1);
        let low = _mm256_set1_epi8(0x0f);
        for b in 0..nb {
            let (wb, xb) = (&w[b * Q4_1..], &x[b * Q8_1..]);
            summs = f16(t, wb, 2).mul_add(f16(t, xb, 2), summs);
            let d = _mm256_set1_ps(f16(t, wb, 0) * f16(t, xb, 0));
            // SAFETY: 16 and 32 bytes inside the blocks.
            let (t, qy) = unsafe {
                (
                    _mm_loadu_si128(wb.as_ptr().add(4) as *const __m128i),
                    _mm256_loadu_si256(xb.as_ptr().add(4) as *const __m256i),
                )
            };
            let qx = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(t, 4), t));
            let xy = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, _mm256_maddubs_epi16(qx, qy)));
            acc = _mm256_fmadd_ps(d, xy, acc);
        }
        finish(acc) + summs
    }

    /// # Safety
    /// AVX2 and FMA; `w` holds `nb` Q5_0 blocks and `x` `nb` Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_0_q8_0(nb: usize, w: &[u8], x: &[u8]) -> f32 {
        let t = crate::kernels::ggml::f16_table();
        let mut acc = _mm256_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        let low = _mm256_set1_epi8(0x0f);
        // Byte i of the broadcast qh word goes to lanes 8i..8i+8; each lane keeps its own bit.
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bits = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
        for b in 0..nb {
            let (wb, xb) = (&w[b * Q5_0..], &x[b * Q8_0..]);
            let d = _mm256_set1_ps(f16(t, wb, 0) * f16(t, xb, 0));
            let qh = i32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
            // SAFETY: 16 and 32 bytes inside the blocks.
            let (t, qy) = unsafe {
                (
                    _mm_loadu_si128(wb.as_ptr().add(6) as *const __m128i),
                    _mm256_loadu_si256(xb.as_ptr().add(2) as *const __m256i),
                )
            };
            let nib = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(t, 4), t));
            let set = _mm256_cmpeq_epi8(
                _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), shuf), bits),
                _mm256_set1_epi64x(-1),
            );
            let qx = _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8(0xF0u8 as i8)));
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, p)), acc);
        }
        finish(acc)
    }

    /// # Safety
    /// AVX2 and FMA; `w` and `x` hold `nb` Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_q8_0(nb: usize, w: &[u8], x: &[u8]) -> f32 {
        let t = crate::kernels::ggml::f16_table();
        let mut acc = _mm256_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        for b in 0..nb {
            let (wb, xb) = (&w[b * Q8_0..], &x[b * Q8_0..]);
            let d = _mm256_set1_ps(f16(t, wb, 0) * f16(t, xb, 0));
            // SAFETY: 32 bytes inside each block.
            let (qx, qy) = unsafe {
                (
                    _mm256_loadu_si256(wb.as_ptr().add(2) as *const __m256i),
                    _mm256_loadu_si256(xb.as_ptr().add(2) as *const __m256i),
                )
            };
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, p)), acc);
        }
        finish(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ggml::quant;
    use crate::kernels::testutil::Rng;

    fn case(rng: &mut Rng, nb: usize, wsize: usize) -> (Vec<u8>, Vec<f32>) {
        let mut w: Vec<u8> = (0..nb * wsize).map(|_| (rng.uniform() * 256.0) as u8).collect();
        for b in 0..nb {
            // Sane f16 scale (and min).
            for o in [0, 2] {
                let v = half::f16::from_f32((rng.uniform() - 0.5) * 0.1).to_le_bytes();
                w[b * wsize + o..b * wsize + o + 2].copy_from_slice(&v);
            }
        }
        let x = (0..nb * 32).map(|_| rng.normal()).collect();
        (w, x)
    }

    /// The SIMD kernels give the scalar references' bits, and both are within rounding of a direct f64 sum.
    #[test]
    fn dots_match_scalar_bits_and_direct_sums() {
        let mut rng = Rng(5);
        for nb in [1usize, 2, 7, 18, 48] {
            let (w, xf) = case(&mut rng, nb, Q4_1);
            let mut xq = vec![0u8; nb * Q8_1];
            quant::quantize_row_q8_1(&xf, &mut xq);
            let (a, b) = (dot_q4_1_q8_1(nb, &w, &xq), dot_q4_1_q8_1_scalar(nb, &w, &xq));
            assert_eq!(a.to_bits(), b.to_bits(), "q4_1 nb={nb}");
            let mut wf = vec![0.0f32; nb * 32];
            crate::kernels::dequantize_row(crate::gguf::GgmlType::Q4_1, &w, &mut wf);
            let mut xd = vec![0.0f32; nb * 32];
            crate::kernels::dequantize_row(crate::gguf::GgmlType::Q8_1, &xq, &mut xd);
            let direct: f64 = wf.iter().zip(&xd).map(|(p, q)| *p as f64 * *q as f64).sum();
            let mag: f64 = wf.iter().zip(&xd).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum();
            // The s term is f16-rounded: allow that on top of f32 rounding.
            assert!(
                (a as f64 - direct).abs() <= 2e-3 * mag + 1e-6,
                "q4_1 nb={nb}: {a} vs {direct}"
            );

            let (w5, xf) = case(&mut rng, nb, Q5_0);
            let mut xq = vec![0u8; nb * Q8_0];
            quant::quantize_row_q8_0(&xf, &mut xq);
            let (a, b) = (dot_q5_0_q8_0(nb, &w5, &xq), dot_q5_0_q8_0_scalar(nb, &w5, &xq));
            assert_eq!(a.to_bits(), b.to_bits(), "q5_0 nb={nb}");
            crate::kernels::dequantize_row(crate::gguf::GgmlType::Q5_0, &w5, &mut wf);
            crate::kernels::dequantize_row(crate::gguf::GgmlType::Q8_0, &xq, &mut xd);
            let direct: f64 = wf.iter().zip(&xd).map(|(p, q)| *p as f64 * *q as f64).sum();
            let mag: f64 = wf.iter().zip(&xd).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum();
            assert!(
                (a as f64 - direct).abs() <= 1e-5 * mag + 1e-6,
                "q5_0 nb={nb}: {a} vs {direct}"
            );

            let (w8, xf) = case(&mut rng, nb, Q8_0);
            let mut xq = vec![0u8; nb * Q8_0];
            quant::quantize_row_q8_0(&xf, &mut xq);
            let (a, b) = (dot_q8_0_q8_0(nb, &w8, &xq), dot_q8_0_q8_0_scalar(nb, &w8, &xq));
            assert_eq!(a.to_bits(), b.to_bits(), "q8_0 nb={nb}");
            crate::kernels::dequantize_row(crate::gguf::GgmlType::Q8_0, &w8, &mut wf);
            crate::kernels::dequantize_row(crate::gguf::GgmlType::Q8_0, &xq, &mut xd);
            let direct: f64 = wf.iter().zip(&xd).map(|(p, q)| *p as f64 * *q as f64).sum();
            let mag: f64 = wf.iter().zip(&xd).map(|(p, q)| (*p as f64 * *q as f64).abs()).sum();
            assert!(
                (a as f64 - direct).abs() <= 1e-5 * mag + 1e-6,
                "q8_0 nb={nb}: {a} vs {direct}"
            );
        }
    }
}
