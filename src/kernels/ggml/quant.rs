//! Activation quantizers as ggml's x86 code (arch/x86/quants.c, AVX2 branch) computes them.

use super::f32_to_f16;

/// Scale and 32 rounded quants of one block, as `quantize_row_q8_0`/`q8_1` (x86) compute them: the largest
/// magnitude `amax`, `d = amax / 127`, the multiplier `id = 127 / amax` (a division, not `1 / d`), each value times
/// `id` rounded to nearest with ties to even (`_mm256_round_ps(_MM_ROUND_NEAREST)`).
#[inline]
fn block_q8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * id).round_ties_even() as i8;
    }
    d
}

/// ggml's x86 `quantize_row_q8_0`: blocks of 34 bytes (f16 scale, 32 × i8).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
        let mut q = [0i8; 32];
        let d = block_q8(xb, &mut q);
        ob[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        for (o, v) in ob[2..].iter_mut().zip(q) {
            *o = v as u8;
        }
    }
}

/// ggml's x86 `quantize_row_q8_1`: blocks of 36 bytes (f16 scale, f16 `s = d · Σq` rounded from f32, 32 × i8).
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(36)) {
        let mut q = [0i8; 32];
        let d = block_q8(xb, &mut q);
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        ob[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        ob[2..4].copy_from_slice(&f32_to_f16(d * sum as f32).to_le_bytes());
        for (o, v) in ob[4..].iter_mut().zip(q) {
            *o = v as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_rounds_ties_to_even_with_the_divided_multiplier() {
        // amax 127 gives id = 1 exactly: x.5 values round to even.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = 3.5;
        x[3] = -2.5;
        x[4] = -0.5;
        x[5] = 1.4999999;
        let mut out = [0u8; 36];
        quantize_row_q8_1(&x, &mut out);
        let q: Vec<i8> = out[4..10].iter().map(|&b| b as i8).collect();
        assert_eq!(q, [127, 2, 4, -2, 0, 1]);
        assert_eq!(f32::from(half::f16::from_le_bytes([out[0], out[1]])), 1.0);
        // s = d * (127 + 2 + 4 - 2 + 0 + 1) = 132.
        assert_eq!(f32::from(half::f16::from_le_bytes([out[2], out[3]])), 132.0);
        // amax 100: id = 127/100 = 1.27 in f32; 50 * id rounds to 63.5 -> 64 (even); d = 100/127.
        let mut y = [0.0f32; 32];
        y[0] = 100.0;
        y[1] = 50.0;
        let mut o0 = [0u8; 34];
        quantize_row_q8_0(&y, &mut o0);
        assert_eq!(o0[2] as i8, 127);
        assert_eq!(o0[3] as i8, ((50.0f32 * (127.0f32 / 100.0)).round_ties_even()) as i8);
        assert_eq!(
            half::f16::from_le_bytes([o0[0], o0[1]]),
            half::f16::from_f32(100.0f32 / 127.0)
        );
        // All zero: d = 0, quants 0.
        let z = [0.0f32; 32];
        quantize_row_q8_0(&z, &mut o0);
        assert!(o0.iter().all(|&b| b == 0));
    }
}
