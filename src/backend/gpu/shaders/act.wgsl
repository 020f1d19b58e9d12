// The activations of the gated feed-forward, as the CPU kernels compute them (kernels/ops.rs).

// SiLU, x / (1 + e^-x); the exponent is clamped so it stays finite.
fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(min(-x, 88.0)));
}

// GELU with the tanh approximation, as ggml's f16 table gives it: the input rounded to f16, the result too,
// 0 below -10 and the identity above 10 (which also keeps tanh's argument small).
fn gelu(x: f32) -> f32 {
    if (x <= -10.0) {
        return 0.0;
    }
    if (x >= 10.0) {
        return x;
    }
    let h = f16_round(x);
    let t = tanh(0.7978846 * h * (1.0 + 0.044715 * h * h));
    return f16_round(0.5 * h * (1.0 + t));
}

// act(g)·u; kind 0 is SwiGLU, 1 GeGLU.
fn glu(kind: u32, g: f32, u: f32) -> f32 {
    if (kind == 1u) {
        return gelu(g) * u;
    }
    return silu(g) * u;
}
