// x rounded to the nearest f16 (ties to even, as the CPU's conversions), by its bits. Not through
// `pack2x16float`: WGSL leaves that one's rounding to the implementation, and NVIDIA's driver (580) drops the
// round trip `unpack2x16float(pack2x16float(x))` altogether, keeping x's f32 value.
fn f16_round(x: f32) -> f32 {
    let a = abs(x);
    let b = bitcast<u32>(x);
    if (a < 6.103515625e-5) {
        // Below f16's least normal number its steps are 2^-24 apart (multiplying by a power of two is exact);
        // the sign is x's, zero's included.
        return bitcast<f32>((b & 0x80000000u) | bitcast<u32>(round(a * 16777216.0) / 16777216.0));
    }
    if (a >= 65520.0) {
        // Past f16's largest value, 65504, and its half step: infinity, with x's sign.
        return bitcast<f32>((b & 0x80000000u) | 0x7f800000u);
    }
    // Round the 23-bit mantissa to 10 bits: add just under half a step, plus one where the kept bit is odd.
    return bitcast<f32>((b + 0xfffu + ((b >> 13u) & 1u)) & 0xffffe000u);
}
