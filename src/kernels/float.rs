//! Float storage types (F32, F16, BF16): conversion to f32 and the f32 dot they are multiplied with.

pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * 4, "source bytes do not match the row length");
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Through `half`'s slice conversion, which converts 8 or 16 values per F16C/AVX-512 instruction after one CPU
/// check per call: converting element by element checks the CPU on every value and ran F16 decode at 2 GB/s.
pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    assert_eq!(src.len(), dst.len() * 2, "source bytes do not match the row length");
    // SAFETY: u16 has no invalid bit patterns; `align_to` puts only whole, aligned u16 in the middle part.
    let (head, bits, tail) = unsafe { src.align_to::<u16>() };
    if head.is_empty() && tail.is_empty() && cfg!(target_endian = "little") {
        bits.reinterpret_cast::<half::f16>().convert_to_f32_slice(dst);
        return;
    }
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
    }
}

pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * 2, "source bytes do not match the row length");
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

/// f32 dot with eight independent partial sums (vectorizes; the order is fixed, so results are reproducible).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_rows_decode() {
        let mut y = [0.0f32; 3];
        let src: Vec<u8> = [1.5f32, -2.0, 1e-3].iter().flat_map(|v| v.to_le_bytes()).collect();
        dequantize_f32(&src, &mut y);
        assert_eq!(y, [1.5, -2.0, 1e-3]);
        // f16: 1.0 = 0x3c00, -2.0 = 0xc000, 65504 = 0x7bff.
        dequantize_f16(&[0x00, 0x3c, 0x00, 0xc0, 0xff, 0x7b], &mut y);
        assert_eq!(y, [1.0, -2.0, 65504.0]);
        // bf16: the high half of the f32.
        dequantize_bf16(&[0x80, 0x3f, 0x00, 0xc0, 0x49, 0x40], &mut y);
        assert_eq!(y, [1.0, -2.0, f32::from_bits(0x4049_0000)]);
    }

    #[test]
    fn f16_rows_decode_aligned_or_not() {
        let vals: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37).collect();
        let mut bytes = vec![0u8];
        bytes.extend(vals.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()));
        let want: Vec<f32> = vals.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        // A fresh Vec is u16-aligned (the slice conversion); one byte into a buffer is not (the element loop).
        let aligned = bytes[1..].to_vec();
        for src in [&aligned[..], &bytes[1..]] {
            let mut y = vec![0.0f32; 37];
            dequantize_f16(src, &mut y);
            assert_eq!(y, want);
        }
    }

    #[test]
    fn dot_f32_odd_length() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..19).map(|i| 1.0 - i as f32 * 0.5).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot_f32(&a, &b), want);
    }
}
