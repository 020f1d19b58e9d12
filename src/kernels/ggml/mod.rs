//! llama.cpp's CPU arithmetic, reproduced operation for operation: the `ggml` numerics mode.
//!
//! Why this exists: Baton's own kernels (the `fast` mode) compute the same quantities as llama.cpp but round and sum
//! in other orders. These small quantized models amplify such 1-ulp differences (activations are re-quantized to 8
//! bits before every matmul, so one flipped rounding moves a whole block), which caps top-1 agreement with llama.cpp
//! at ~96 %. This module mirrors, function for function, what ggml-cpu (as vendored by `llama-cpp-sys-2` 0.1.161)
//! executes on an x86-64 CPU with AVX2/AVX-512 at batch sizes of a prompt: the activation quantizers of its x86 code,
//! the lane order of its `vec_dot`/tinyBLAS kernels, `rms_norm` with a sum of f32 squares in f64, RoPE from its
//! angle cache, the tiled flash attention over an f16 KV cache, and SwiGLU through its vector `expf`. Each function
//! names the ggml function it reproduces. It is slower than the fast kernels and tied to that ggml version; it
//! exists to check Baton against llama.cpp bit for bit, and is chosen per session ([`Numerics`]).

pub mod attention;
pub mod dot;
pub mod kquant;
pub mod matmul;
pub mod ops;
pub mod quant;

/// Which arithmetic a session uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Numerics {
    /// Baton's own kernels (fastest; results within rounding noise of llama.cpp).
    #[default]
    Fast,
    /// llama.cpp's CPU arithmetic reproduced (this module).
    Ggml,
}

impl Numerics {
    /// `BATON_NUMERICS=ggml|fast` (default `fast`).
    pub fn from_env() -> Numerics {
        match std::env::var("BATON_NUMERICS").as_deref() {
            Ok("ggml") => Numerics::Ggml,
            _ => Numerics::Fast,
        }
    }

    pub fn parse(s: &str) -> Option<Numerics> {
        match s {
            "fast" => Some(Numerics::Fast),
            "ggml" => Some(Numerics::Ggml),
            _ => None,
        }
    }
}

/// `GGML_CPU_FP16_TO_FP32`.
#[inline]
pub fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// `GGML_CPU_FP32_TO_FP16` (F16C, round to nearest even).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Every f16 bit pattern widened to f32 (256 KiB, built on first use): the kernels' scale lookups.
pub fn f16_table() -> &'static [f32] {
    static T: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    T.get_or_init(|| (0..=u16::MAX).map(f16_to_f32).collect())
}

/// ggml's `hsum_float_8` (and tinyBLAS's `hsum` of an `__m256`): the upper half added to the lower, then pairs.
#[inline]
pub fn hsum8(a: &[f32; 8]) -> f32 {
    let r = [a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// GCC's `_mm512_reduce_add_ps`: halves added down to 128 bits, then `(t0 + t2) + (t1 + t3)`.
#[inline]
pub fn reduce_add16(a: &[f32; 16]) -> f32 {
    let mut h = [0.0f32; 8];
    for i in 0..8 {
        h[i] = a[i + 8] + a[i];
    }
    let q = [h[4] + h[0], h[5] + h[1], h[6] + h[2], h[7] + h[3]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// Whether this CPU runs the AVX2+FMA(+F16C) versions of the kernels here (else the scalar ones, same bits, slower).
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static H: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *H.get_or_init(|| {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hsums_follow_the_simd_trees() {
        // Values whose sum depends on the order: the trees must give their own, not the sequential, result.
        let a = [1e8f32, 1.0, -1e8, 1.0, 3.0, 0.5, 0.25, 7.0];
        assert_eq!(
            hsum8(&a),
            ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
        );
        let mut b = [0.0f32; 16];
        for (i, v) in b.iter_mut().enumerate() {
            *v = if i % 3 == 0 { 1e7 } else { 0.3 * i as f32 };
        }
        let h: Vec<f32> = (0..8).map(|i| b[i + 8] + b[i]).collect();
        let q: Vec<f32> = (0..4).map(|i| h[i + 4] + h[i]).collect();
        assert_eq!(reduce_add16(&b), (q[0] + q[2]) + (q[1] + q[3]));
    }
}
