//! Element-wise ggml ops (ggml-cpu/ops.cpp, vec.h, vec.cpp) with their exact arithmetic.

#[cfg(target_arch = "x86_64")]
use super::has_avx2_fma;

/// ggml's `ggml_compute_forward_rms_norm_f32` fused with the following `ggml_mul` by the weight: the squares are
/// rounded to f32 and summed in f64 in order, `mean` rounded to f32, `scale = 1.0f / sqrtf(mean + eps)`, then
/// `x * scale * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut sum = 0.0f64;
    for &v in x {
        sum += (v * v) as f64;
    }
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let mut sum = 0.0f64;
    for &v in x.iter() {
        sum += (v * v) as f64;
    }
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// ggml's `rotate_pairs` (ops.cpp) for one head: the pair `(x0, x1)` (adjacent for NORMAL RoPE, `n_rot/2` apart
/// for NEOX) becomes `(x0·cos − x1·sin, x0·sin + x1·cos)`, which GCC compiles with each first product fused into the
/// addition: `fma(x0, cos, −(x1·sin))` and `fma(x0, sin, x1·cos)`. `cos`/`sin` are ggml's rope cache
/// (`ggml_rope_cache_init`: the angle multiplied by `theta_scale` in f32 per pair, glibc `cosf`/`sinf`), which
/// [`crate::kernels::ops::RopeTable`] computes the same way.
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    let (off, stride) = if neox { (half, 1) } else { (1, 2) };
    for i in 0..half {
        let (a, b) = (i * stride, i * stride + off);
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0.mul_add(cos[i], -(x1 * sin[i]));
        x[b] = x0.mul_add(sin[i], x1 * cos[i]);
    }
}

/// ggml's AVX-512 `ggml_v_expf` (vec.h) for one lane: `2^n · p(b)` with `n = round(x·log2 e)` by the 1.5·2^23
/// trick, `b = x − n·ln2` in two FMAs, a degree-5 polynomial in FMAs, `_mm512_scalef_ps`, and 0 or ∞ when
/// `|n| > 192`.
#[inline(always)]
pub fn v_expf(x: f32) -> f32 {
    let c = f32::from_bits;
    let r = c(0x4b40_0000);
    let z = x.mul_add(c(0x3fb8_aa3b), r);
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    let j = j.mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    // scalef: j · 2^n rounded once (n is an integer in [-192, 192], exact in f64).
    (j as f64 * 2f64.powi(n as i32)) as f32
}

/// ggml's AVX-512 `ggml_v_silu`: `x / (1 + v_expf(0 − x))`.
#[inline(always)]
pub fn v_silu(x: f32) -> f32 {
    x / (1.0 + v_expf(0.0 - x))
}

#[inline(always)]
fn swiglu_body(g: &mut [f32], u: &[f32]) {
    let n16 = g.len() / 16 * 16;
    for (a, &b) in g[..n16].iter_mut().zip(&u[..n16]) {
        *a = v_silu(*a) * b;
    }
    // ggml's scalar tail: `ggml_silu_f32(x) * g` with libm `expf`.
    for (a, &b) in g[n16..].iter_mut().zip(&u[n16..]) {
        *a = *a / (1.0 + (-*a).exp()) * b;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn swiglu_fma(g: &mut [f32], u: &[f32]) {
    swiglu_body(g, u)
}

/// ggml's `ggml_vec_swiglu_f32` (AVX-512 build): `g = silu(g) · u`, 16 lanes through [`v_silu`], the tail scalar.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has FMA.
        unsafe { swiglu_fma(g, u) };
        return;
    }
    swiglu_body(g, u)
}

/// ggml's `ggml_gelu_f32` as GCC compiles it: `0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x)))`
/// with `GELU_COEF_A*x*x + 1.0f` contracted into one FMA.
fn gelu_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// ggml's `ggml_table_gelu_f16` (built in `ggml_cpu_init`): GELU of every f16 pattern, rounded to f16.
fn gelu_table() -> &'static [u16] {
    static T: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        (0..=u16::MAX)
            .map(|t| super::f32_to_f16(gelu_f32(super::f16_to_f32(t))))
            .collect()
    })
}

/// ggml's `ggml_vec_geglu_f32` (GGML_GELU_FP16 build): `g = gelu(g) · u` with GELU read from [`gelu_table`] at the
/// input rounded to f16; 0 at or below −10, the identity at or above 10.
pub fn geglu(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    // The fast mode's scalar GeGLU does exactly this lookup; only the table differs.
    crate::kernels::ops::gelu_mul_scalar(g, u, gelu_table());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_expf_is_close_to_exp_and_saturates_like_ggml() {
        let mut x = -100.0f32;
        while x < 88.0 {
            let (got, want) = (v_expf(x) as f64, (x as f64).exp());
            assert!(
                (got - want).abs() <= 4e-7 * want + 1e-44,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.173;
        }
        assert_eq!(v_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(v_expf(-200.0), 0.0);
        assert_eq!(v_expf(200.0), f32::INFINITY);
        assert_eq!(v_expf(0.0), 1.0);
    }

    #[test]
    fn rms_norm_squares_in_f32() {
        // 16777217 is not an f32; its square rounded in f32 differs from the f64 square.
        let x = [4097.0f32, 1.0];
        let mut o = [0.0f32; 2];
        rms_norm(&x, &[1.0, 1.0], 0.0, &mut o);
        let sum = ((4097.0f32 * 4097.0f32) as f64) + 1.0;
        let scale = 1.0f32 / ((sum / 2.0) as f32).sqrt();
        assert_eq!(o, [4097.0 * scale, scale]);
    }

    #[test]
    fn swiglu_matches_silu() {
        let g0: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.7).collect();
        let u: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut g = g0.clone();
        swiglu(&mut g, &u);
        for i in 0..37 {
            let x = g0[i] as f64;
            let want = x / (1.0 + (-x).exp()) * u[i] as f64;
            assert!((g[i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()), "{i}");
        }
    }
}
