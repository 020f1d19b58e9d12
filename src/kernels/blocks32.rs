//! The 32-weight block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1): byte layouts as ggml stores them, scalar
//! dequantization, the quantizers (activations for the vec-dot types, and weights for `baton quantize`), and the
//! scalar reference dot products every SIMD kernel is tested against.
//!
//! Layouts (little-endian, packed): Q4_0 `d:f16 qs[16]`; Q4_1 `d:f16 m:f16 qs[16]`; Q5_0 `d:f16 qh:u32 qs[16]`;
//! Q5_1 `d:f16 m:f16 qh:u32 qs[16]`; Q8_0 `d:f16 qs:i8[32]`; Q8_1 `d:f16 s:f16 qs:i8[32]` with `s = d·Σqs`.
//! In the 4/5-bit formats byte `j` of `qs` holds weight `j` in its low nibble and weight `j + 16` in its high one;
//! bit `j` of `qh` is the fifth bit of weight `j`.

/// Weights per block.
pub const QK: usize = 32;
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q5_0_BYTES: usize = 22;
pub const Q5_1_BYTES: usize = 24;
pub const Q8_0_BYTES: usize = 34;
pub const Q8_1_BYTES: usize = 36;

#[inline(always)]
pub fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
pub fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

#[inline(always)]
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn check(src: &[u8], dst: &[f32], bytes: usize) {
    assert!(
        dst.len().is_multiple_of(QK),
        "row length {} is not a multiple of {QK}",
        dst.len()
    );
    assert_eq!(
        src.len(),
        dst.len() / QK * bytes,
        "source bytes do not match the row length"
    );
}

pub fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q4_0_BYTES);
    for (b, y) in src.chunks_exact(Q4_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for j in 0..16 {
            let q = b[2 + j];
            y[j] = ((q & 15) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q4_1_BYTES);
    for (b, y) in src.chunks_exact(Q4_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for j in 0..16 {
            let q = b[4 + j];
            y[j] = (q & 15) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    }
}

pub fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q5_0_BYTES);
    for (b, y) in src.chunks_exact(Q5_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let qh = u32_at(b, 2);
        for j in 0..16 {
            let q = b[6 + j];
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (((q & 15) as u32 | h0) as i32 - 16) as f32 * d;
            y[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
        }
    }
}

pub fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q5_1_BYTES);
    for (b, y) in src.chunks_exact(Q5_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let qh = u32_at(b, 4);
        for j in 0..16 {
            let q = b[8 + j];
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            y[j] = ((q & 15) as u32 | h0) as f32 * d + m;
            y[j + 16] = ((q >> 4) as u32 | h1) as f32 * d + m;
        }
    }
}

pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q8_0_BYTES);
    for (b, y) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for j in 0..QK {
            y[j] = b[2 + j] as i8 as f32 * d;
        }
    }
}

pub fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    check(src, dst, Q8_1_BYTES);
    for (b, y) in src.chunks_exact(Q8_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        for j in 0..QK {
            y[j] = b[4 + j] as i8 as f32 * d;
        }
    }
}

fn check_q(x: &[f32], out: &[u8], bytes: usize) {
    assert!(
        x.len().is_multiple_of(QK),
        "row length {} is not a multiple of {QK}",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len() / QK * bytes,
        "output bytes do not match the row length"
    );
}

/// Largest magnitude of a block.
#[inline(always)]
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// The value of largest magnitude, sign kept (the first one on ties), as ggml's reference quantizers pick it.
#[inline(always)]
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Activations to Q8_0, as ggml's x86 path does it: `d = amax/127`, round half to even.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    check_q(x, out, Q8_0_BYTES);
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_0_BYTES)) {
        let a = amax(v);
        let d = a / 127.0;
        let id = if a != 0.0 { 127.0 / a } else { 0.0 };
        b[0..2].copy_from_slice(&f16_bytes(d));
        for j in 0..QK {
            b[2 + j] = (v[j] * id).round_ties_even() as i8 as u8;
        }
    }
}

/// Activations to Q8_1 (Q8_0 plus `s = d·Σq`, which carries the min term of Q4_1/Q5_1 dots).
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    check_q(x, out, Q8_1_BYTES);
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q8_1_BYTES)) {
        let a = amax(v);
        let d = a / 127.0;
        let id = if a != 0.0 { 127.0 / a } else { 0.0 };
        let mut sum = 0i32;
        for j in 0..QK {
            let q = (v[j] * id).round_ties_even() as i32;
            sum += q;
            b[4 + j] = q as i8 as u8;
        }
        b[0..2].copy_from_slice(&f16_bytes(d));
        b[2..4].copy_from_slice(&f16_bytes(sum as f32 * d));
    }
}

/// Weights to Q4_0 (ggml's reference quantizer: the extreme value maps to -8).
pub fn quantize_row_q4_0(x: &[f32], out: &mut [u8]) {
    check_q(x, out, Q4_0_BYTES);
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q4_0_BYTES)) {
        let d = signed_max(v) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[0..2].copy_from_slice(&f16_bytes(d));
        for j in 0..16 {
            let q0 = ((v[j] * id + 8.5) as i8).min(15) as u8;
            let q1 = ((v[j + 16] * id + 8.5) as i8).min(15) as u8;
            b[2 + j] = q0 | (q1 << 4);
        }
    }
}

/// Weights to Q4_1 (min and step from the block's range).
pub fn quantize_row_q4_1(x: &[f32], out: &mut [u8]) {
    check_q(x, out, Q4_1_BYTES);
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q4_1_BYTES)) {
        let min = v.iter().fold(f32::MAX, |a, &x| a.min(x));
        let max = v.iter().fold(f32::MIN, |a, &x| a.max(x));
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[0..2].copy_from_slice(&f16_bytes(d));
        b[2..4].copy_from_slice(&f16_bytes(min));
        for j in 0..16 {
            let q0 = (((v[j] - min) * id + 0.5) as u8).min(15);
            let q1 = (((v[j + 16] - min) * id + 0.5) as u8).min(15);
            b[4 + j] = q0 | (q1 << 4);
        }
    }
}

/// Weights to Q5_0 (the extreme value maps to -16).
pub fn quantize_row_q5_0(x: &[f32], out: &mut [u8]) {
    check_q(x, out, Q5_0_BYTES);
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q5_0_BYTES)) {
        let d = signed_max(v) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qh = 0u32;
        for j in 0..16 {
            let q0 = ((v[j] * id + 16.5) as i8).min(31) as u8;
            let q1 = ((v[j + 16] * id + 16.5) as i8).min(31) as u8;
            b[6 + j] = (q0 & 15) | ((q1 & 15) << 4);
            qh |= ((q0 as u32 & 0x10) >> 4) << j;
            qh |= ((q1 as u32 & 0x10) >> 4) << (j + 16);
        }
        b[0..2].copy_from_slice(&f16_bytes(d));
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Weights to Q5_1.
pub fn quantize_row_q5_1(x: &[f32], out: &mut [u8]) {
    check_q(x, out, Q5_1_BYTES);
    for (v, b) in x.chunks_exact(QK).zip(out.chunks_exact_mut(Q5_1_BYTES)) {
        let min = v.iter().fold(f32::MAX, |a, &x| a.min(x));
        let max = v.iter().fold(f32::MIN, |a, &x| a.max(x));
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qh = 0u32;
        for j in 0..16 {
            let q0 = ((v[j] - min) * id + 0.5) as u8;
            let q1 = ((v[j + 16] - min) * id + 0.5) as u8;
            b[8 + j] = (q0 & 15) | ((q1 & 15) << 4);
            qh |= ((q0 as u32 & 0x10) >> 4) << j;
            qh |= ((q1 as u32 & 0x10) >> 4) << (j + 16);
        }
        b[0..2].copy_from_slice(&f16_bytes(d));
        b[2..4].copy_from_slice(&f16_bytes(min));
        b[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

// Scalar reference dot products: `n` weight blocks against `n` activation blocks. Integer sums per block, scaled
// once per block, as ggml does.

pub fn dot_q4_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q4_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)).take(n) {
        let mut s = 0i32;
        for j in 0..16 {
            s += ((b[2 + j] & 15) as i32 - 8) * y[2 + j] as i8 as i32;
            s += ((b[2 + j] >> 4) as i32 - 8) * y[18 + j] as i8 as i32;
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

pub fn dot_q4_1_q8_1(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q4_1_BYTES).zip(x.chunks_exact(Q8_1_BYTES)).take(n) {
        let mut s = 0i32;
        for j in 0..16 {
            s += (b[4 + j] & 15) as i32 * y[4 + j] as i8 as i32;
            s += (b[4 + j] >> 4) as i32 * y[20 + j] as i8 as i32;
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0)) + f16_at(b, 2) * f16_at(y, 2);
    }
    sum
}

pub fn dot_q5_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q5_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)).take(n) {
        let qh = u32_at(b, 2);
        let mut s = 0i32;
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            s += (((b[6 + j] & 15) as u32 | h0) as i32 - 16) * y[2 + j] as i8 as i32;
            s += (((b[6 + j] >> 4) as u32 | h1) as i32 - 16) * y[18 + j] as i8 as i32;
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

pub fn dot_q5_1_q8_1(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q5_1_BYTES).zip(x.chunks_exact(Q8_1_BYTES)).take(n) {
        let qh = u32_at(b, 4);
        let mut s = 0i32;
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            s += ((b[8 + j] & 15) as u32 | h0) as i32 * y[4 + j] as i8 as i32;
            s += ((b[8 + j] >> 4) as u32 | h1) as i32 * y[20 + j] as i8 as i32;
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0)) + f16_at(b, 2) * f16_at(y, 2);
    }
    sum
}

pub fn dot_q8_0_q8_0(n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (b, y) in w.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)).take(n) {
        let mut s = 0i32;
        for j in 0..QK {
            s += b[2 + j] as i8 as i32 * y[2 + j] as i8 as i32;
        }
        sum += s as f32 * (f16_at(b, 0) * f16_at(y, 0));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::{Rng, rel_close};

    /// A block with scale 0.5 and quants 0..32 laid out by hand, decoded independently of the format code.
    #[test]
    fn hand_built_blocks_decode() {
        // Q4_0: d = 0.5 (f16 0x3800), weight j has nibble j % 16.
        let mut b = vec![0x00, 0x38];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0.0; 32];
        dequantize_q4_0(&b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], (15.0 - j as f32 - 8.0) * 0.5);
        }
        // Q4_1: d = 0.5, m = -1.0 (0xbc00).
        let mut b = vec![0x00, 0x38, 0x00, 0xbc];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        dequantize_q4_1(&b, &mut y);
        assert_eq!(y[3], 3.0 * 0.5 - 1.0);
        assert_eq!(y[16], 15.0 * 0.5 - 1.0);
        // Q5_0: d = 2.0 (0x4000), fifth bit set for weights 1 and 17 only.
        let mut b = vec![0x00, 0x40];
        b.extend(((1u32 << 1) | (1 << 17)).to_le_bytes());
        b.extend([0x21u8; 16]);
        dequantize_q5_0(&b, &mut y);
        assert_eq!(y[0], (1.0 - 16.0) * 2.0);
        assert_eq!(y[1], (17.0 - 16.0) * 2.0);
        assert_eq!(y[16], (2.0 - 16.0) * 2.0);
        assert_eq!(y[17], (18.0 - 16.0) * 2.0);
        // Q5_1: d = 1, m = 0.5 (0x3800).
        let mut b = vec![0x00, 0x3c, 0x00, 0x38];
        b.extend((1u32 << 31).to_le_bytes());
        b.extend([0xf3u8; 16]);
        dequantize_q5_1(&b, &mut y);
        assert_eq!(y[0], 3.5);
        assert_eq!(y[15], 3.5);
        assert_eq!(y[30], 15.5);
        assert_eq!(y[31], 31.5);
        // Q8_0: d = 0.25 (0x3400), qs = -16..16.
        let mut b = vec![0x00, 0x34];
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        dequantize_q8_0(&b, &mut y);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 0.25);
        }
    }

    /// Every value comes back within `tol_steps` quantization steps (`range / levels`).
    fn round_trip(quant: fn(&[f32], &mut [u8]), deq: fn(&[u8], &mut [f32]), bytes: usize, levels: f32, tol_steps: f32) {
        let mut rng = Rng(7);
        let x: Vec<f32> = (0..QK * 5).map(|_| rng.normal()).collect();
        let mut q = vec![0u8; 5 * bytes];
        quant(&x, &mut q);
        let mut y = vec![0.0; x.len()];
        deq(&q, &mut y);
        for (xb, yb) in x.chunks(QK).zip(y.chunks(QK)) {
            let range = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) * 2.0;
            for (a, b) in xb.iter().zip(yb) {
                // Plus f16 rounding of the scale.
                assert!((a - b).abs() <= range / levels * tol_steps * 1.01 + 1e-3, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn quantizers_round_trip() {
        round_trip(quantize_row_q8_0, dequantize_q8_0, Q8_0_BYTES, 254.0, 0.5);
        round_trip(quantize_row_q8_1, dequantize_q8_1, Q8_1_BYTES, 254.0, 0.5);
        round_trip(quantize_row_q4_1, dequantize_q4_1, Q4_1_BYTES, 15.0, 0.5);
        round_trip(quantize_row_q5_1, dequantize_q5_1, Q5_1_BYTES, 31.0, 0.5);
        // Q4_0/Q5_0 map the extreme to -8/-16 exactly, so the opposite extreme clips to +7/+15: one full step.
        round_trip(quantize_row_q4_0, dequantize_q4_0, Q4_0_BYTES, 16.0, 1.0);
        round_trip(quantize_row_q5_0, dequantize_q5_0, Q5_0_BYTES, 32.0, 1.0);
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        let x = [0.0f32; 32];
        let mut q = [0xffu8; Q4_1_BYTES];
        quantize_row_q4_1(&x, &mut q);
        let mut y = [1.0; 32];
        dequantize_q4_1(&q, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
        let mut q = [0xffu8; Q8_0_BYTES];
        quantize_row_q8_0(&x, &mut q);
        dequantize_q8_0(&q, &mut y);
        assert!(y.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn q8_1_sum_matches_quants() {
        let mut rng = Rng(3);
        let x: Vec<f32> = (0..QK).map(|_| rng.normal()).collect();
        let mut q = [0u8; Q8_1_BYTES];
        quantize_row_q8_1(&x, &mut q);
        let s: i32 = q[4..].iter().map(|&v| v as i8 as i32).sum();
        assert!(rel_close(f16_at(&q, 2), s as f32 * f16_at(&q, 0), 1e-3));
    }

    /// Each scalar dot equals the f32 dot of the two dequantized rows (up to float summation order).
    #[test]
    fn dots_match_dequantized() {
        type Q = fn(&[f32], &mut [u8]);
        type D = fn(&[u8], &mut [f32]);
        type Dot = fn(usize, &[u8], &[u8]) -> f32;
        let cases: [(Q, D, usize, Q, D, usize, Dot); 5] = [
            (
                quantize_row_q4_0,
                dequantize_q4_0,
                Q4_0_BYTES,
                quantize_row_q8_0,
                dequantize_q8_0,
                Q8_0_BYTES,
                dot_q4_0_q8_0,
            ),
            (
                quantize_row_q4_1,
                dequantize_q4_1,
                Q4_1_BYTES,
                quantize_row_q8_1,
                dequantize_q8_1,
                Q8_1_BYTES,
                dot_q4_1_q8_1,
            ),
            (
                quantize_row_q5_0,
                dequantize_q5_0,
                Q5_0_BYTES,
                quantize_row_q8_0,
                dequantize_q8_0,
                Q8_0_BYTES,
                dot_q5_0_q8_0,
            ),
            (
                quantize_row_q5_1,
                dequantize_q5_1,
                Q5_1_BYTES,
                quantize_row_q8_1,
                dequantize_q8_1,
                Q8_1_BYTES,
                dot_q5_1_q8_1,
            ),
            (
                quantize_row_q8_0,
                dequantize_q8_0,
                Q8_0_BYTES,
                quantize_row_q8_0,
                dequantize_q8_0,
                Q8_0_BYTES,
                dot_q8_0_q8_0,
            ),
        ];
        let mut rng = Rng(11);
        let n = 7;
        for (qw, dw, bw, qx, dx, bx, dot) in cases {
            let w: Vec<f32> = (0..QK * n).map(|_| rng.normal() + 0.3).collect();
            let x: Vec<f32> = (0..QK * n).map(|_| rng.normal()).collect();
            let (mut wq, mut xq) = (vec![0u8; n * bw], vec![0u8; n * bx]);
            qw(&w, &mut wq);
            qx(&x, &mut xq);
            let (mut wd, mut xd) = (vec![0.0; w.len()], vec![0.0; x.len()]);
            dw(&wq, &mut wd);
            dx(&xq, &mut xd);
            let want: f32 = wd.iter().zip(&xd).map(|(a, b)| a * b).sum();
            let got = dot(n, &wq, &xq);
            assert!(rel_close(got, want, 1e-3), "{got} vs {want}");
        }
    }
}
