//! Q4_K and Q6_K matmuls as llama.cpp runs them on this x86 build at prompt batch sizes.
//!
//! - **Q4_K** weights are repacked by ggml-cpu's `CPU_REPACK` buffer into `block_q4_Kx8` (AVX2: eight rows
//!   interleaved), and a batch is multiplied by `ggml_gemm_q4_K_8x8_q8_K` (arch/x86/repack.cpp, the AVX-512BW/DQ
//!   branch) over activations quantized four rows at a time by `ggml_quantize_mat_q8_K_4x8`; the `n % 4` leftover
//!   rows are quantized by `quantize_row_q8_K` and run through `ggml_gemv_q4_K_8x8_q8_K`. Per output: for each
//!   256-block and each pair of 32-element sub-blocks `(2p, 2p + 1)`, the exact integer
//!   `sc[2p]·Σq·x + sc[2p+1]·Σq·x` is added by one FMA with the product `d_w·d_x` to one f32 accumulator, and
//!   `mn[2p]·Σx + mn[2p+1]·Σx` by one FMA with `dmin_w·d_x` to another; the result is their difference.
//! - **Q6_K** has no x86 repack; at a batch of ≥ 8 rows `ggml_compute_forward_mul_mat` hands it to the tiled
//!   K-quant matmul (ggml-cpu/tiled, the AVX-512 VNNI microkernel) over rows quantized by `quantize_row_q8_K`. Per
//!   output and 256-block, the exact integer `Σ_s sc_s·Σ (q − 32)·x` is widened to f32, multiplied by `d_w`, and
//!   that times `d_x` is added to the accumulator (one FMA: GCC contracts the `add(acc, mul(r, d_x))` of its
//!   intrinsics).
//!
//! The integer parts are exact in any order, so the kernels here compute them however is fastest; only the f32
//! steps follow ggml's order.

use crate::kernels::kquants::scale_min_k4;

pub const QK_K: usize = 256;
pub const Q4_K_BYTES: usize = 144;
pub const Q6_K_BYTES: usize = 210;

/// Activations quantized to Q8_K: per row `cols / 256` scales, the quants, and the sum of each 32 quants.
#[derive(Default)]
pub struct Q8K {
    pub cols: usize,
    pub d: Vec<f32>,
    pub q: Vec<i8>,
    pub sum32: Vec<i32>,
}

impl Q8K {
    pub fn new(n_rows: usize, cols: usize) -> Q8K {
        let nb = cols / QK_K;
        Q8K {
            cols,
            d: vec![0.0; n_rows * nb],
            q: vec![0; n_rows * cols],
            sum32: vec![0; n_rows * nb * 8],
        }
    }
}

/// `nearest_int` of ggml-quants.c (the 1.5·2²³ trick: round to nearest, ties to even).
#[inline]
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// One 256-block of `quantize_row_q8_K_ref` (what x86's `quantize_row_q8_K` calls): the first element of largest
/// magnitude sets `iscale = −127 / max` (signed), quants `min(127, nearest(iscale·x))`, `d = 1 / iscale`.
pub fn quantize_block_q8_k_ref(x: &[f32], q: &mut [i8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let iscale = -127.0f32 / max;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = nearest_int(iscale * v).min(127) as i8;
    }
    1.0 / iscale
}

/// One row's 256-block as `ggml_quantize_mat_q8_K_4x8` (x86 AVX2 branch) quantizes it: `iscale = −127 / amax` if
/// some element equals `+amax` (a positive maximum wins a tie with a negative one), else `127 / amax`; quants
/// `round_even(x·iscale)` saturated to i8; `d = 1 / iscale`.
pub fn quantize_block_q8_k_4x8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let iscale = if amax == 0.0 {
        0.0
    } else if x.contains(&amax) {
        -127.0f32 / amax
    } else {
        127.0f32 / amax
    };
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * iscale).round_ties_even().clamp(-128.0, 127.0) as i8;
    }
    if amax != 0.0 { 1.0 / iscale } else { 0.0 }
}

/// Quantizes row `r` of `x` (`cols` wide) into row `r` of `out` with the given block quantizer.
pub fn quantize_row(x: &[f32], out: &mut Q8K, r: usize, block: fn(&[f32], &mut [i8]) -> f32) {
    let (cols, nb) = (out.cols, out.cols / QK_K);
    for b in 0..nb {
        let o = r * cols + b * QK_K;
        let q = &mut out.q[o..o + QK_K];
        out.d[r * nb + b] = block(&x[b * QK_K..(b + 1) * QK_K], q);
        for s in 0..8 {
            out.sum32[(r * nb + b) * 8 + s] = q[32 * s..32 * s + 32].iter().map(|&v| v as i32).sum();
        }
    }
}

/// A Q4_K weight row unpacked: per block `d`, `dmin`, eight 6-bit scales and mins; the quants 0..15 in element order.
#[derive(Default)]
pub struct RowQ4K {
    pub d: Vec<f32>,
    pub dmin: Vec<f32>,
    pub sc: Vec<i32>,
    pub mn: Vec<i32>,
    pub q: Vec<i8>,
}

impl RowQ4K {
    pub fn unpack(&mut self, row: &[u8], cols: usize) {
        let nb = cols / QK_K;
        let t = super::f16_table();
        self.d.resize(nb, 0.0);
        self.dmin.resize(nb, 0.0);
        self.sc.resize(nb * 8, 0);
        self.mn.resize(nb * 8, 0);
        self.q.resize(cols, 0);
        for b in 0..nb {
            let blk = &row[b * Q4_K_BYTES..(b + 1) * Q4_K_BYTES];
            self.d[b] = t[u16::from_le_bytes([blk[0], blk[1]]) as usize];
            self.dmin[b] = t[u16::from_le_bytes([blk[2], blk[3]]) as usize];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &blk[4..16]);
                self.sc[b * 8 + j] = s as i32;
                self.mn[b * 8 + j] = m as i32;
            }
            let qs = &blk[16..];
            let q = &mut self.q[b * QK_K..(b + 1) * QK_K];
            for j in 0..4 {
                for l in 0..32 {
                    q[64 * j + l] = (qs[32 * j + l] & 15) as i8;
                    q[64 * j + 32 + l] = (qs[32 * j + l] >> 4) as i8;
                }
            }
        }
    }
}

/// A Q6_K weight row unpacked: per block `d` and sixteen signed scales; the quants `q − 32` in element order.
#[derive(Default)]
pub struct RowQ6K {
    pub d: Vec<f32>,
    pub sc: Vec<i32>,
    pub q: Vec<i8>,
    /// Each element's scale as i16 (the SIMD kernel's multiplier vectors).
    pub sc16: Vec<i16>,
}

impl RowQ6K {
    pub fn unpack(&mut self, row: &[u8], cols: usize) {
        let nb = cols / QK_K;
        let t = super::f16_table();
        self.d.resize(nb, 0.0);
        self.sc.resize(nb * 16, 0);
        self.q.resize(cols, 0);
        self.sc16.resize(cols / 2, 0);
        for b in 0..nb {
            let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
            let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            self.d[b] = t[u16::from_le_bytes([blk[208], blk[209]]) as usize];
            for (s, &v) in sc.iter().enumerate() {
                self.sc[b * 16 + s] = v as i8 as i32;
                // 16 quants give 8 pair sums: 8 lanes per scale.
                self.sc16[b * 128 + 8 * s..b * 128 + 8 * s + 8].fill(v as i8 as i16);
            }
            let q = &mut self.q[b * QK_K..(b + 1) * QK_K];
            for n in 0..2 {
                let (ql, qh, q) = (&ql[64 * n..], &qh[32 * n..], &mut q[128 * n..]);
                for l in 0..32 {
                    q[l] = ((ql[l] & 15) | (qh[l] & 3) << 4) as i8 - 32;
                    q[l + 32] = ((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4) as i8 - 32;
                    q[l + 64] = ((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) as i8 - 32;
                    q[l + 96] = ((ql[l + 32] >> 4) | (qh[l] >> 6 & 3) << 4) as i8 - 32;
                }
            }
        }
    }
}

#[inline(always)]
fn idot<const N: usize>(a: &[i8], b: &[i8]) -> i32 {
    let (a, b) = (&a[..N], &b[..N]);
    let mut s = 0i32;
    for i in 0..N {
        s += a[i] as i32 * b[i] as i32;
    }
    s
}

/// One output of `ggml_gemm_q4_K_8x8_q8_K` (see the module): weight row `w` against row `t` of `x`. With AVX2
/// when the CPU has it (the same bits: only the exact integer sums are vectorized).
pub fn dot_q4_k(w: &RowQ4K, x: &Q8K, t: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { x86::dot_q4_k(w, x, t) };
    }
    dot_q4_k_scalar(w, x, t)
}

/// One output of the tiled Q6_K matmul (see the module); with AVX2 when the CPU has it (same bits).
pub fn dot_q6_k(w: &RowQ6K, x: &Q8K, t: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::has_avx2_fma() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { x86::dot_q6_k(w, x, t) };
    }
    dot_q6_k_scalar(w, x, t)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Q8K, QK_K, RowQ4K, RowQ6K};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn ld(p: &[i8]) -> __m256i {
        assert!(p.len() >= 32);
        // SAFETY: 32 bytes in bounds (checked).
        unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }
    }

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q4_k(w: &RowQ4K, x: &Q8K, t: usize) -> f32 {
        let (cols, nb) = (x.cols, x.cols / QK_K);
        let xq = &x.q[t * cols..(t + 1) * cols];
        let (mut acc, mut accm) = (0.0f32, 0.0f32);
        for b in 0..nb {
            let dx = x.d[t * nb + b];
            let (dd, dm) = (w.d[b] * dx, w.dmin[b] * dx);
            let s32 = &x.sum32[(t * nb + b) * 8..(t * nb + b) * 8 + 8];
            let sc = &w.sc[b * 8..b * 8 + 8];
            let mut v = [_mm256_setzero_si256(); 4];
            for (p, vp) in v.iter_mut().enumerate() {
                let o = b * QK_K + 64 * p;
                // SAFETY: 32-byte loads inside the rows.
                let (w0, x0, w1, x1) = unsafe { (ld(&w.q[o..]), ld(&xq[o..]), ld(&w.q[o + 32..]), ld(&xq[o + 32..])) };
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_set1_epi16(sc[2 * p] as i16));
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), _mm256_set1_epi16(sc[2 * p + 1] as i16));
                *vp = _mm256_add_epi32(p0, p1);
            }
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let mut isum = [0i32; 4];
            // SAFETY: 16 bytes.
            unsafe { _mm_storeu_si128(isum.as_mut_ptr() as *mut __m128i, h) };
            let mn = &w.mn[b * 8..b * 8 + 8];
            for p in 0..4 {
                let imin = mn[2 * p] * s32[2 * p] + mn[2 * p + 1] * s32[2 * p + 1];
                acc = (isum[p] as f32).mul_add(dd, acc);
                accm = (imin as f32).mul_add(dm, accm);
            }
        }
        acc - accm
    }

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q6_k(w: &RowQ6K, x: &Q8K, t: usize) -> f32 {
        let (cols, nb) = (x.cols, x.cols / QK_K);
        let xq = &x.q[t * cols..(t + 1) * cols];
        let mut acc = 0.0f32;
        for b in 0..nb {
            let mut a = _mm256_setzero_si256();
            for k in 0..8 {
                let o = b * QK_K + 32 * k;
                assert!(w.sc16.len() >= (o + 32) / 2);
                // SAFETY: 32-byte loads inside the rows (checked above and by `ld`).
                let (wv, xv, sv) = unsafe {
                    (
                        ld(&w.q[o..]),
                        ld(&xq[o..]),
                        _mm256_loadu_si256(w.sc16.as_ptr().add(o / 2) as *const __m256i),
                    )
                };
                let p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
                a = _mm256_add_epi32(a, _mm256_madd_epi16(p, sv));
            }
            let h = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            let h = _mm_hadd_epi32(h, h);
            let v = _mm_cvtsi128_si32(_mm_hadd_epi32(h, h));
            acc = ((v as f32) * w.d[b]).mul_add(x.d[t * nb + b], acc);
        }
        acc
    }
}

/// Scalar reference of [`dot_q4_k`].
pub fn dot_q4_k_scalar(w: &RowQ4K, x: &Q8K, t: usize) -> f32 {
    let (cols, nb) = (x.cols, x.cols / QK_K);
    let xq = &x.q[t * cols..(t + 1) * cols];
    let (mut acc, mut accm) = (0.0f32, 0.0f32);
    for b in 0..nb {
        let dx = x.d[t * nb + b];
        let (dd, dm) = (w.d[b] * dx, w.dmin[b] * dx);
        let s32 = &x.sum32[(t * nb + b) * 8..];
        for p in 0..4 {
            let o = b * QK_K + 64 * p;
            let i0 = idot::<32>(&w.q[o..], &xq[o..]);
            let i1 = idot::<32>(&w.q[o + 32..], &xq[o + 32..]);
            let (s0, s1) = (b * 8 + 2 * p, b * 8 + 2 * p + 1);
            let isum = w.sc[s0] * i0 + w.sc[s1] * i1;
            let imin = w.mn[s0] * s32[2 * p] + w.mn[s1] * s32[2 * p + 1];
            acc = (isum as f32).mul_add(dd, acc);
            accm = (imin as f32).mul_add(dm, accm);
        }
    }
    acc - accm
}

/// Scalar reference of [`dot_q6_k`].
pub fn dot_q6_k_scalar(w: &RowQ6K, x: &Q8K, t: usize) -> f32 {
    let (cols, nb) = (x.cols, x.cols / QK_K);
    let xq = &x.q[t * cols..(t + 1) * cols];
    let mut acc = 0.0f32;
    for b in 0..nb {
        let mut v = 0i32;
        for s in 0..16 {
            let o = b * QK_K + 16 * s;
            v += w.sc[b * 16 + s] * idot::<16>(&w.q[o..], &xq[o..]);
        }
        acc = ((v as f32) * w.d[b]).mul_add(x.d[t * nb + b], acc);
    }
    acc
}

/// ggml's `dequantize_row_q8_K` equivalent for tests.
#[cfg(test)]
fn dequant(x: &Q8K, t: usize) -> Vec<f64> {
    let nb = x.cols / QK_K;
    (0..x.cols)
        .map(|i| x.d[t * nb + i / QK_K] as f64 * x.q[t * x.cols + i] as f64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgmlType;
    use crate::kernels::testutil::Rng;

    fn random_blocks(rng: &mut Rng, nb: usize, size: usize, f16_at: &[usize]) -> Vec<u8> {
        let mut w: Vec<u8> = (0..nb * size).map(|_| (rng.uniform() * 256.0) as u8).collect();
        for b in 0..nb {
            for &o in f16_at {
                let v = half::f16::from_f32(rng.uniform() * 0.01).to_le_bytes();
                w[b * size + o..b * size + o + 2].copy_from_slice(&v);
            }
        }
        w
    }

    /// Both kernels are within f32 rounding of the direct f64 sum of the dequantized rows.
    #[test]
    fn k_dots_match_direct_sums() {
        let mut rng = Rng(11);
        for nb in [1usize, 3, 8] {
            let cols = nb * QK_K;
            let xf: Vec<f32> = (0..cols).map(|_| rng.normal()).collect();
            let mut x = Q8K::new(2, cols);
            quantize_row(&xf, &mut x, 0, quantize_block_q8_k_ref);
            quantize_row(&xf, &mut x, 1, quantize_block_q8_k_4x8);
            for t in 0..2 {
                let xd = dequant(&x, t);
                // The quantized row is within half a step of the input.
                for (i, (a, b)) in xd.iter().zip(&xf).enumerate() {
                    let d = x.d[t * nb + i / QK_K].abs() as f64;
                    assert!((a - *b as f64).abs() <= 0.51 * d + 1e-6);
                }
                let w4 = random_blocks(&mut rng, nb, Q4_K_BYTES, &[0, 2]);
                let mut wf = vec![0.0f32; cols];
                crate::kernels::dequantize_row(GgmlType::Q4K, &w4, &mut wf);
                let mut r4 = RowQ4K::default();
                r4.unpack(&w4, cols);
                let got = dot_q4_k(&r4, &x, t);
                assert_eq!(got.to_bits(), dot_q4_k_scalar(&r4, &x, t).to_bits());
                let got = got as f64;
                let direct: f64 = wf.iter().zip(&xd).map(|(a, b)| *a as f64 * b).sum();
                let mag: f64 = wf.iter().zip(&xd).map(|(a, b)| (*a as f64 * b).abs()).sum();
                assert!(
                    (got - direct).abs() <= 1e-5 * mag + 1e-6,
                    "q4_K nb={nb}: {got} vs {direct}"
                );

                let w6 = random_blocks(&mut rng, nb, Q6_K_BYTES, &[208]);
                crate::kernels::dequantize_row(GgmlType::Q6K, &w6, &mut wf);
                let mut r6 = RowQ6K::default();
                r6.unpack(&w6, cols);
                let got = dot_q6_k(&r6, &x, t);
                assert_eq!(got.to_bits(), dot_q6_k_scalar(&r6, &x, t).to_bits());
                let got = got as f64;
                let direct: f64 = wf.iter().zip(&xd).map(|(a, b)| *a as f64 * b).sum();
                let mag: f64 = wf.iter().zip(&xd).map(|(a, b)| (*a as f64 * b).abs()).sum();
                assert!(
                    (got - direct).abs() <= 1e-5 * mag + 1e-6,
                    "q6_K nb={nb}: {got} vs {direct}"
                );
            }
        }
    }

    #[test]
    fn q8_k_quantizers_break_sign_ties_as_ggml() {
        // +2 and −2 share the largest magnitude: the reference takes the first (−2), the 4x8 one the positive.
        let mut x = vec![0.5f32; QK_K];
        x[3] = -2.0;
        x[9] = 2.0;
        let mut q = vec![0i8; QK_K];
        let d = quantize_block_q8_k_ref(&x, &mut q);
        assert_eq!((q[3], q[9]), (-127, 127));
        assert_eq!(d, 1.0 / (-127.0f32 / -2.0));
        let d = quantize_block_q8_k_4x8(&x, &mut q);
        assert_eq!((q[3], q[9]), (127, -127));
        assert_eq!(d, 1.0 / (-127.0f32 / 2.0));
        assert!(d < 0.0);
    }
}
