//! AArch64 NEON dot kernels and activation quantizers, chosen at run time.
//!
//! NEON is part of the AArch64 baseline, so the plain table runs on every 64-bit ARM CPU. Integer block sums are
//! exact: 16 signed byte products at a time with `smull`/`smull2` (widening to i16, which holds any byte product)
//! accumulated pairwise into i32 lanes with `sadalp`. CPUs with the dot-product extension (Armv8.2+, reported as
//! `dotprod`) get a second table whose kernels add four byte products per i32 lane in one `sdot`; `vdotq_s32` is not
//! stable in Rust yet, so that one instruction is inline assembly. The two spread a block's products differently over
//! the four lanes, so their f32 results differ in rounding only.
//!
//! As in the x86 kernels, each kernel is written once as `kernel::<N, SDOT>(n, w, x, x_stride, out)`: one weight row
//! against `N` (1..=4) activation rows, each weight block unpacked into registers once and used for all `N` tokens.
//! Block sums are scaled in f32 vectors and reduced at the end, so results equal the scalar reference up to the order
//! of the f32 additions. The quantizers do the scalar quantizers' f32 operations in the same order per value and give
//! the same bytes. Formats without a kernel here (Q5_1, Q2_K, Q3_K, Q5_K) use the scalar ones. SiLU, GELU
//! and the attention partials have NEON versions next to their scalar references, in `ops.rs` and `attention.rs`.

#![allow(clippy::needless_range_loop)] // index loops mirror the block layouts

use super::blocks32::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q8_0_BYTES, Q8_1_BYTES};
use super::iquants::{self, GridFormat, IQ1_S_BYTES, IQ4_NL_BYTES, IQ4_XS_BYTES, KVALUES_IQ4NL, iq4_xs_scale};
use super::kquants::{Q4_K_BYTES, Q6_K_BYTES, Q8_K_BYTES, scale_min_k4};
use super::table::{Kernels, QKernel};
use crate::gguf::GgmlType;
use std::arch::aarch64::*;
use std::arch::asm;

/// Whether this CPU has the dot-product instructions (`sdot`) the second table uses.
pub fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// The table for every AArch64 CPU.
pub fn table_neon() -> Kernels {
    let mut k = Kernels::scalar();
    let q = |vec_dot_type, dot, multi| QKernel {
        vec_dot_type,
        dot,
        multi: Some(multi),
    };
    k.isa = "neon";
    k.q4_0 = q(GgmlType::Q8_0, q4_0_dot, q4_0_multi);
    k.q4_1 = q(GgmlType::Q8_1, q4_1_dot, q4_1_multi);
    k.q5_0 = q(GgmlType::Q8_0, q5_0_dot, q5_0_multi);
    k.q8_0 = q(GgmlType::Q8_0, q8_0_dot, q8_0_multi);
    k.q4_k = q(GgmlType::Q8K, q4_k_dot, q4_k_multi);
    k.q6_k = q(GgmlType::Q8K, q6_k_dot, q6_k_multi);
    k.iq4_nl = q(GgmlType::Q8_0, iq4_nl_dot, iq4_nl_multi);
    k.iq4_xs = q(GgmlType::Q8K, iq4_xs_dot, iq4_xs_multi);
    k.iq2_xxs = q(GgmlType::Q8K, iq2_xxs_dot, iq2_xxs_multi);
    k.iq2_xs = q(GgmlType::Q8K, iq2_xs_dot, iq2_xs_multi);
    k.iq2_s = q(GgmlType::Q8K, iq2_s_dot, iq2_s_multi);
    k.iq3_xxs = q(GgmlType::Q8K, iq3_xxs_dot, iq3_xxs_multi);
    k.iq3_s = q(GgmlType::Q8K, iq3_s_dot, iq3_s_multi);
    k.iq1_s = q(GgmlType::Q8K, iq1_s_dot, iq1_s_multi);
    k.dot_f32 = dot_f32_neon;
    k.quant_q8_0 = quant_q8_0_neon;
    k.quant_q8_1 = quant_q8_1_neon;
    k.quant_q8_k = quant_q8_k_neon;
    k
}

/// The table with `sdot` in the integer kernels (call only when [`has_dotprod`]).
pub fn table_neon_dotprod() -> Kernels {
    let mut k = table_neon();
    let q = |vec_dot_type, dot, multi| QKernel {
        vec_dot_type,
        dot,
        multi: Some(multi),
    };
    k.isa = "neon-dotprod";
    k.q4_0 = q(GgmlType::Q8_0, q4_0_dot_sdot, q4_0_multi_sdot);
    k.q4_1 = q(GgmlType::Q8_1, q4_1_dot_sdot, q4_1_multi_sdot);
    k.q5_0 = q(GgmlType::Q8_0, q5_0_dot_sdot, q5_0_multi_sdot);
    k.q8_0 = q(GgmlType::Q8_0, q8_0_dot_sdot, q8_0_multi_sdot);
    k.q4_k = q(GgmlType::Q8K, q4_k_dot_sdot, q4_k_multi_sdot);
    k.q6_k = q(GgmlType::Q8K, q6_k_dot_sdot, q6_k_multi_sdot);
    k.iq4_nl = q(GgmlType::Q8_0, iq4_nl_dot_sdot, iq4_nl_multi_sdot);
    k.iq4_xs = q(GgmlType::Q8K, iq4_xs_dot_sdot, iq4_xs_multi_sdot);
    k.iq2_xxs = q(GgmlType::Q8K, iq2_xxs_dot_sdot, iq2_xxs_multi_sdot);
    k.iq2_xs = q(GgmlType::Q8K, iq2_xs_dot_sdot, iq2_xs_multi_sdot);
    k.iq2_s = q(GgmlType::Q8K, iq2_s_dot_sdot, iq2_s_multi_sdot);
    k.iq3_xxs = q(GgmlType::Q8K, iq3_xxs_dot_sdot, iq3_xxs_multi_sdot);
    k.iq3_s = q(GgmlType::Q8K, iq3_s_dot_sdot, iq3_s_multi_sdot);
    k.iq1_s = q(GgmlType::Q8K, iq1_s_dot_sdot, iq1_s_multi_sdot);
    k
}

/// Checks the bounds a kernel relies on: `n` weight blocks, and `m` activation rows `xs` bytes apart.
#[inline(always)]
fn check_bounds(n: usize, w: &[u8], wbytes: usize, x: &[u8], xs: usize, xbytes: usize, m: usize) {
    assert!((1..=4).contains(&m), "1 to 4 tokens per call");
    assert!(w.len() >= n * wbytes, "weight row too short");
    assert!(x.len() >= (m - 1) * xs + n * xbytes, "activation rows too short");
}

/// The safe `dot` and `multi` entries of one kernel instance (`$sdot`: whether it uses `sdot`).
macro_rules! wrap {
    ($dot:ident, $multi:ident, $kern:ident, $sdot:expr, $wb:expr, $xb:expr) => {
        fn $dot(n: usize, w: &[u8], x: &[u8]) -> f32 {
            check_bounds(n, w, $wb, x, 0, $xb, 1);
            let mut o = [0.0f32; 1];
            // SAFETY: bounds checked above; `sdot` instances are only in the table built when the CPU has it.
            unsafe { $kern::<1, $sdot>(n, w.as_ptr(), x.as_ptr(), 0, &mut o) };
            o[0]
        }
        fn $multi(n: usize, w: &[u8], x: &[u8], xs: usize, out: &mut [f32]) {
            check_bounds(n, w, $wb, x, xs, $xb, out.len());
            let (w, x) = (w.as_ptr(), x.as_ptr());
            // SAFETY: as above; `out` has the length of the array it is converted to.
            unsafe {
                match out.len() {
                    1 => $kern::<1, $sdot>(n, w, x, xs, out.try_into().unwrap()),
                    2 => $kern::<2, $sdot>(n, w, x, xs, out.try_into().unwrap()),
                    3 => $kern::<3, $sdot>(n, w, x, xs, out.try_into().unwrap()),
                    _ => $kern::<4, $sdot>(n, w, x, xs, out.try_into().unwrap()),
                }
            }
        }
    };
}

wrap!(q4_0_dot, q4_0_multi, q4_0_kernel, false, Q4_0_BYTES, Q8_0_BYTES);
wrap!(q4_1_dot, q4_1_multi, q4_1_kernel, false, Q4_1_BYTES, Q8_1_BYTES);
wrap!(q5_0_dot, q5_0_multi, q5_0_kernel, false, Q5_0_BYTES, Q8_0_BYTES);
wrap!(q8_0_dot, q8_0_multi, q8_0_kernel, false, Q8_0_BYTES, Q8_0_BYTES);
wrap!(q4_k_dot, q4_k_multi, q4_k_kernel, false, Q4_K_BYTES, Q8_K_BYTES);
wrap!(q6_k_dot, q6_k_multi, q6_k_kernel, false, Q6_K_BYTES, Q8_K_BYTES);
wrap!(iq4_nl_dot, iq4_nl_multi, iq4_nl_kernel, false, IQ4_NL_BYTES, Q8_0_BYTES);
wrap!(iq4_xs_dot, iq4_xs_multi, iq4_xs_kernel, false, IQ4_XS_BYTES, Q8_K_BYTES);
wrap!(
    iq4_nl_dot_sdot,
    iq4_nl_multi_sdot,
    iq4_nl_kernel,
    true,
    IQ4_NL_BYTES,
    Q8_0_BYTES
);
wrap!(
    iq4_xs_dot_sdot,
    iq4_xs_multi_sdot,
    iq4_xs_kernel,
    true,
    IQ4_XS_BYTES,
    Q8_K_BYTES
);
wrap!(
    q4_0_dot_sdot,
    q4_0_multi_sdot,
    q4_0_kernel,
    true,
    Q4_0_BYTES,
    Q8_0_BYTES
);
wrap!(
    q4_1_dot_sdot,
    q4_1_multi_sdot,
    q4_1_kernel,
    true,
    Q4_1_BYTES,
    Q8_1_BYTES
);
wrap!(
    q5_0_dot_sdot,
    q5_0_multi_sdot,
    q5_0_kernel,
    true,
    Q5_0_BYTES,
    Q8_0_BYTES
);
wrap!(
    q8_0_dot_sdot,
    q8_0_multi_sdot,
    q8_0_kernel,
    true,
    Q8_0_BYTES,
    Q8_0_BYTES
);
wrap!(
    q4_k_dot_sdot,
    q4_k_multi_sdot,
    q4_k_kernel,
    true,
    Q4_K_BYTES,
    Q8_K_BYTES
);
wrap!(
    q6_k_dot_sdot,
    q6_k_multi_sdot,
    q6_k_kernel,
    true,
    Q6_K_BYTES,
    Q8_K_BYTES
);

/// The NEON kernels (plain and `sdot`) of one grid format ([`iquants::GridFormat`]).
macro_rules! grid_kernel {
    ($kern:ident, $fmt:path, $bytes:path, $dot:ident, $multi:ident, $dot_s:ident, $multi_s:ident) => {
        #[target_feature(enable = "neon")]
        unsafe fn $kern<const N: usize, const SDOT: bool>(
            n: usize,
            w: *const u8,
            x: *const u8,
            xs: usize,
            out: &mut [f32; N],
        ) {
            unsafe { grid_neon::<N, SDOT>($fmt, n, w, x, xs, out) }
        }
        wrap!($dot, $multi, $kern, false, $bytes, Q8_K_BYTES);
        wrap!($dot_s, $multi_s, $kern, true, $bytes, Q8_K_BYTES);
    };
}

grid_kernel!(
    iq2_xxs_kernel,
    iquants::IQ2_XXS,
    iquants::IQ2_XXS_BYTES,
    iq2_xxs_dot,
    iq2_xxs_multi,
    iq2_xxs_dot_sdot,
    iq2_xxs_multi_sdot
);
grid_kernel!(
    iq2_xs_kernel,
    iquants::IQ2_XS,
    iquants::IQ2_XS_BYTES,
    iq2_xs_dot,
    iq2_xs_multi,
    iq2_xs_dot_sdot,
    iq2_xs_multi_sdot
);
grid_kernel!(
    iq2_s_kernel,
    iquants::IQ2_S,
    iquants::IQ2_S_BYTES,
    iq2_s_dot,
    iq2_s_multi,
    iq2_s_dot_sdot,
    iq2_s_multi_sdot
);
grid_kernel!(
    iq3_xxs_kernel,
    iquants::IQ3_XXS,
    iquants::IQ3_XXS_BYTES,
    iq3_xxs_dot,
    iq3_xxs_multi,
    iq3_xxs_dot_sdot,
    iq3_xxs_multi_sdot
);
grid_kernel!(
    iq3_s_kernel,
    iquants::IQ3_S,
    iquants::IQ3_S_BYTES,
    iq3_s_dot,
    iq3_s_multi,
    iq3_s_dot_sdot,
    iq3_s_multi_sdot
);

wrap!(iq1_s_dot, iq1_s_multi, iq1_s_kernel, false, IQ1_S_BYTES, Q8_K_BYTES);
wrap!(
    iq1_s_dot_sdot,
    iq1_s_multi_sdot,
    iq1_s_kernel,
    true,
    IQ1_S_BYTES,
    Q8_K_BYTES
);

fn dot_f32_neon(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    // SAFETY: equal lengths.
    unsafe { f32_dot(a.len(), a.as_ptr(), b.as_ptr()) }
}

// ---------------------------------------------------------------------------------------------------------------
// Helpers.

/// The f16 at `p` (unaligned), widened with `fcvtl` (part of the AArch64 baseline).
#[target_feature(enable = "neon")]
#[inline]
unsafe fn f16(p: *const u8) -> f32 {
    let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
    vgetq_lane_f32::<0>(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(bits))))
}

#[target_feature(enable = "neon")]
#[inline]
unsafe fn load_s8(p: *const u8) -> int8x16_t {
    unsafe { vld1q_s8(p as *const i8) }
}

#[target_feature(enable = "neon")]
#[inline]
unsafe fn load_u8(p: *const u8) -> uint8x16_t {
    unsafe { vld1q_u8(p) }
}

/// `acc` plus the 16 products `a[i]·b[i]`, spread over the four i32 lanes (which lane gets which products differs
/// between the two ways; callers only scale whole vectors and sum the lanes in the end). `SDOT` picks `sdot`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn dot16<const SDOT: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    if SDOT {
        // SAFETY: the caller runs `SDOT` instances only on CPUs with the dot-product extension.
        unsafe { sdot(acc, a, b) }
    } else {
        let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        let hi = vmull_high_s8(a, b);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }
}

/// `sdot acc.4s, a.16b, b.16b`: lane `i` of `acc` plus the four products of bytes `4i..4i+4`. The directive lets
/// the assembler take the instruction in code compiled for baseline AArch64; running it needs [`has_dotprod`].
#[inline(always)]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: register-only arithmetic; the caller checked the CPU has the instruction.
    unsafe {
        asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    acc
}

/// The 32 bytes at `p` dotted with the 32 signed bytes `(lo, hi)`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn dot32<const SDOT: bool>(lo: int8x16_t, hi: int8x16_t, p: *const u8) -> int32x4_t {
    unsafe {
        let s = dot16::<SDOT>(vdupq_n_s32(0), lo, load_s8(p));
        dot16::<SDOT>(s, hi, load_s8(p.add(16)))
    }
}

/// 16 bits to 16 bytes: byte `i` is 0xff where bit `i` of `bits` is set.
#[target_feature(enable = "neon")]
#[inline]
fn bytes_from_bits(bits: u16) -> uint8x16_t {
    const SEL: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    // SAFETY: reads of two 16-byte constants.
    let (sel, bit) = unsafe { (vld1q_u8(SEL.as_ptr()), vld1q_u8(BIT.as_ptr())) };
    // Bytes 0..8 get the low byte of `bits`, bytes 8..16 the high one; then each tests its own bit.
    let b = vqtbl1q_u8(vreinterpretq_u8_u16(vdupq_n_u16(bits)), sel);
    vtstq_u8(b, bit)
}

#[target_feature(enable = "neon")]
unsafe fn f32_dot(n: usize, a: *const f32, b: *const f32) -> f32 {
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, s) in acc.iter_mut().enumerate() {
                *s = vfmaq_f32(*s, vld1q_f32(a.add(i + 4 * k)), vld1q_f32(b.add(i + 4 * k)));
            }
            i += 16;
        }
        while i + 4 <= n {
            acc[0] = vfmaq_f32(acc[0], vld1q_f32(a.add(i)), vld1q_f32(b.add(i)));
            i += 4;
        }
        let mut s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
        while i < n {
            s += *a.add(i) * *b.add(i);
            i += 1;
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Activation quantizers: the bytes of the scalar ones. `vcvtnq_s32_f32` rounds half to even, as
// `f32::round_ties_even`, and the products are the same single f32 multiplications.

fn quant_q8_0_neon(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(32) && out.len() == x.len() / 32 * Q8_0_BYTES,
        "Q8_0 row lengths"
    );
    for (v, b) in x.chunks_exact(32).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        // SAFETY: 32 floats in, 34 bytes out.
        unsafe { q8_block(v.as_ptr(), b.as_mut_ptr(), false) };
    }
}

fn quant_q8_1_neon(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(32) && out.len() == x.len() / 32 * Q8_1_BYTES,
        "Q8_1 row lengths"
    );
    for (v, b) in x.chunks_exact(32).zip(out.chunks_exact_mut(Q8_1_BYTES)) {
        // SAFETY: 32 floats in, 36 bytes out.
        unsafe { q8_block(v.as_ptr(), b.as_mut_ptr(), true) };
    }
}

/// Largest magnitude of the `4 * k` floats at `x` (`fmaxnm`: as `f32::max`, a NaN loses).
#[target_feature(enable = "neon")]
#[inline]
unsafe fn amax(x: *const f32, k: usize) -> f32 {
    unsafe {
        let mut m = vdupq_n_f32(0.0);
        for i in 0..k {
            m = vmaxnmq_f32(m, vabsq_f32(vld1q_f32(x.add(4 * i))));
        }
        vmaxnmvq_f32(m)
    }
}

/// Sixteen i32 to sixteen bytes, in order, saturating (the values are in -128..=127 already).
#[target_feature(enable = "neon")]
#[inline]
fn narrow16(q: [int32x4_t; 4]) -> int8x16_t {
    let a = vcombine_s16(vqmovn_s32(q[0]), vqmovn_s32(q[1]));
    let b = vcombine_s16(vqmovn_s32(q[2]), vqmovn_s32(q[3]));
    vcombine_s8(vqmovn_s16(a), vqmovn_s16(b))
}

#[target_feature(enable = "neon")]
unsafe fn q8_block(x: *const f32, out: *mut u8, with_sum: bool) {
    unsafe {
        let a = amax(x, 8);
        let d = a / 127.0;
        let id = if a != 0.0 { 127.0 / a } else { 0.0 };
        let mut q = [vdupq_n_s32(0); 8];
        for k in 0..8 {
            q[k] = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x.add(4 * k)), id));
        }
        let off = if with_sum { 4 } else { 2 };
        vst1q_s8(out.add(off) as *mut i8, narrow16([q[0], q[1], q[2], q[3]]));
        vst1q_s8(out.add(off + 16) as *mut i8, narrow16([q[4], q[5], q[6], q[7]]));
        std::ptr::copy_nonoverlapping(super::blocks32::f16_bytes(d).as_ptr(), out, 2);
        if with_sum {
            let mut s = vdupq_n_s32(0);
            for v in q {
                s = vaddq_s32(s, v);
            }
            let s = vaddvq_s32(s);
            std::ptr::copy_nonoverlapping(super::blocks32::f16_bytes(s as f32 * d).as_ptr(), out.add(2), 2);
        }
    }
}

fn quant_q8_k_neon(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(256) && out.len() == x.len() / 256 * Q8_K_BYTES,
        "Q8_K row lengths"
    );
    for (v, b) in x.chunks_exact(256).zip(out.chunks_exact_mut(Q8_K_BYTES)) {
        // SAFETY: 256 floats in (`v` is that long), 292 bytes out.
        unsafe { q8k_block(v, b) };
    }
}

#[target_feature(enable = "neon")]
unsafe fn q8k_block(v: &[f32], b: &mut [u8]) {
    unsafe {
        let x = v.as_ptr();
        let amax = amax(x, 64);
        if amax == 0.0 {
            b.fill(0);
            return;
        }
        // The first value of that magnitude, sign kept (as the scalar quantizer picks it).
        let max = v.iter().copied().find(|a| a.abs() == amax).unwrap_or(amax);
        let iscale = -127.0 / max;
        let cap = vdupq_n_s32(127);
        for g in 0..16 {
            let mut q = [vdupq_n_s32(0); 4];
            for k in 0..4 {
                let p = vmulq_n_f32(vld1q_f32(x.add(16 * g + 4 * k)), iscale);
                q[k] = vminq_s32(vcvtnq_s32_f32(p), cap);
            }
            vst1q_s8(b.as_mut_ptr().add(4 + 16 * g) as *mut i8, narrow16(q));
            let s = vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
            b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Dot kernels. `w` points at `n` weight blocks, `x` at the first of `N` activation rows `xs` bytes apart.

#[target_feature(enable = "neon")]
unsafe fn q8_0_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * Q8_0_BYTES);
            let dw = f16(wb);
            let (q0, q1) = (load_s8(wb.add(2)), load_s8(wb.add(18)));
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let s = dot32::<SDOT>(q0, q1, yb.add(2));
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(s), dw * f16(yb));
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]);
        }
    }
}

/// 16 bytes of IQ4 nibbles to their 32 signed levels (weights 0..16 from the low nibbles, 16..32 from the high
/// ones), each one table lookup.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn iq4_levels(q: *const u8) -> (int8x16_t, int8x16_t) {
    unsafe {
        let kv = vld1q_s8(KVALUES_IQ4NL.as_ptr());
        let qs = load_u8(q);
        (
            vqtbl1q_s8(kv, vandq_u8(qs, vdupq_n_u8(0x0f))),
            vqtbl1q_s8(kv, vshrq_n_u8::<4>(qs)),
        )
    }
}

/// A grid i-quant against `N` Q8_K rows: each 32-weight sub-block unpacked once ([`iquants::GridSub`]), its signs
/// put on the activations (negated where set; Q8_K holds no -128), the magnitudes (below 64, so valid signed bytes)
/// dotted with them 16 at a time and scaled per 16 weights.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn grid_neon<const N: usize, const SDOT: bool>(
    f: GridFormat,
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * f.bytes);
            let block = std::slice::from_raw_parts(wb, f.bytes);
            let mut sumi = [vdupq_n_s32(0); N];
            for ib in 0..8 {
                let g = (f.sub)(block, ib);
                let gp = g.grid.as_ptr() as *const u8;
                let mags = [load_s8(gp), load_s8(gp.add(16))];
                let minus = [
                    vreinterpretq_s8_u8(bytes_from_bits(g.signs as u16)),
                    vreinterpretq_s8_u8(bytes_from_bits((g.signs >> 16) as u16)),
                ];
                for t in 0..N {
                    let q8 = x.add(t * xs + b * Q8_K_BYTES + 4 + 32 * ib);
                    for h in 0..2 {
                        let y = load_s8(q8.add(16 * h));
                        let signed = vsubq_s8(veorq_s8(y, minus[h]), minus[h]);
                        let d = dot16::<SDOT>(vdupq_n_s32(0), mags[h], signed);
                        sumi[t] = vmlaq_n_s32(sumi[t], d, g.scales[h]);
                    }
                }
            }
            let dw = f16(wb);
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), dw * yd);
            }
        }
        for t in 0..N {
            out[t] = f.factor * vaddvq_f32(acc[t]);
        }
    }
}

/// IQ1_S against `N` Q8_K rows: per 32-weight sub-block ([`iquants::Iq1Sub`]) the signed byte dot of its -1/0/1
/// values, times its scale; the ±1/8 shift times the activations' sums, which Q8_K carries, on the side.
#[target_feature(enable = "neon")]
unsafe fn iq1_s_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut shift = [0.0f32; N];
        for b in 0..n {
            let wb = w.add(b * IQ1_S_BYTES);
            let block = std::slice::from_raw_parts(wb, IQ1_S_BYTES);
            let mut sumi = [vdupq_n_s32(0); N];
            let mut sumi1 = [0i32; N];
            for ib in 0..8 {
                let g = iquants::iq1_s_sub(block, ib);
                let gp = g.grid.as_ptr() as *const u8;
                let (lo, hi) = (load_s8(gp), load_s8(gp.add(16)));
                for t in 0..N {
                    let yb = x.add(t * xs + b * Q8_K_BYTES);
                    let d = dot32::<SDOT>(lo, hi, yb.add(4 + 32 * ib));
                    sumi[t] = vmlaq_n_s32(sumi[t], d, g.scale);
                    let bs = |i: usize| std::ptr::read_unaligned(yb.add(260 + 2 * i) as *const i16) as i32;
                    sumi1[t] += g.scale * g.delta * (bs(2 * ib) + bs(2 * ib + 1));
                }
            }
            let dw = f16(wb);
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), dw * yd);
                shift[t] += dw * yd * iquants::IQ1S_DELTA * sumi1[t] as f32;
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]) + shift[t];
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn iq4_nl_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * IQ4_NL_BYTES);
            let dw = f16(wb);
            let (lo, hi) = iq4_levels(wb.add(2));
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let s = dot32::<SDOT>(lo, hi, yb.add(2));
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(s), dw * f16(yb));
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]);
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn iq4_xs_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * IQ4_XS_BYTES);
            let dw = f16(wb);
            let block = std::slice::from_raw_parts(wb, IQ4_XS_BYTES);
            let mut sumi = [vdupq_n_s32(0); N];
            for ib in 0..8 {
                let (lo, hi) = iq4_levels(wb.add(8 + 16 * ib));
                let ls = iq4_xs_scale(block, ib) - 32;
                for t in 0..N {
                    let s = dot32::<SDOT>(lo, hi, x.add(t * xs + b * Q8_K_BYTES + 4 + 32 * ib));
                    sumi[t] = vmlaq_n_s32(sumi[t], s, ls);
                }
            }
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), dw * yd);
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]);
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn q4_0_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let (m4, eight) = (vdupq_n_u8(0x0f), vdupq_n_s8(8));
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * Q4_0_BYTES);
            let dw = f16(wb);
            let qs = load_u8(wb.add(2));
            // Weights 0..16 in the low nibbles, 16..32 in the high ones; minus 8.
            let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(qs, m4)), eight);
            let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(qs)), eight);
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let s = dot32::<SDOT>(lo, hi, yb.add(2));
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(s), dw * f16(yb));
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]);
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn q4_1_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let m4 = vdupq_n_u8(0x0f);
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut summ = [0.0f32; N];
        for b in 0..n {
            let wb = w.add(b * Q4_1_BYTES);
            let (dw, mw) = (f16(wb), f16(wb.add(2)));
            let qs = load_u8(wb.add(4));
            let lo = vreinterpretq_s8_u8(vandq_u8(qs, m4));
            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(qs));
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_1_BYTES);
                let s = dot32::<SDOT>(lo, hi, yb.add(4));
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(s), dw * f16(yb));
                // The min times the activations' sum, which Q8_1 carries as `s = d·Σq`.
                summ[t] += mw * f16(yb.add(2));
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]) + summ[t];
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn q5_0_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let (m4, f0) = (vdupq_n_u8(0x0f), vdupq_n_u8(0xf0));
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * Q5_0_BYTES);
            let dw = f16(wb);
            let qh = std::ptr::read_unaligned(wb.add(2) as *const u32);
            let qs = load_u8(wb.add(6));
            // Weight - 16 as a signed byte: the nibble with 0xf0 or'ed in where the fifth bit is clear.
            let hb_lo = vbicq_u8(f0, bytes_from_bits(qh as u16));
            let hb_hi = vbicq_u8(f0, bytes_from_bits((qh >> 16) as u16));
            let lo = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(qs, m4), hb_lo));
            let hi = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(qs), hb_hi));
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_0_BYTES);
                let s = dot32::<SDOT>(lo, hi, yb.add(2));
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(s), dw * f16(yb));
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]);
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn q4_k_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let m4 = vdupq_n_u8(0x0f);
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut summ = [0.0f32; N];
        for b in 0..n {
            let wb = w.add(b * Q4_K_BYTES);
            let (dw, dminw) = (f16(wb), f16(wb.add(2)));
            let packed = std::slice::from_raw_parts(wb.add(4), 12);
            let (mut sc, mut mn) = ([0i32; 8], [0i16; 8]);
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, packed);
                (sc[j], mn[j]) = (s as i32, m as i16);
            }
            let mins = vld1q_s16(mn.as_ptr());
            let mut sumi = [vdupq_n_s32(0); N];
            // 64 weights at a time: 32 bytes, low nibbles then high nibbles, each half with its own scale.
            for j in 0..4 {
                let (b0, b1) = (load_u8(wb.add(16 + 32 * j)), load_u8(wb.add(32 + 32 * j)));
                let (l0, l1) = (vandq_u8(b0, m4), vandq_u8(b1, m4));
                let (h0, h1) = (vshrq_n_u8::<4>(b0), vshrq_n_u8::<4>(b1));
                for t in 0..N {
                    let q8 = x.add(t * xs + b * Q8_K_BYTES + 4 + 64 * j);
                    let pl = dot32::<SDOT>(vreinterpretq_s8_u8(l0), vreinterpretq_s8_u8(l1), q8);
                    let ph = dot32::<SDOT>(vreinterpretq_s8_u8(h0), vreinterpretq_s8_u8(h1), q8.add(32));
                    sumi[t] = vmlaq_n_s32(vmlaq_n_s32(sumi[t], pl, sc[2 * j]), ph, sc[2 * j + 1]);
                }
            }
            for t in 0..N {
                let yb = x.add(t * xs + b * Q8_K_BYTES);
                let yd = std::ptr::read_unaligned(yb as *const f32);
                // Min term: min j times the activations' sum over sub-block j (two of the 16-quant sums).
                let bs = vld1q_s16(yb.add(260) as *const i16);
                let bs2 = vld1q_s16(yb.add(276) as *const i16);
                let pairs = vpaddq_s16(bs, bs2);
                let prod = vmlal_high_s16(vmull_s16(vget_low_s16(mins), vget_low_s16(pairs)), mins, pairs);
                summ[t] -= yd * dminw * vaddvq_s32(prod) as f32;
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), yd * dw);
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]) + summ[t];
        }
    }
}

#[target_feature(enable = "neon")]
unsafe fn q6_k_kernel<const N: usize, const SDOT: bool>(
    n: usize,
    w: *const u8,
    x: *const u8,
    xs: usize,
    out: &mut [f32; N],
) {
    unsafe {
        let (m4, m3, m32) = (vdupq_n_u8(0x0f), vdupq_n_u8(3), vdupq_n_s8(32));
        let mut acc = [vdupq_n_f32(0.0); N];
        for b in 0..n {
            let wb = w.add(b * Q6_K_BYTES);
            let dw = f16(wb.add(208));
            let sc = wb.add(192) as *const i8;
            let mut sumi = [vdupq_n_s32(0); N];
            for half in 0..2 {
                let (ql, qh) = (wb.add(64 * half), wb.add(128 + 32 * half));
                // Quant l of group k (0..4) of this half: four bits from `ql` (byte l or l + 32, low or high
                // nibble), two from `qh` byte l; 16 weights per vector, each 16 with a scale of their own.
                for part in 0..2 {
                    let a = load_u8(ql.add(16 * part));
                    let c = load_u8(ql.add(32 + 16 * part));
                    let h = load_u8(qh.add(16 * part));
                    let q = [
                        vorrq_u8(vandq_u8(a, m4), vshlq_n_u8::<4>(vandq_u8(h, m3))),
                        vorrq_u8(vandq_u8(c, m4), vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(h), m3))),
                        vorrq_u8(vshrq_n_u8::<4>(a), vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(h), m3))),
                        vorrq_u8(vshrq_n_u8::<4>(c), vshlq_n_u8::<4>(vshrq_n_u8::<6>(h))),
                    ];
                    for (k, qk) in q.iter().enumerate() {
                        let qk = vsubq_s8(vreinterpretq_s8_u8(*qk), m32);
                        let g = 8 * half + 2 * k + part;
                        let s = *sc.add(g) as i32;
                        for t in 0..N {
                            let q8 = x.add(t * xs + b * Q8_K_BYTES + 4 + 16 * g);
                            let p = dot16::<SDOT>(vdupq_n_s32(0), qk, load_s8(q8));
                            sumi[t] = vmlaq_n_s32(sumi[t], p, s);
                        }
                    }
                }
            }
            for t in 0..N {
                let yd = std::ptr::read_unaligned(x.add(t * xs + b * Q8_K_BYTES) as *const f32);
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), yd * dw);
            }
        }
        for t in 0..N {
            out[t] = vaddvq_f32(acc[t]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{Rng, random_blocks};
    use super::super::{Kernels, QKernel};
    use super::*;

    /// Every NEON table this CPU runs.
    fn tables() -> Vec<Kernels> {
        let mut v = vec![table_neon()];
        if has_dotprod() {
            v.push(table_neon_dotprod());
        } else {
            eprintln!("no dotprod on this CPU: the sdot kernels are not tested");
        }
        v
    }

    /// `Kernels::detect` takes the dot-product table exactly when the CPU has `sdot`. `BATON_EXPECT_ISA` (set by
    /// `scripts/test-aarch64`) also checks that the emulated CPU is the one asked for.
    #[test]
    fn detect_picks_the_best_neon_table() {
        if std::env::var("BATON_ISA").is_ok() {
            return;
        }
        let want = if has_dotprod() { "neon-dotprod" } else { "neon" };
        assert_eq!(Kernels::detect().isa, want);
        if let Ok(expect) = std::env::var("BATON_EXPECT_ISA") {
            assert_eq!(want, expect, "this CPU's table is not the one the test run expects");
        }
    }

    /// Every NEON kernel against its scalar reference: ragged block counts, 1..=4 tokens, random blocks (any bit
    /// pattern of quants and packed scales).
    #[test]
    fn neon_dots_match_scalar() {
        use GgmlType::*;
        let s = Kernels::scalar();
        let mut rng = Rng(98);
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
                for nb in [1, 2, 3, 7, 20, 33] {
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
                    // The exact slice a single-row dot gets from the matmul.
                    let got = (fast.dot)(nb, &w, &xq[..xrb]);
                    assert!(close(got, want[0]), "{} {ty} nb{nb}: {got} vs {}", k.isa, want[0]);
                    let Some(multi) = fast.multi else { continue };
                    for m in 1..=4 {
                        let mut out = vec![0.0; m];
                        multi(nb, &w, &xq[..(m - 1) * xrb + xrb], xrb, &mut out);
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
        }
    }

    /// Extreme bytes where sums could overflow narrower lanes: every weight and activation at its most negative.
    #[test]
    fn extreme_quants_are_exact() {
        let s = Kernels::scalar();
        for k in tables() {
            // Q8_0 blocks of -128 weights against -127 activations, scales 1.
            let nb = 5;
            let mut w = vec![0x80u8; nb * Q8_0_BYTES];
            let mut x = vec![0x81u8; nb * Q8_0_BYTES];
            for b in 0..nb {
                w[b * Q8_0_BYTES..b * Q8_0_BYTES + 2].copy_from_slice(&[0x00, 0x3c]);
                x[b * Q8_0_BYTES..b * Q8_0_BYTES + 2].copy_from_slice(&[0x00, 0x3c]);
            }
            let want = (s.q8_0.dot)(nb, &w, &x);
            assert_eq!(want, (nb * 32 * 128 * 127) as f32);
            assert_eq!((k.q8_0.dot)(nb, &w, &x), want, "{}", k.isa);
        }
    }

    #[test]
    fn neon_dot_f32_matches_scalar() {
        let s = Kernels::scalar();
        let mut rng = Rng(96);
        for k in tables() {
            for n in [0, 1, 3, 4, 15, 16, 17, 77, 576] {
                let a: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let b: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
                let mag: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
                let (got, want) = ((k.dot_f32)(&a, &b), (s.dot_f32)(&a, &b));
                assert!(
                    (got - want).abs() <= 1e-6 * mag + 1e-7,
                    "{} n{n}: {got} vs {want}",
                    k.isa
                );
            }
        }
    }

    /// The quantizers give the scalar bytes: random rows of several lengths, all-zero blocks, values on rounding
    /// ties, and blocks whose largest magnitude is negative or repeated with both signs.
    #[test]
    fn neon_quantizers_match_scalar() {
        let s = Kernels::scalar();
        let mut rng = Rng(95);
        let mut rows: Vec<Vec<f32>> = [256, 512, 1024, 2304]
            .iter()
            .map(|&n| (0..n).map(|_| rng.normal() * 3.0).collect())
            .collect();
        // Zero blocks next to others; ties (k + 0.5 after scaling by 127/127); a negative extreme; ±extreme.
        let mut special = vec![0.0f32; 256];
        special.extend(
            (0..256)
                .map(|i| (i as f32 - 128.0) + 0.5)
                .map(|v| v.clamp(-127.0, 127.0)),
        );
        special.extend((0..256).map(|i| if i == 9 { -5.0 } else { (i % 7) as f32 * 0.3 }));
        special.extend((0..256).map(|i| match i {
            3 => 2.0,
            40 => -2.0,
            _ => rng.normal() * 0.5,
        }));
        rows.push(special);
        for k in tables() {
            for x in &rows {
                for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
                    let rb = ty.row_bytes(x.len()).unwrap();
                    let (mut a, mut b) = (vec![0xaau8; rb], vec![0x55u8; rb]);
                    (k.quant(ty))(x, &mut a);
                    (s.quant(ty))(x, &mut b);
                    assert_eq!(a, b, "{} {ty} len {}", k.isa, x.len());
                }
            }
        }
    }
}
