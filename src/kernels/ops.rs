//! Element-wise ops and small reductions. These are a small share of the time next to matmul; they are written so
//! the compiler vectorises them, and computed the way ggml computes them (sums of squares in f64, RoPE angles by
//! repeated multiplication) so results track llama.cpp closely.

/// `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place [`rms_norm`].
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

pub fn scale_inplace(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// SwiGLU: `g = silu(g) * u`.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    #[cfg(target_arch = "x86_64")]
    if super::kernels().isa == "avx512" {
        // SAFETY: the kernel table picked AVX-512 only where the CPU has AVX-512F; the lengths are equal.
        unsafe { x86::silu_mul(g, u) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::kernels().isa == "avx2" {
        // SAFETY: the kernel table picked AVX2 only where the CPU has AVX2, FMA and F16C.
        unsafe { x86::silu_mul_avx2(g, u) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if super::kernels().isa != "scalar" {
        neon::silu_mul(g, u);
        return;
    }
    silu_mul_scalar(g, u);
}

/// The portable reference of [`silu_mul`].
pub fn silu_mul_scalar(g: &mut [f32], u: &[f32]) {
    for (a, &b) in g.iter_mut().zip(u) {
        let v = *a;
        *a = v / (1.0 + (-v).exp()) * b;
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044715;

/// GeGLU with the tanh approximation of GELU: `g = gelu(g) * u`, computed as ggml computes it: GELU is read from
/// a table over every f16 input (the input rounded to f16, the value stored as f16), 0 below -10 and the identity
/// above 10. That costs at most an f16 rounding (5e-4 relative) next to the 8-bit quantization the result goes
/// through before the down projection, and it follows llama.cpp's numbers rather than adding its own rounding;
/// being a lookup, it also gives the same bits on every CPU.
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    let table = gelu_table();
    #[cfg(target_arch = "x86_64")]
    if super::kernels().isa == "avx512" {
        // SAFETY: as in `silu_mul`; the table has an entry past the last f16 pattern for the 32-bit gathers.
        unsafe { x86::gelu_mul(g, u, table) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::kernels().isa == "avx2" {
        // SAFETY: as above, for AVX2/FMA/F16C.
        unsafe { x86::gelu_mul_avx2(g, u, table) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if super::kernels().isa != "scalar" {
        neon::gelu_mul(g, u, table);
        return;
    }
    gelu_mul_scalar(g, u, table);
}

/// The portable reference of [`gelu_mul`].
pub fn gelu_mul_scalar(g: &mut [f32], u: &[f32], table: &[u16]) {
    for (a, &b) in g.iter_mut().zip(u) {
        let x = *a;
        *a = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * b
        } else {
            half::f16::from_bits(table[half::f16::from_f32(x).to_bits() as usize]).to_f32() * b
        };
    }
}

/// GELU-tanh in f32, ggml's `ggml_gelu_f32`.
fn gelu_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// GELU of every f16 bit pattern, as f16 bits, plus one zero entry so a 32-bit gather at the last index stays
/// inside (128 KiB, built on first use).
pub fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|t| half::f16::from_f32(gelu_f32(half::f16::from_bits(t).to_f32())).to_bits())
            .chain([0])
            .collect()
    })
}

/// 16-lane math for the element-wise ops and attention.
///
/// Why by hand: GELU and SiLU called `tanhf`/`expf` once per feed-forward value, which the compiler cannot
/// vectorise; Gemma 3's prefill ran at 590 tokens/s with them and at 900 with 16-lane versions.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// e^x for 16 lanes: x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in two for precision), e^r by the degree-6
    /// polynomial of Cephes `expf`, then scaled by 2^n; within 2 ulp. Inputs are clamped to [-87.3, 88]: below,
    /// the result flushes to 0; above, it stays finite (1.65e38), so `1 + e^x` never becomes infinite.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub fn exp16(x: __m512) -> __m512 {
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3)), _mm512_set1_ps(88.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        _mm512_scalef_ps(y, n)
    }

    /// `g = silu(g) * u` as `x / (1 + e^-x)`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, and `u` must be as long as `g`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
        let n = g.len();
        let (gp, up) = (g.as_mut_ptr(), u.as_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: the mask keeps every access below n.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, gp.add(i));
                let y = _mm512_maskz_loadu_ps(m, up.add(i));
                let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let act = _mm512_div_ps(x, _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(gp.add(i), m, _mm512_mul_ps(act, y));
            }
            i += 16;
        }
    }

    /// [`super::gelu_mul_scalar`], 16 values at a time: round to f16, gather from the table, back to f32.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, `u` must be as long as `g`, and `table` hold 65537 entries.
    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn gelu_mul(g: &mut [f32], u: &[f32], table: &[u16]) {
        assert!(table.len() > u16::MAX as usize + 1);
        let n = g.len();
        let (gp, up, tp) = (g.as_mut_ptr(), u.as_ptr(), table.as_ptr() as *const u8);
        let lo = _mm512_set1_ps(-10.0);
        let hi = _mm512_set1_ps(10.0);
        let mut i = 0;
        while i < n {
            let m = mask(n - i);
            // SAFETY: the mask keeps every access below n; gather indices are f16 patterns, < 65536, and the
            // table has one entry more, so each 4-byte read at `2 * index` stays inside.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, gp.add(i));
                let y = _mm512_maskz_loadu_ps(m, up.add(i));
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
                let idx = _mm512_cvtepu16_epi32(h);
                let t = _mm512_i32gather_epi32::<2>(idx, tp as _);
                let act = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t));
                // x >= 10: the identity; x <= -10: zero.
                let act = _mm512_mask_mov_ps(act, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, hi), x);
                let r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, lo), _mm512_mul_ps(act, y));
                _mm512_mask_storeu_ps(gp.add(i), m, r);
            }
            i += 16;
        }
    }

    /// e^x for 8 lanes (AVX2+FMA): [`exp16`]'s reduction and polynomial, with 2^n built in the exponent bits (AVX2
    /// has no `scalef`). The clamp keeps n in -126..=127, so 2^n is a normal float; within 2 ulp.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2))
    }

    /// Runs `f` over `g` and `u` eight values at a time; a ragged tail goes through a zero-padded copy, so every
    /// value is computed the same way whatever the slicing.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn by8(g: &mut [f32], u: &[f32], f: impl Fn(__m256, __m256) -> __m256) {
        assert_eq!(g.len(), u.len());
        let mut gc = g.chunks_exact_mut(8);
        let mut uc = u.chunks_exact(8);
        for (a, b) in (&mut gc).zip(&mut uc) {
            // SAFETY: eight floats in each chunk.
            unsafe {
                _mm256_storeu_ps(
                    a.as_mut_ptr(),
                    f(_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr())),
                )
            };
        }
        let (gt, ut) = (gc.into_remainder(), uc.remainder());
        if !gt.is_empty() {
            let (mut a, mut b) = ([0.0f32; 8], [0.0f32; 8]);
            a[..gt.len()].copy_from_slice(gt);
            b[..ut.len()].copy_from_slice(ut);
            // SAFETY: eight-float arrays.
            unsafe {
                _mm256_storeu_ps(
                    a.as_mut_ptr(),
                    f(_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr())),
                )
            };
            gt.copy_from_slice(&a[..gt.len()]);
        }
    }

    /// [`silu_mul`] in 8 lanes.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul_avx2(g: &mut [f32], u: &[f32]) {
        by8(g, u, |x, y| {
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e)), y)
        });
    }

    /// [`gelu_mul`] in 8 lanes: round to f16, gather from the table, back to f32.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C, and `table` hold 65537 entries.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gelu_mul_avx2(g: &mut [f32], u: &[f32], table: &[u16]) {
        assert!(table.len() > u16::MAX as usize + 1);
        let tp = table.as_ptr() as *const i32;
        by8(g, u, |x, y| {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
            let idx = _mm256_cvtepu16_epi32(h);
            // SAFETY: indices are f16 patterns (< 65536) and the table has one entry more, so each 4-byte read at
            // byte `2 * index` stays inside.
            let t = unsafe { _mm256_i32gather_epi32::<2>(tp, idx) };
            // The low 16 bits of each lane are the entry: pack them to 8 u16 and widen.
            let t = _mm256_and_si256(t, _mm256_set1_epi32(0xffff));
            let packed = _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let act = _mm256_cvtph_ps(packed);
            // x >= 10: the identity; x <= -10: zero.
            let act = _mm256_blendv_ps(act, x, _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(10.0)));
            let keep = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(-10.0));
            _mm256_and_ps(keep, _mm256_mul_ps(act, y))
        });
    }

    /// The lanes of a 16-lane step that lie below `left` remaining values.
    #[inline]
    fn mask(left: usize) -> __mmask16 {
        if left >= 16 {
            0xffff
        } else {
            ((1u32 << left) - 1) as u16
        }
    }
}

/// 4-lane NEON versions of the element-wise math (AArch64), for the same reason as the x86 ones: `expf` per value
/// does not vectorise.
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon {
    use std::arch::aarch64::*;

    /// e^x for 4 lanes, the same reduction and polynomial as the x86 `exp16` (within 2 ulp): x = n·ln2 + r,
    /// e^r by Cephes' degree-6 polynomial, times 2^n built in the exponent bits. Inputs are clamped to [-87.3, 88],
    /// so n stays in -126..=127 and 2^n is a normal float.
    #[target_feature(enable = "neon")]
    #[inline]
    pub fn exp4(x: float32x4_t) -> float32x4_t {
        let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3)), vdupq_n_f32(88.0));
        let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(std::f32::consts::LOG2_E)));
        let r = vfmsq_f32(x, n, vdupq_n_f32(0.693_359_4));
        let r = vfmsq_f32(r, n, vdupq_n_f32(-2.121_944_4e-4));
        let mut p = vdupq_n_f32(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = vfmaq_f32(vdupq_n_f32(c), p, r);
        }
        let y = vaddq_f32(vfmaq_f32(r, p, vmulq_f32(r, r)), vdupq_n_f32(1.0));
        let pow2 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127))));
        vmulq_f32(y, pow2)
    }

    /// Runs `f` over `g` and `u` four values at a time; a ragged tail goes through a zero-padded copy, so every
    /// value is computed the same way.
    #[inline(always)]
    fn by4(g: &mut [f32], u: &[f32], f: impl Fn(float32x4_t, float32x4_t) -> float32x4_t) {
        assert_eq!(g.len(), u.len());
        let mut gc = g.chunks_exact_mut(4);
        let mut uc = u.chunks_exact(4);
        for (a, b) in (&mut gc).zip(&mut uc) {
            // SAFETY: four floats in each chunk.
            unsafe { vst1q_f32(a.as_mut_ptr(), f(vld1q_f32(a.as_ptr()), vld1q_f32(b.as_ptr()))) };
        }
        let (gt, ut) = (gc.into_remainder(), uc.remainder());
        if !gt.is_empty() {
            let (mut a, mut b) = ([0.0f32; 4], [0.0f32; 4]);
            a[..gt.len()].copy_from_slice(gt);
            b[..ut.len()].copy_from_slice(ut);
            // SAFETY: four-float arrays.
            unsafe { vst1q_f32(a.as_mut_ptr(), f(vld1q_f32(a.as_ptr()), vld1q_f32(b.as_ptr()))) };
            gt.copy_from_slice(&a[..gt.len()]);
        }
    }

    /// `g = silu(g) * u` as `x / (1 + e^-x)`.
    pub fn silu_mul(g: &mut [f32], u: &[f32]) {
        by4(g, u, |x, y| {
            // SAFETY: NEON is part of the AArch64 baseline.
            unsafe {
                let e = exp4(vnegq_f32(x));
                vmulq_f32(vdivq_f32(x, vaddq_f32(vdupq_n_f32(1.0), e)), y)
            }
        });
    }

    /// [`super::gelu_mul_scalar`], converting to and from f16 four values at a time (the table lookups are
    /// scalar: NEON has no gather). `vcvt_f16_f32` rounds to nearest even, as `half::f16::from_f32`.
    pub fn gelu_mul(g: &mut [f32], u: &[f32], table: &[u16]) {
        assert!(table.len() > u16::MAX as usize);
        by4(g, u, |x, y| {
            // SAFETY: NEON is baseline; the indices are f16 patterns, all inside the table.
            unsafe {
                let mut idx = [0u16; 4];
                vst1_u16(idx.as_mut_ptr(), vreinterpret_u16_f16(vcvt_f16_f32(x)));
                let bits = idx.map(|i| *table.get_unchecked(i as usize));
                let act = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(bits.as_ptr())));
                // x >= 10: the identity; x <= -10: zero.
                let act = vbslq_f32(vcgeq_f32(x, vdupq_n_f32(10.0)), x, act);
                let keep = vcgtq_f32(x, vdupq_n_f32(-10.0));
                vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(vmulq_f32(act, y))))
            }
        });
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// `log Σ exp(x)`, stable.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = x.iter().map(|&v| ((v - max) as f64).exp()).sum();
    max as f64 + sum.ln()
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums let the compiler use full vector registers.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// How a [`RopeTable`]'s angles are scaled (the model's `rope.scaling.*`, resolved for one base).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scaled {
    /// Angles are multiplied by this (1 / the scaling factor).
    pub freq_scale: f32,
    /// YaRN's first and last ramp pair (ggml's corr_dims): pairs below the first keep the unscaled angle, pairs past
    /// the last the scaled one, those between mix them linearly. `None`: every pair is scaled.
    pub yarn_ramp: Option<[f32; 2]>,
    /// Factor on every cosine and sine.
    pub mscale: f32,
}

impl Scaled {
    pub const NONE: Scaled = Scaled {
        freq_scale: 1.0,
        yarn_ramp: None,
        mscale: 1.0,
    };
}

/// Cosines and sines of RoPE angles for positions `0..n_ctx`, for one frequency base and scaling.
pub struct RopeTable {
    /// `n_rot / 2` pairs per position.
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(base: f32, n_rot: usize, n_ctx: usize) -> RopeTable {
        Self::scaled(base, n_rot, n_ctx, &Scaled::NONE, None)
    }

    /// The table with scaled angles ([`Scaled`]) and per-pair frequency factors (Llama 3's `rope_freqs.weight`,
    /// `n_rot / 2` of them), computed as ggml's `ggml_rope_cache_init` and `rope_yarn` do: pair i's unscaled angle is
    /// `θ_i / factor_i`, its scaled one `freq_scale` times that, and under YaRN the two are mixed by the ramp; the
    /// cosine and sine are multiplied by `mscale`. Without scaling or factors the angles are bit for bit the plain
    /// ones.
    pub fn scaled(base: f32, n_rot: usize, n_ctx: usize, sc: &Scaled, factors: Option<&[f32]>) -> RopeTable {
        let half = n_rot / 2;
        if let Some(f) = factors {
            assert_eq!(f.len(), half, "one frequency factor per rotated pair");
        }
        // YaRN's share of the unscaled angle, per pair (ggml's rope_yarn_ramp, extrapolation factor 1); 0 without
        // YaRN, where the mix below is the scaled angle exactly.
        let mix: Vec<f32> = (0..half)
            .map(|i| match sc.yarn_ramp {
                None => 0.0,
                Some([low, high]) => 1.0 - ((i as f32 - low) / (high - low).max(0.001)).clamp(0.0, 1.0),
            })
            .collect();
        let mut cos = vec![0.0; n_ctx * half];
        let mut sin = vec![0.0; n_ctx * half];
        // As ggml: theta_i = p · base^(-2i/n_rot), the power taken by repeated multiplication in f32.
        let theta_scale = base.powf(-2.0 / n_rot as f32);
        for p in 0..n_ctx {
            let mut theta = p as f32;
            for i in 0..half {
                let ff = factors.map_or(1.0, |f| f[i]);
                let extrap = theta / ff;
                let angle = sc.freq_scale * extrap * (1.0 - mix[i]) + extrap * mix[i];
                cos[p * half + i] = angle.cos() * sc.mscale;
                sin[p * half + i] = angle.sin() * sc.mscale;
                theta *= theta_scale;
            }
        }
        RopeTable { half, cos, sin }
    }

    pub fn n_ctx(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// The cosines and sines of position `pos`, one per rotated pair.
    pub fn cos_sin(&self, pos: usize) -> (&[f32], &[f32]) {
        (
            &self.cos[pos * self.half..(pos + 1) * self.half],
            &self.sin[pos * self.half..(pos + 1) * self.half],
        )
    }

    /// Rotates one head of `x` (length ≥ n_rot) at position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize, neox: bool) {
        let c = &self.cos[pos * self.half..(pos + 1) * self.half];
        let s = &self.sin[pos * self.half..(pos + 1) * self.half];
        if neox {
            let (lo, hi) = x[..2 * self.half].split_at_mut(self.half);
            for i in 0..self.half {
                let (x0, x1) = (lo[i], hi[i]);
                lo[i] = x0 * c[i] - x1 * s[i];
                hi[i] = x0 * s[i] + x1 * c[i];
            }
        } else {
            for i in 0..self.half {
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x0 * c[i] - x1 * s[i];
                x[2 * i + 1] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 1.0];
        let w = [1.0f32; 4];
        let mut o = [0.0; 4];
        rms_norm(&x, &w, 0.0, &mut o);
        let ms: f32 = o.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-5);
    }

    #[test]
    fn rope_preserves_norm_and_position_zero_is_identity() {
        let t = RopeTable::new(10000.0, 8, 16);
        let x0: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        for neox in [false, true] {
            let mut x = x0.clone();
            t.apply(&mut x, 0, neox);
            assert_eq!(x, x0);
            t.apply(&mut x, 7, neox);
            let n0: f32 = x0.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
            assert_ne!(x, x0);
        }
    }

    /// Frequency factors of 1 and a scale of 1 give the plain table bit for bit; a factor f on a pair, or a linear
    /// scale 1/f, turns position p into position p/f for that pair.
    #[test]
    fn rope_scaling_divides_angles() {
        let plain = RopeTable::new(10000.0, 8, 64);
        assert_eq!(
            RopeTable::scaled(10000.0, 8, 64, &Scaled::NONE, Some(&[1.0; 4])).cos,
            plain.cos
        );
        let f = [1.0, 2.0, 4.0, 8.0];
        let t = RopeTable::scaled(10000.0, 8, 64, &Scaled::NONE, Some(&f));
        let quarter = Scaled {
            freq_scale: 0.25,
            ..Scaled::NONE
        };
        let lin = RopeTable::scaled(10000.0, 8, 64, &quarter, None);
        for i in 0..4 {
            let p = 32;
            let (c, s) = t.cos_sin(p);
            let (c0, s0) = plain.cos_sin(p / f[i] as usize);
            assert!((c[i] - c0[i]).abs() < 1e-5 && (s[i] - s0[i]).abs() < 1e-5, "pair {i}");
            let (c, _) = lin.cos_sin(p);
            assert!((c[i] - plain.cos_sin(p / 4).0[i]).abs() < 1e-5, "linear, pair {i}");
        }
    }

    #[test]
    fn rope_rotation_is_relative() {
        // <R(p)q, R(p+d)k> depends only on d.
        let t = RopeTable::new(10000.0, 4, 64);
        let q = [0.3f32, -1.0, 0.7, 0.2];
        let k = [1.1f32, 0.4, -0.5, 0.9];
        let score = |p: usize, d: usize| {
            let (mut a, mut b) = (q, k);
            t.apply(&mut a, p, true);
            t.apply(&mut b, p + d, true);
            dot(&a, &b)
        };
        assert!((score(3, 5) - score(20, 5)).abs() < 1e-4);
    }

    #[test]
    fn gelu_and_silu_known_values() {
        let mut g = [1.0f32, -1.0, 0.0];
        gelu_mul(&mut g, &[1.0, 1.0, 1.0]);
        // GELU through its f16 table: within f16 rounding.
        assert!((g[0] - 0.841192).abs() < 1e-3 && (g[1] + 0.158808).abs() < 2e-4 && g[2] == 0.0);
        let mut s = [1.0f32, 2.0];
        silu_mul(&mut s, &[1.0, 0.5]);
        assert!((s[0] - 0.731059).abs() < 1e-5 && (s[1] - 0.880797).abs() < 1e-5);
    }

    /// Random activations, mostly small, some beyond GELU's ±10 cut-offs.
    fn activations(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = crate::kernels::testutil::Rng(seed);
        let x = (0..n)
            .map(|i| (if i % 7 == 0 { 40.0 } else { 8.0 }) * (rng.uniform() - 0.5))
            .collect();
        let y = (0..n).map(|_| 2.0 * rng.uniform() - 1.0).collect();
        (x, y)
    }

    #[test]
    fn dispatched_silu_is_within_a_few_ulp_on_ragged_lengths() {
        for n in [1usize, 15, 16, 17, 100, 2048 + 5] {
            let (x, y) = activations(n, n as u64);
            let (mut fast, mut slow) = (x.clone(), x.clone());
            silu_mul(&mut fast, &y);
            silu_mul_scalar(&mut slow, &y);
            for i in 0..n {
                let xi = x[i] as f64;
                let want = xi / (1.0 + (-xi).exp()) * y[i] as f64;
                for (what, got) in [("dispatched", fast[i]), ("scalar", slow[i])] {
                    assert!(
                        (got as f64 - want).abs() <= 5e-7 * want.abs() + 1e-30,
                        "{what} silu of {} (n={n}): {got} vs {want}",
                        x[i]
                    );
                }
            }
        }
    }

    #[test]
    fn dispatched_gelu_is_the_table_bit_for_bit_and_the_table_is_gelu() {
        let table = gelu_table();
        for n in [1usize, 15, 16, 17, 100, 2048 + 5] {
            let (x, y) = activations(n, 100 + n as u64);
            let (mut fast, mut slow) = (x.clone(), x.clone());
            gelu_mul(&mut fast, &y);
            gelu_mul_scalar(&mut slow, &y, table);
            assert_eq!(
                fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "n={n}"
            );
            for i in 0..n {
                let xi = x[i] as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                let want = 0.5 * xi * (1.0 + (c * xi * (1.0 + 0.044715 * xi * xi)).tanh()) * y[i] as f64;
                // The input and the value each rounded to f16, and nothing past the ±10 cut-offs.
                let tol = 2e-3 * want.abs() + 1e-3 * (y[i] as f64).abs() * xi.abs().min(1.0) + 1e-6;
                assert!(
                    (slow[i] as f64 - want).abs() <= tol,
                    "gelu of {} (n={n}): {} vs {want}",
                    x[i],
                    slow[i]
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp16_is_within_two_ulp() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("no AVX-512F here: exp16 not tested");
            return;
        }
        use std::arch::x86_64::*;
        assert_exp_within_two_ulp(16, |xs, ys| {
            // SAFETY: AVX-512F checked above; 16 floats each.
            unsafe { _mm512_storeu_ps(ys.as_mut_ptr(), x86::exp16(_mm512_loadu_ps(xs.as_ptr()))) }
        });
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp8_is_within_two_ulp() {
        if !super::super::x86::has_avx2() {
            eprintln!("SKIPPED: no AVX2 here, exp8 not tested");
            return;
        }
        use std::arch::x86_64::*;
        assert_exp_within_two_ulp(8, |xs, ys| {
            // SAFETY: AVX2/FMA checked above; 8 floats each.
            unsafe { _mm256_storeu_ps(ys.as_mut_ptr(), x86::exp8(_mm256_loadu_ps(xs.as_ptr()))) }
        });
    }

    /// The AVX2 SiLU and GELU against the scalar references, whatever level the dispatch picked on this machine:
    /// SiLU within a few ulp, GELU bit for bit (a table lookup), on ragged lengths.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_silu_and_gelu_match_scalar() {
        if !super::super::x86::has_avx2() {
            eprintln!("SKIPPED: no AVX2 here, the AVX2 activations not tested");
            return;
        }
        let table = gelu_table();
        for n in [1usize, 7, 8, 9, 100, 2048 + 5] {
            let (x, y) = activations(n, 300 + n as u64);
            let (mut fast, mut slow) = (x.clone(), x.clone());
            // SAFETY: AVX2/FMA/F16C checked above; equal lengths; the table's extra entry.
            unsafe { x86::silu_mul_avx2(&mut fast, &y) };
            silu_mul_scalar(&mut slow, &y);
            for i in 0..n {
                let tol = 4.0 * f32::EPSILON * slow[i].abs() + 1e-30;
                assert!(
                    (fast[i] - slow[i]).abs() <= tol,
                    "silu n={n} [{i}]: {} vs {}",
                    fast[i],
                    slow[i]
                );
            }
            let (mut fast, mut slow) = (x.clone(), x.clone());
            unsafe { x86::gelu_mul_avx2(&mut fast, &y, table) };
            gelu_mul_scalar(&mut slow, &y, table);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fast), bits(&slow), "gelu n={n}");
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn exp4_is_within_two_ulp() {
        use std::arch::aarch64::*;
        assert_exp_within_two_ulp(4, |xs, ys| {
            // SAFETY: four floats each.
            unsafe { vst1q_f32(ys.as_mut_ptr(), neon::exp4(vld1q_f32(xs.as_ptr()))) }
        });
    }

    /// A vector `exp` of `lanes` lanes (`exp(xs)` into `ys`) is within 2 ulp of f64's over -87..=88.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn assert_exp_within_two_ulp(lanes: usize, exp: impl Fn(&[f32], &mut [f32])) {
        let mut x = -87.0f32;
        let mut ys = vec![0.0f32; lanes];
        while x <= 88.0 {
            let xs: Vec<f32> = (0..lanes).map(|i| (x + i as f32 * 0.0037).min(88.0)).collect();
            exp(&xs, &mut ys);
            for (&xi, &y) in xs.iter().zip(&ys) {
                let want = (xi as f64).exp();
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(
                    ((y as f64) - want).abs() <= 2.0 * ulp as f64 + 1e-38,
                    "exp({xi}) = {y}, want {want}"
                );
            }
            x += 0.05;
        }
    }

    #[test]
    fn argmax_and_lse() {
        assert_eq!(argmax(&[1.0, 5.0, 5.0, 2.0]), 1);
        let l = log_sum_exp(&[0.0, 0.0]);
        assert!((l - 2f64.ln()).abs() < 1e-9);
    }
}
