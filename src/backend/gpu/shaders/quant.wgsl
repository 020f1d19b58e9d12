// Dequantization of one 32-weight unit of a weight row, for every type the GPU matmul takes. A template: Rust
// replaces $W with the weight buffer's name and $F with a suffix, once per weight buffer of the module (the fused
// gate/up matmul reads two). Weights are GGUF blocks as in the file, read as u32 words; every offset passed to
// the readers is even, as block sizes and row sizes are.
//
// Each dq_<type>_$F(rb, u, y) writes weights 32u..32u+32 of the row starting at byte rb into y.

// Byte `off` of the buffer.
fn byte_$F(off: u32) -> u32 {
    return ($W[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

// The 4 bytes at even offset `off`, little-endian: one word, or the halves of two.
fn word_$F(off: u32) -> u32 {
    let i = off >> 2u;
    if ((off & 2u) == 0u) {
        return $W[i];
    }
    return ($W[i] >> 16u) | ($W[i + 1u] << 16u);
}

// The f16 at even offset `off`.
fn half_$F(off: u32) -> f32 {
    return unpack2x16float(($W[off >> 2u] >> ((off & 2u) * 8u)) & 0xffffu).x;
}

fn dq_f32_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let w0 = (rb + u * 128u) >> 2u;
    for (var k = 0u; k < 32u; k++) {
        (*y)[k] = bitcast<f32>($W[w0 + k]);
    }
}

fn dq_f16_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let w0 = (rb + u * 64u) >> 2u;
    for (var k = 0u; k < 16u; k++) {
        let v = unpack2x16float($W[w0 + k]);
        (*y)[2u * k] = v.x;
        (*y)[2u * k + 1u] = v.y;
    }
}

fn dq_bf16_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let w0 = (rb + u * 64u) >> 2u;
    for (var k = 0u; k < 16u; k++) {
        let w = $W[w0 + k];
        (*y)[2u * k] = bitcast<f32>(w << 16u);
        (*y)[2u * k + 1u] = bitcast<f32>(w & 0xffff0000u);
    }
}

// Q8_0 (34 bytes): d:f16, qs:i8[32].
fn dq_q8_0_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + u * 34u;
    let d = half_$F(o);
    for (var k = 0u; k < 8u; k++) {
        let w = word_$F(o + 2u + 4u * k);
        for (var b = 0u; b < 4u; b++) {
            (*y)[4u * k + b] = f32(bitcast<i32>(w << (24u - 8u * b)) >> 24u) * d;
        }
    }
}

// Q4_0 (18 bytes): d:f16, qs[16]; byte j holds weight j (low nibble) and j + 16 (high), both biased by 8.
fn dq_q4_0_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + u * 18u;
    let d = half_$F(o);
    for (var k = 0u; k < 4u; k++) {
        let w = word_$F(o + 2u + 4u * k);
        for (var b = 0u; b < 4u; b++) {
            let q = (w >> (8u * b)) & 0xffu;
            (*y)[4u * k + b] = f32(i32(q & 15u) - 8) * d;
            (*y)[4u * k + b + 16u] = f32(i32(q >> 4u) - 8) * d;
        }
    }
}

// Q4_1 (20 bytes): d:f16, m:f16, qs[16]; weight = q·d + m.
fn dq_q4_1_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + u * 20u;
    let d = half_$F(o);
    let m = half_$F(o + 2u);
    for (var k = 0u; k < 4u; k++) {
        let w = word_$F(o + 4u + 4u * k);
        for (var b = 0u; b < 4u; b++) {
            let q = (w >> (8u * b)) & 0xffu;
            (*y)[4u * k + b] = f32(q & 15u) * d + m;
            (*y)[4u * k + b + 16u] = f32(q >> 4u) * d + m;
        }
    }
}

// Q5_0 (22 bytes): d:f16, qh:u32 (fifth bit of weight j at bit j), qs[16]; biased by 16.
fn dq_q5_0_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + u * 22u;
    let d = half_$F(o);
    let qh = word_$F(o + 2u);
    for (var k = 0u; k < 4u; k++) {
        let w = word_$F(o + 6u + 4u * k);
        for (var b = 0u; b < 4u; b++) {
            let j = 4u * k + b;
            let q = (w >> (8u * b)) & 0xffu;
            let h0 = ((qh >> j) << 4u) & 0x10u;
            let h1 = (qh >> (j + 12u)) & 0x10u;
            (*y)[j] = f32(i32((q & 15u) | h0) - 16) * d;
            (*y)[j + 16u] = f32(i32((q >> 4u) | h1) - 16) * d;
        }
    }
}

// Q5_1 (24 bytes): d:f16, m:f16, qh:u32, qs[16]; weight = q·d + m.
fn dq_q5_1_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + u * 24u;
    let d = half_$F(o);
    let m = half_$F(o + 2u);
    let qh = word_$F(o + 4u);
    for (var k = 0u; k < 4u; k++) {
        let w = word_$F(o + 8u + 4u * k);
        for (var b = 0u; b < 4u; b++) {
            let j = 4u * k + b;
            let q = (w >> (8u * b)) & 0xffu;
            let h0 = ((qh >> j) << 4u) & 0x10u;
            let h1 = (qh >> (j + 12u)) & 0x10u;
            (*y)[j] = f32((q & 15u) | h0) * d + m;
            (*y)[j + 16u] = f32((q >> 4u) | h1) * d + m;
        }
    }
}

// Scale and min j (0..8) of the 12-byte 6-bit table of Q4_K/Q5_K at byte s.
fn scale_min_k4_$F(j: u32, s: u32) -> vec2<u32> {
    if (j < 4u) {
        return vec2<u32>(byte_$F(s + j) & 63u, byte_$F(s + j + 4u) & 63u);
    }
    let a = byte_$F(s + j + 4u);
    let sc = (a & 0xfu) | ((byte_$F(s + j - 4u) >> 6u) << 4u);
    let mn = (a >> 4u) | ((byte_$F(s + j) >> 6u) << 4u);
    return vec2<u32>(sc, mn);
}

// Q4_K (144 bytes per 256 weights): d:f16, dmin:f16, scales[12], qs[128]. Unit j of a super-block is the low
// (j even) or high nibbles of qs[32·(j/2)..]; weight = d·scale_j·q − dmin·min_j.
fn dq_q4_k_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 144u;
    let j = u % 8u;
    let sm = scale_min_k4_$F(j, o + 4u);
    let d1 = half_$F(o) * f32(sm.x);
    let m1 = half_$F(o + 2u) * f32(sm.y);
    let q0 = o + 16u + 32u * (j / 2u);
    let shift = 4u * (j & 1u);
    for (var k = 0u; k < 8u; k++) {
        let w = word_$F(q0 + 4u * k) >> shift;
        for (var b = 0u; b < 4u; b++) {
            (*y)[4u * k + b] = d1 * f32((w >> (8u * b)) & 0xfu) - m1;
        }
    }
}

// Q5_K (176 bytes): d:f16, dmin:f16, scales[12], qh[32], qs[128]; the fifth bit of unit j's weight l is bit j
// of qh[l].
fn dq_q5_k_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 176u;
    let j = u % 8u;
    let sm = scale_min_k4_$F(j, o + 4u);
    let d1 = half_$F(o) * f32(sm.x);
    let m1 = half_$F(o + 2u) * f32(sm.y);
    let q0 = o + 48u + 32u * (j / 2u);
    let shift = 4u * (j & 1u);
    for (var k = 0u; k < 8u; k++) {
        let w = word_$F(q0 + 4u * k) >> shift;
        let h = word_$F(o + 16u + 4u * k) >> j;
        for (var b = 0u; b < 4u; b++) {
            let q = ((w >> (8u * b)) & 0xfu) | (((h >> (8u * b)) & 1u) << 4u);
            (*y)[4u * k + b] = d1 * f32(q) - m1;
        }
    }
}

// Q6_K (210 bytes): ql[128], qh[64], scales:i8[16], d:f16. Unit j: half j/4 of the super-block, group g = j%4 of
// 32 weights in it; weight l's low nibble is in ql[64·half + l + 32·(g&1)] (high nibble when g ≥ 2), its two high
// bits are bits 2g of qh[32·half + l], biased by 32, scaled by d·scales[8·half + l/16 + 2g].
fn dq_q6_k_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 210u;
    let j = u % 8u;
    let hf = j / 4u;
    let g = j % 4u;
    let d = half_$F(o + 208u);
    let ql = o + 64u * hf + 32u * (g & 1u);
    let qh = o + 128u + 32u * hf;
    let lshift = 4u * (g >> 1u);
    let sbase = o + 192u + 8u * hf + 2u * g;
    let s0 = d * f32(bitcast<i32>(byte_$F(sbase) << 24u) >> 24u);
    let s1 = d * f32(bitcast<i32>(byte_$F(sbase + 1u) << 24u) >> 24u);
    for (var k = 0u; k < 8u; k++) {
        let wl = word_$F(ql + 4u * k) >> lshift;
        let wh = word_$F(qh + 4u * k) >> (2u * g);
        let s = select(s1, s0, k < 4u);
        for (var b = 0u; b < 4u; b++) {
            let q = ((wl >> (8u * b)) & 0xfu) | (((wh >> (8u * b)) & 3u) << 4u);
            (*y)[4u * k + b] = s * f32(i32(q) - 32);
        }
    }
}

fn dequant_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    dq_$T_$F(rb, u, y);
}
