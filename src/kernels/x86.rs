//! x86-64 SIMD dot kernels (AVX2+FMA+F16C, and AVX-512BW for the hottest formats), chosen at run time.
//!
//! Each kernel is written once as `kernel::<N>(n, w, x, x_stride, out)`: one weight row against `N` activation
//! rows, every weight block unpacked into registers once and reused for the `N` tokens (the prefill tile); the
//! decode dot is `N = 1`. The safe wrappers below check the slice lengths and are only ever put in a table after
//! the CPU features were detected.

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use super::blocks32::{Q4_1_BYTES, Q5_0_BYTES, Q8_0_BYTES, Q8_1_BYTES};
use super::iquants::{self, GridFormat, IQ1_S_BYTES, IQ4_NL_BYTES, IQ4_XS_BYTES, KVALUES_IQ4NL, iq4_xs_scale};
use super::kquants::{Q4_K_BYTES, Q6_K_BYTES, Q8_K_BYTES};
use super::table::{Kernels, QKernel};
use crate::gguf::GgmlType;
use std::arch::x86_64::*;

/// Whether this CPU runs the AVX2 table.
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// Whether this CPU runs the AVX-512 table.
pub fn has_avx512() -> bool {
    has_avx2() && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

type Kern<const N: usize> = unsafe fn(usize, *const u8, *const u8, usize, &mut [f32; N]);

/// Checks the bounds a kernel relies on, then runs it for `out.len()` (1..=4) tokens.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn run_multi(
    k: (Kern<1>, Kern<2>, Kern<3>, Kern<4>),
    wbytes: usize,
    xbytes: usize,
    n: usize,
    w: &[u8],
    x: &[u8],
    xs: usize,
    out: &mut [f32],
) {
    let m = out.len();
    assert!((1..=4).contains(&m), "1 to 4 tokens per call");
    assert!(w.len() >= n * wbytes, "weight row too short");
    assert!(x.len() >= (m - 1) * xs + n * xbytes, "activation rows too short");
    let (w, x) = (w.as_ptr(), x.as_ptr());
    // SAFETY: bounds checked above; the table holding these wrappers is only built when the features exist.
    unsafe {
        match m {
            1 => {
                let mut o = [0.0; 1];
                (k.0)(n, w, x, xs, &mut o);
                out.copy_from_slice(&o);
            }
            2 => {
                let mut o = [0.0; 2];
                (k.1)(n, w, x, xs, &mut o);
                out.copy_from_slice(&o);
            }
            3 => {
                let mut o = [0.0; 3];
                (k.2)(n, w, x, xs, &mut o);
                out.copy_from_slice(&o);
            }
            _ => {
                let mut o = [0.0; 4];
                (k.3)(n, w, x, xs, &mut o);
                out.copy_from_slice(&o);
            }
        }
    }
}

macro_rules! wrap {
    ($dot:ident, $multi:ident, $kern:ident, $wb:expr, $xb:expr) => {
        fn $dot(n: usize, w: &[u8], x: &[u8]) -> f32 {
            let mut o = [0.0f32; 1];
            run_multi(
                ($kern::<1>, $kern::<2>, $kern::<3>, $kern::<4>),
                $wb,
                $xb,
                n,
                w,
                x,
                0,
                &mut o,
            );
            o[0]
        }
        fn $multi(n: usize, w: &[u8], x: &[u8], xs: usize, out: &mut [f32]) {
            run_multi(
                ($kern::<1>, $kern::<2>, $kern::<3>, $kern::<4>),
                $wb,
                $xb,
                n,
                w,
                x,
                xs,
                out,
            );
        }
    };
}

wrap!(q4_1_dot_avx2, q4_1_multi_avx2, q4_1_avx2, Q4_1_BYTES, Q8_1_BYTES);
wrap!(q8_0_dot_avx2, q8_0_multi_avx2, q8_0_avx2, Q8_0_BYTES, Q8_0_BYTES);
wrap!(q5_0_dot_avx2, q5_0_multi_avx2, q5_0_avx2, Q5_0_BYTES, Q8_0_BYTES);
wrap!(q4_k_dot_avx2, q4_k_multi_avx2, q4_k_avx2, Q4_K_BYTES, Q8_K_BYTES);
wrap!(q6_k_dot_avx2, q6_k_multi_avx2, q6_k_avx2, Q6_K_BYTES, Q8_K_BYTES);
wrap!(
    iq4_nl_dot_avx2,
    iq4_nl_multi_avx2,
    iq4_nl_avx2,
    IQ4_NL_BYTES,
    Q8_0_BYTES
);
wrap!(
    iq4_xs_dot_avx2,
    iq4_xs_multi_avx2,
    iq4_xs_avx2,
    IQ4_XS_BYTES,
    Q8_K_BYTES
);
/// The AVX2 kernel of one grid format ([`iquants::GridFormat`]).
macro_rules! grid_kernel {
    ($kern:ident, $dot:ident, $multi:ident, $fmt:path, $bytes:path) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $kern<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
            unsafe { grid_avx2::<N>($fmt, n, w, x, xs, out) }
        }
        wrap!($dot, $multi, $kern, $bytes, Q8_K_BYTES);
    };
}

grid_kernel!(
    iq2_xxs_avx2,
    iq2_xxs_dot_avx2,
    iq2_xxs_multi_avx2,
    iquants::IQ2_XXS,
    iquants::IQ2_XXS_BYTES
);
grid_kernel!(
    iq2_xs_avx2,
    iq2_xs_dot_avx2,
    iq2_xs_multi_avx2,
    iquants::IQ2_XS,
    iquants::IQ2_XS_BYTES
);
grid_kernel!(
    iq2_s_avx2,
    iq2_s_dot_avx2,
    iq2_s_multi_avx2,
    iquants::IQ2_S,
    iquants::IQ2_S_BYTES
);
grid_kernel!(
    iq3_xxs_avx2,
    iq3_xxs_dot_avx2,
    iq3_xxs_multi_avx2,
    iquants::IQ3_XXS,
    iquants::IQ3_XXS_BYTES
);
grid_kernel!(
    iq3_s_avx2,
    iq3_s_dot_avx2,
    iq3_s_multi_avx2,
    iquants::IQ3_S,
    iquants::IQ3_S_BYTES
);
wrap!(q4_1_dot_avx512, q4_1_multi_avx512, q4_1_avx512, Q4_1_BYTES, Q8_1_BYTES);
wrap!(q8_0_dot_avx512, q8_0_multi_avx512, q8_0_avx512, Q8_0_BYTES, Q8_0_BYTES);

wrap!(iq1_s_dot_avx2, iq1_s_multi_avx2, iq1_s_avx2, IQ1_S_BYTES, Q8_K_BYTES);

fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    // SAFETY: equal lengths; only in the AVX2 table.
    unsafe { f32_dot(a.len(), a.as_ptr(), b.as_ptr()) }
}

fn dot_f16_avx2(a: &[u8], b: &[f32]) -> f32 {
    assert_eq!(a.len(), 2 * b.len());
    // SAFETY: a half for each float; only in the AVX2 table, whose CPUs have F16C (`has_avx2` checks it).
    unsafe { f16_dot(b.len(), a.as_ptr(), b.as_ptr()) }
}

/// The AVX2 table (call only when [`has_avx2`]).
pub fn table_avx2() -> Kernels {
    let mut k = Kernels::scalar();
    let q = |vec_dot_type, dot, multi| QKernel {
        vec_dot_type,
        dot,
        multi: Some(multi),
    };
    k.isa = "avx2";
    k.q4_1 = q(GgmlType::Q8_1, q4_1_dot_avx2, q4_1_multi_avx2);
    k.q8_0 = q(GgmlType::Q8_0, q8_0_dot_avx2, q8_0_multi_avx2);
    k.q5_0 = q(GgmlType::Q8_0, q5_0_dot_avx2, q5_0_multi_avx2);
    k.q4_k = q(GgmlType::Q8K, q4_k_dot_avx2, q4_k_multi_avx2);
    k.q6_k = q(GgmlType::Q8K, q6_k_dot_avx2, q6_k_multi_avx2);
    k.iq4_nl = q(GgmlType::Q8_0, iq4_nl_dot_avx2, iq4_nl_multi_avx2);
    k.iq4_xs = q(GgmlType::Q8K, iq4_xs_dot_avx2, iq4_xs_multi_avx2);
    k.iq2_xxs = q(GgmlType::Q8K, iq2_xxs_dot_avx2, iq2_xxs_multi_avx2);
    k.iq2_xs = q(GgmlType::Q8K, iq2_xs_dot_avx2, iq2_xs_multi_avx2);
    k.iq2_s = q(GgmlType::Q8K, iq2_s_dot_avx2, iq2_s_multi_avx2);
    k.iq3_xxs = q(GgmlType::Q8K, iq3_xxs_dot_avx2, iq3_xxs_multi_avx2);
    k.iq3_s = q(GgmlType::Q8K, iq3_s_dot_avx2, iq3_s_multi_avx2);
    k.iq1_s = q(GgmlType::Q8K, iq1_s_dot_avx2, iq1_s_multi_avx2);
    k.dot_f32 = dot_f32_avx2;
    k.dot_f16 = Some(dot_f16_avx2);
    k.quant_q8_0 = quant_q8_0_avx2;
    k.quant_q8_1 = quant_q8_1_avx2;
    k.quant_q8_k = quant_q8_k_avx2;
    k
}

/// The AVX-512 table (call only when [`has_avx512`]): AVX2 plus 512-bit kernels where they pay.
pub fn table_avx512() -> Kernels {
    let mut k = table_avx2();
    let q = |vec_dot_type, dot, multi| QKernel {
        vec_dot_type,
        dot,
        multi: Some(multi),
    };
    k.isa = "avx512";
    k.q4_1 = q(GgmlType::Q8_1, q4_1_dot_avx512, q4_1_multi_avx512);
    k.q8_0 = q(GgmlType::Q8_0, q8_0_dot_avx512, q8_0_multi_avx512);
    k
}

// ---------------------------------------------------------------------------------------------------------------
// Helpers.

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16(p: *const u8) -> f32 {
    unsafe {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load256(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load128(p: *const u8) -> __m128i {
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}

/// 16 packed bytes of nibbles to 32 bytes: low nibbles first, then high nibbles (the legacy block order).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn nibbles(q: __m128i) -> __m256i {
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0f))
}

/// 32 bits to 32 bytes: 0xff where the bit is set.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn bytes_from_bits(x: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Eight i32 sums of four products of signed bytes (the sign trick, as maddubs wants one unsigned operand).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn dot_i8_signed(ax: __m256i, sign_src: __m256i, y: __m256i) -> __m256i {
    let sy = _mm256_sign_epi8(y, sign_src);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2,fma")]
unsafe fn f32_dot(n: usize, a: *const f32, b: *const f32) -> f32 {
    // SAFETY: the caller's `n` floats at `a`.
    unsafe { dot_with(n, |i| _mm256_loadu_ps(a.add(i)), |i| *a.add(i), b) }
}

/// `f32_dot` of F16 weights (`n` little-endian halves at `a`), converted in registers: the products and sums of
/// `f32_dot` on the converted row, so the same bits, without writing the row out first.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_dot(n: usize, a: *const u8, b: *const f32) -> f32 {
    // SAFETY: the caller's `2n` bytes at `a`.
    unsafe {
        dot_with(
            n,
            |i| _mm256_cvtph_ps(_mm_loadu_si128(a.add(2 * i) as *const __m128i)),
            |i| half::f16::from_le_bytes([*a.add(2 * i), *a.add(2 * i + 1)]).to_f32(),
            b,
        )
    }
}

/// Four 8-lane partial sums over 32 values at a time, then 8 at a time into the first, then the scalar tail: one
/// order for every weight storage, given how to load 8 weights (`load8`) and one (`load1`) from index `i`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot_with(n: usize, load8: impl Fn(usize) -> __m256, load1: impl Fn(usize) -> f32, b: *const f32) -> f32 {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, s) in acc.iter_mut().enumerate() {
                *s = _mm256_fmadd_ps(load8(i + 8 * k), _mm256_loadu_ps(b.add(i + 8 * k)), *s);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(load8(i), _mm256_loadu_ps(b.add(i)), acc[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        while i < n {
            s += load1(i) * *b.add(i);
            i += 1;
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX2 activation quantizers: the same bytes as the scalar ones (same f32 operations, round half to even).

fn quant_q8_0_avx2(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(32) && out.len() == x.len() / 32 * Q8_0_BYTES,
        "Q8_0 row lengths"
    );
    for (v, b) in x.chunks_exact(32).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        // SAFETY: 32 floats in, 34 bytes out; only in the AVX2 table.
        unsafe { q8_block(v.as_ptr(), b.as_mut_ptr(), false) };
    }
}

fn quant_q8_1_avx2(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(32) && out.len() == x.len() / 32 * Q8_1_BYTES,
        "Q8_1 row lengths"
    );
    for (v, b) in x.chunks_exact(32).zip(out.chunks_exact_mut(Q8_1_BYTES)) {
        // SAFETY: 32 floats in, 36 bytes out; only in the AVX2 table.
        unsafe { q8_block(v.as_ptr(), b.as_mut_ptr(), true) };
    }
}

/// Eight i32 vectors (in order) to 32 bytes in order.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn pack_i32x32(i: [__m256i; 4]) -> __m256i {
    let a = _mm256_packs_epi32(i[0], i[1]);
    let b = _mm256_packs_epi32(i[2], i[3]);
    let p = _mm256_packs_epi16(a, b);
    _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_block(x: *const f32, out: *mut u8, with_sum: bool) {
    unsafe {
        let abs_mask = _mm256_set1_ps(-0.0);
        let v = [
            _mm256_loadu_ps(x),
            _mm256_loadu_ps(x.add(8)),
            _mm256_loadu_ps(x.add(16)),
            _mm256_loadu_ps(x.add(24)),
        ];
        let mut m = _mm256_max_ps(_mm256_andnot_ps(abs_mask, v[0]), _mm256_andnot_ps(abs_mask, v[1]));
        m = _mm256_max_ps(
            m,
            _mm256_max_ps(_mm256_andnot_ps(abs_mask, v[2]), _mm256_andnot_ps(abs_mask, v[3])),
        );
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        let d = a / 127.0;
        let id = _mm256_set1_ps(if a != 0.0 { 127.0 / a } else { 0.0 });
        let mut q = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let r = _mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[k] = _mm256_cvtps_epi32(r);
        }
        let off = if with_sum { 4 } else { 2 };
        _mm256_storeu_si256(out.add(off) as *mut __m256i, pack_i32x32(q));
        std::ptr::copy_nonoverlapping(super::blocks32::f16_bytes(d).as_ptr(), out, 2);
        if with_sum {
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
            std::ptr::copy_nonoverlapping(super::blocks32::f16_bytes(s as f32 * d).as_ptr(), out.add(2), 2);
        }
    }
}

fn quant_q8_k_avx2(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(256) && out.len() == x.len() / 256 * Q8_K_BYTES,
        "Q8_K row lengths"
    );
    for (v, b) in x.chunks_exact(256).zip(out.chunks_exact_mut(Q8_K_BYTES)) {
        // SAFETY: 256 floats in, 292 bytes out; only in the AVX2 table.
        unsafe { q8k_block(v.as_ptr(), b) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8k_block(x: *const f32, b: &mut [u8]) {
    unsafe {
        let abs_mask = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for k in 0..32 {
            m = _mm256_max_ps(m, _mm256_andnot_ps(abs_mask, _mm256_loadu_ps(x.add(8 * k))));
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        if amax == 0.0 {
            b.fill(0);
            return;
        }
        // The first value of that magnitude, sign kept (as the scalar quantizer picks it).
        let mut max = amax;
        for k in 0..256 {
            if (*x.add(k)).abs() == amax {
                max = *x.add(k);
                break;
            }
        }
        let iscale = -127.0 / max;
        let is = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        for g in 0..8 {
            let mut q = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let v = _mm256_mul_ps(is, _mm256_loadu_ps(x.add(32 * g + 8 * k)));
                let r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(r), cap);
            }
            _mm256_storeu_si256(b.as_mut_ptr().add(4 + 32 * g) as *mut __m256i, pack_i32x32(q));
            // Sums of each 16: q[0] + q[1] and q[2] + q[3].
            for (h, (a, c)) in [(q[0], q[1]), (q[2], q[3])].into_iter().enumerate() {
                let s = _mm256_add_epi32(a, c);
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
                let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
                let o = 260 + 2 * (2 * g + h);
                b[o..o + 2].copy_from_slice(&(s as i16).to_le_bytes());
            }
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX2 kernels.

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut summ = [0.0f32; N];
        for b in 0..n {
            let wb = w.add(b * Q4_1_BYTES);
            let (dw, mw) = (f16(wb), f16(wb.add(2)));
            let qw = nibbles(load128(wb.add(4)));
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_1_BYTES);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, load256(yb.add(4))), ones);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * f16(yb)), acc[t]);
                summ[t] += mw * f16(yb.add(2));
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]) + summ[t];
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * Q8_0_BYTES);
            let dw = f16(wb);
            let qw = load256(wb.add(2));
            let ax = _mm256_sign_epi8(qw, qw);
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let p = dot_i8_signed(ax, qw, load256(yb.add(2)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * f16(yb)), acc[t]);
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * Q5_0_BYTES);
            let dw = f16(wb);
            let qh = std::ptr::read_unaligned(wb.add(2) as *const u32);
            // Weight - 16 as a signed byte: the nibble with 0xf0 or'ed in where the fifth bit is clear.
            let hi = _mm256_andnot_si256(bytes_from_bits(qh), _mm256_set1_epi8(0xf0u8 as i8));
            let qw = _mm256_or_si256(nibbles(load128(wb.add(6))), hi);
            let ax = _mm256_sign_epi8(qw, qw);
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let p = dot_i8_signed(ax, qw, load256(yb.add(2)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * f16(yb)), acc[t]);
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]);
        }
    }
}

/// 16 bytes of IQ4 nibbles to their 32 signed levels (low nibbles first): one byte shuffle through the table.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn iq4_levels(q: *const u8) -> __m256i {
    unsafe {
        let kv = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
        _mm256_shuffle_epi8(_mm256_set_m128i(kv, kv), nibbles(load128(q)))
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_nl_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * IQ4_NL_BYTES);
            let dw = f16(wb);
            let qw = iq4_levels(wb.add(2));
            let ax = _mm256_sign_epi8(qw, qw);
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let p = dot_i8_signed(ax, qw, load256(yb.add(2)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * f16(yb)), acc[t]);
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * IQ4_XS_BYTES);
            let dw = f16(wb);
            let block = std::slice::from_raw_parts(wb, IQ4_XS_BYTES);
            let mut sumi = [_mm256_setzero_si256(); N];
            for ib in 0..8 {
                let qw = iq4_levels(wb.add(8 + 16 * ib));
                let ax = _mm256_sign_epi8(qw, qw);
                let ls = _mm256_set1_epi16((iq4_xs_scale(block, ib) - 32) as i16);
                for t in 0..N {
                    let q8 = load256(x.add(t * xs + b * Q8_K_BYTES + 4 + 32 * ib));
                    let p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(q8, qw));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p16, ls));
                }
            }
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(dw * yd), acc[t]);
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]);
        }
    }
}

/// A grid i-quant against `N` Q8_K rows: each 32-weight sub-block unpacked once ([`iquants::GridSub`]): its
/// magnitudes as unsigned bytes, its signs put on the activations (negated where the bit is set; Q8_K holds no
/// -128), then unsigned-by-signed byte products summed in pairs and scaled per 16 weights.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn grid_avx2<const N: usize>(
    f: GridFormat,
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * f.bytes);
            let block = std::slice::from_raw_parts(wb, f.bytes);
            let mut sumi = [_mm256_setzero_si256(); N];
            for ib in 0..8 {
                let g = (f.sub)(block, ib);
                let mags = _mm256_loadu_si256(g.grid.as_ptr() as *const __m256i);
                let minus = bytes_from_bits(g.signs);
                let scales = _mm256_set_m128i(_mm_set1_epi16(g.scales[1] as i16), _mm_set1_epi16(g.scales[0] as i16));
                for t in 0..N {
                    let q8 = load256(x.add(t * xs + b * Q8_K_BYTES + 4 + 32 * ib));
                    let signed = _mm256_sub_epi8(_mm256_xor_si256(q8, minus), minus);
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(mags, signed), scales);
                    sumi[t] = _mm256_add_epi32(sumi[t], p);
                }
            }
            let dw = f16(wb);
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(dw * yd), acc[t]);
            }
        }
        for t in 0..N {
            out[t] = f.factor * hsum(acc[t]);
        }
    }
}

/// IQ1_S against `N` Q8_K rows: per 32-weight sub-block ([`iquants::Iq1Sub`]) the signed byte dot of its -1/0/1
/// values, times its scale; the ±1/8 shift times the activations' sums, which Q8_K carries, on the side.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq1_s_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        let mut shift = [0.0f32; N];
        for b in 0..n {
            let wb = w.add(b * IQ1_S_BYTES);
            let block = std::slice::from_raw_parts(wb, IQ1_S_BYTES);
            let mut sumi = [_mm256_setzero_si256(); N];
            let mut sumi1 = [0i32; N];
            for ib in 0..8 {
                let g = iquants::iq1_s_sub(block, ib);
                let vals = _mm256_loadu_si256(g.grid.as_ptr() as *const __m256i);
                let ax = _mm256_sign_epi8(vals, vals);
                let ls = _mm256_set1_epi16(g.scale as i16);
                for t in 0..N {
                    let yb = x.add(t * xs + b * Q8_K_BYTES);
                    let q8 = load256(yb.add(4 + 32 * ib));
                    let p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(q8, vals));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p16, ls));
                    let bs = |i: usize| std::ptr::read_unaligned(yb.add(260 + 2 * i) as *const i16) as i32;
                    sumi1[t] += g.scale * g.delta * (bs(2 * ib) + bs(2 * ib + 1));
                }
            }
            let dw = f16(wb);
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(dw * yd), acc[t]);
                shift[t] += dw * yd * iquants::IQ1S_DELTA * sumi1[t] as f32;
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]) + shift[t];
        }
    }
}

/// The eight 6-bit scales and eight mins of a Q4_K/Q5_K block, unpacked to bytes.
#[inline(always)]
fn k4_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (k1, k2, k3) = (0x3f3f3f3fu32, 0x0f0f0f0fu32, 0x03030303u32);
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let sc_lo = u0 & k1;
    let sc_hi = (u2 & k2) | (((u0 >> 6) & k3) << 4);
    let m_lo = u1 & k1;
    let m_hi = ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4);
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    sc[..4].copy_from_slice(&sc_lo.to_le_bytes());
    sc[4..].copy_from_slice(&sc_hi.to_le_bytes());
    m[..4].copy_from_slice(&m_lo.to_le_bytes());
    m[4..].copy_from_slice(&m_hi.to_le_bytes());
    (sc, m)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut accm = [_mm_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * Q4_K_BYTES);
            let (dw, dminw) = (f16(wb), f16(wb.add(2)));
            let (sc, mn) = k4_scales_mins(&*(wb.add(4) as *const [u8; 12]));
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr() as *const __m128i));
            let mut sumi = [_mm256_setzero_si256(); N];
            for j in 0..4 {
                let qb = load256(wb.add(16 + 32 * j));
                let ql = _mm256_and_si256(qb, m4);
                let qh = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
                let (sl, sh) = (
                    _mm256_set1_epi16(sc[2 * j] as i16),
                    _mm256_set1_epi16(sc[2 * j + 1] as i16),
                );
                for t in 0..N {
                    let q8 = x.add(t * xs + b * Q8_K_BYTES + 4 + 64 * j);
                    let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, load256(q8)));
                    let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, load256(q8.add(32))));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
                }
            }
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_K_BYTES);
                let yd = std::ptr::read_unaligned(yb as *const f32);
                let bs = load256(yb.add(260));
                let bs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                let prod = _mm_madd_epi16(mins, bs);
                accm[t] = _mm_fmadd_ps(_mm_set1_ps(-yd * dminw), _mm_cvtepi32_ps(prod), accm[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(yd * dw), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            }
        }
        for t in 0..N {
            let m = accm[t];
            let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            out[t] = hsum(acc[t]) + _mm_cvtss_f32(m);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_avx2<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(3);
        let m32 = _mm256_set1_epi8(32);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..n {
            let wb = w.add(b * Q6_K_BYTES);
            let dw = f16(wb.add(208));
            let scales = load128(wb.add(192));
            let mut sumi = [_mm256_setzero_si256(); N];
            for half in 0..2 {
                let ql = wb.add(64 * half);
                let qhb = load256(wb.add(128 + 32 * half));
                let (b1, b2) = (load256(ql), load256(ql.add(32)));
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(b1, m4),
                        _mm256_slli_epi16(_mm256_and_si256(qhb, m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(b2, m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhb, 2), m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(b1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhb, 4), m2), 4),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qhb, 6), m2), 4),
                    ),
                ];
                for (k, qk) in q.iter().enumerate() {
                    // Scales of sub-blocks g and g + 1 (16 weights each), as 8 + 8 i16.
                    let g = (8 * half + 2 * k) as i64;
                    let sel = _mm_set_epi64x((g + 1) * 0x0101010101010101, g * 0x0101010101010101);
                    let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, sel));
                    for t in 0..N {
                        let q8 = load256(x.add(t * xs + b * Q8_K_BYTES + 4 + 128 * half + 32 * k));
                        // (q - 32)·y = q·y - 32·y, both fit i16 pairs.
                        let p = _mm256_sub_epi16(_mm256_maddubs_epi16(*qk, q8), _mm256_maddubs_epi16(m32, q8));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(s, p));
                    }
                }
            }
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(yd * dw), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            }
        }
        for t in 0..N {
            out[t] = hsum(acc[t]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 kernels: two 32-weight blocks per 512-bit register.

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
unsafe fn pair256(a: *const u8, b: *const u8) -> __m512i {
    unsafe { _mm512_inserti64x4(_mm512_castsi256_si512(load256(a)), load256(b), 1) }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
#[inline]
fn scale_pair(a: f32, b: f32) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_set1_ps(a)),
        _mm256_castps_pd(_mm256_set1_ps(b)),
        1,
    ))
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn q4_1_avx512<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let ones = _mm512_set1_epi16(1);
        let m4 = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut summ = [0.0f32; N];
        let mut b = 0;
        while b + 2 <= n {
            let (w0, w1) = (w.add(b * Q4_1_BYTES), w.add((b + 1) * Q4_1_BYTES));
            let (d0, d1) = (f16(w0), f16(w1));
            let (m0, m1) = (f16(w0.add(2)), f16(w1.add(2)));
            let (q0, q1) = (load128(w0.add(4)), load128(w1.add(4)));
            let q = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set_m128i(q0, q0)),
                _mm256_set_m128i(q1, q1),
                1,
            );
            // Lanes 1 and 3 (the high nibbles) shifted down.
            let qw = _mm512_and_si512(_mm512_mask_blend_epi64(0b1100_1100, q, _mm512_srli_epi16(q, 4)), m4);
            for t in 0..N {
                let (y0, y1) = (x.add(t * xs + b * Q8_1_BYTES), x.add(t * xs + (b + 1) * Q8_1_BYTES));
                let p = _mm512_madd_epi16(_mm512_maddubs_epi16(qw, pair256(y0.add(4), y1.add(4))), ones);
                let d = scale_pair(d0 * f16(y0), d1 * f16(y1));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, acc[t]);
                summ[t] += m0 * f16(y0.add(2)) + m1 * f16(y1.add(2));
            }
            b += 2;
        }
        if b < n {
            let mut o = [0.0f32; N];
            q4_1_avx2::<N>(1, w.add(b * Q4_1_BYTES), x.add(b * Q8_1_BYTES), xs, &mut o);
            for t in 0..N {
                summ[t] += o[t];
            }
        }
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]) + summ[t];
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn q8_0_avx512<const N: usize>(n: usize, w: *const u8, x: *const u8, xs: usize, out: &mut [f32; N]) {
    unsafe {
        let ones = _mm512_set1_epi16(1);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut b = 0;
        while b + 2 <= n {
            let (w0, w1) = (w.add(b * Q8_0_BYTES), w.add((b + 1) * Q8_0_BYTES));
            let (d0, d1) = (f16(w0), f16(w1));
            let qw = pair256(w0.add(2), w1.add(2));
            let ax = _mm512_abs_epi8(qw);
            // Bytes where the weight is negative: the activation's sign is flipped there (and zeroed with it
            // where the weight is 0, which `ax` does already).
            let neg = _mm512_movepi8_mask(qw);
            for t in 0..N {
                let (y0, y1) = (x.add(t * xs + b * Q8_0_BYTES), x.add(t * xs + (b + 1) * Q8_0_BYTES));
                let y = pair256(y0.add(2), y1.add(2));
                let sy = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
                let p = _mm512_madd_epi16(_mm512_maddubs_epi16(ax, sy), ones);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale_pair(d0 * f16(y0), d1 * f16(y1)), acc[t]);
            }
            b += 2;
        }
        let mut tail = [0.0f32; N];
        if b < n {
            q8_0_avx2::<N>(1, w.add(b * Q8_0_BYTES), x.add(b * Q8_0_BYTES), xs, &mut tail);
        }
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{Rng, random_blocks};
    use super::super::{Kernels, QKernel};
    use super::*;

    fn tables() -> Vec<Kernels> {
        let mut v = vec![];
        if has_avx2() {
            v.push(table_avx2());
        }
        if has_avx512() {
            v.push(table_avx512());
        }
        v
    }

    /// Every SIMD kernel against its scalar reference: ragged block counts, 1..=4 tokens, random blocks (any bit
    /// pattern of quants and packed scales).
    #[test]
    fn simd_dots_match_scalar() {
        use GgmlType::*;
        let s = Kernels::scalar();
        let mut rng = Rng(99);
        for k in tables() {
            let iquants = [IQ4NL, IQ4XS, IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S];
            for ty in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K]
                .into_iter()
                .chain(iquants)
            {
                let (fast, slow): (QKernel, QKernel) = (k.for_type(ty).unwrap(), s.for_type(ty).unwrap());
                let vdt = fast.vec_dot_type;
                assert_eq!(vdt, slow.vec_dot_type);
                let offs = super::super::tests::f16_offsets(ty);
                for nb in [1, 2, 3, 5, 8, 20] {
                    let w = random_blocks(&mut rng, nb, ty.type_size(), offs);
                    let cols = nb * ty.block_size();
                    let xrb = vdt.row_bytes(cols).unwrap();
                    let x: Vec<f32> = (0..4 * cols).map(|_| rng.normal()).collect();
                    let mut xq = vec![0u8; 4 * xrb];
                    for t in 0..4 {
                        (s.quant(vdt))(&x[t * cols..(t + 1) * cols], &mut xq[t * xrb..(t + 1) * xrb]);
                    }
                    let want: Vec<f32> = (0..4).map(|t| (slow.dot)(nb, &w, &xq[t * xrb..])).collect();
                    let mag: f32 = want.iter().fold(1e-3, |a, v| a.max(v.abs()));
                    let close = |a: f32, b: f32| (a - b).abs() <= 2e-5 * mag + 1e-4 * b.abs();
                    let got = (fast.dot)(nb, &w, &xq);
                    assert!(close(got, want[0]), "{} {ty} nb{nb}: {got} vs {}", k.isa, want[0]);
                    let Some(multi) = fast.multi else { continue };
                    for m in 1..=4 {
                        let mut out = vec![0.0; m];
                        multi(nb, &w, &xq, xrb, &mut out);
                        for t in 0..m {
                            assert!(
                                close(out[t], want[t]),
                                "{} {ty} nb{nb} m{m} t{t}: {} vs {}",
                                k.isa,
                                out[t],
                                want[t]
                            );
                        }
                    }
                }
            }
            let a: Vec<f32> = (0..77).map(|_| rng.normal()).collect();
            let b: Vec<f32> = (0..77).map(|_| rng.normal()).collect();
            assert!(((k.dot_f32)(&a, &b) - (s.dot_f32)(&a, &b)).abs() < 1e-4);
        }
    }

    /// The fused F16 dot gives the bits of converting the row and taking the table's f32 dot, for lengths with
    /// every tail (32-wide, 8-wide, scalar) and rows at odd byte addresses.
    #[test]
    fn f16_dot_is_the_f32_dot_of_the_converted_row() {
        let mut rng = Rng(7);
        for k in tables() {
            let dot_f16 = k.dot_f16.expect("every x86 SIMD table has an F16 dot");
            for n in [1, 7, 8, 31, 32, 33, 77, 1024] {
                let w: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let mut bytes = vec![0u8];
                bytes.extend(w.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()));
                let mut row = vec![0.0; n];
                crate::kernels::float::dequantize_f16(&bytes[1..], &mut row);
                let want = (k.dot_f32)(&row, &x);
                assert_eq!(dot_f16(&bytes[1..], &x).to_bits(), want.to_bits(), "{} n{n}", k.isa);
            }
        }
    }

    /// The quantizers of a table produce the same bytes as the scalar ones.
    #[test]
    fn simd_quantizers_match_scalar() {
        let s = Kernels::scalar();
        let mut rng = Rng(5);
        let x: Vec<f32> = (0..1024).map(|_| rng.normal() * 3.0).collect();
        for k in tables() {
            for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
                let rb = ty.row_bytes(x.len()).unwrap();
                let (mut a, mut b) = (vec![0u8; rb], vec![0u8; rb]);
                (k.quant(ty))(&x, &mut a);
                (s.quant(ty))(&x, &mut b);
                assert_eq!(a, b, "{} {ty}", k.isa);
            }
        }
    }
}
