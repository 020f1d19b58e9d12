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
    for (a, &b) in g.iter_mut().zip(u) {
        let v = *a;
        *a = v / (1.0 + (-v).exp()) * b;
    }
}

/// GeGLU with the tanh approximation of GELU: `g = gelu(g) * u`.
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    for (a, &b) in g.iter_mut().zip(u) {
        let x = *a;
        let gelu = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh());
        *a = gelu * b;
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

/// Cosines and sines of RoPE angles for positions `0..n_ctx`, one table per frequency base.
pub struct RopeTable {
    pub base: f32,
    /// `n_rot / 2` pairs per position.
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(base: f32, n_rot: usize, n_ctx: usize) -> RopeTable {
        let half = n_rot / 2;
        let mut cos = vec![0.0; n_ctx * half];
        let mut sin = vec![0.0; n_ctx * half];
        // As ggml: theta_i = p · base^(-2i/n_rot), the power taken by repeated multiplication in f32.
        let theta_scale = base.powf(-2.0 / n_rot as f32);
        for p in 0..n_ctx {
            let mut theta = p as f32;
            for i in 0..half {
                cos[p * half + i] = theta.cos();
                sin[p * half + i] = theta.sin();
                theta *= theta_scale;
            }
        }
        RopeTable { base, half, cos, sin }
    }

    pub fn n_ctx(&self) -> usize {
        self.cos.len() / self.half.max(1)
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
        assert!((g[0] - 0.841192).abs() < 1e-5 && (g[1] + 0.158808).abs() < 1e-5 && g[2] == 0.0);
        let mut s = [1.0f32, 2.0];
        silu_mul(&mut s, &[1.0, 0.5]);
        assert!((s[0] - 0.731059).abs() < 1e-5 && (s[1] - 0.880797).abs() < 1e-5);
    }

    #[test]
    fn argmax_and_lse() {
        assert_eq!(argmax(&[1.0, 5.0, 5.0, 2.0]), 1);
        let l = log_sum_exp(&[0.0, 0.0]);
        assert!((l - 2f64.ln()).abs() < 1e-9);
    }
}
