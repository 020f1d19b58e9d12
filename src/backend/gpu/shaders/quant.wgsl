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

// Q2_K (84 bytes per 256 weights): scales[16] (per 16 weights, a scale in the low nibble and a min in the high),
// qs[64], d:f16, dmin:f16. Unit j: half j/4 of the super-block, 2-bit field g = j%4 of qs[32·half + l] for weight
// l; weight = d·scale·q − dmin·min with the scale and min of byte 8·half + 2g + l/16.
fn dq_q2_k_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 84u;
    let j = u % 8u;
    let hf = j / 4u;
    let g = j % 4u;
    let d = half_$F(o + 80u);
    let dmin = half_$F(o + 82u);
    let q0 = o + 16u + 32u * hf;
    for (var p = 0u; p < 2u; p++) {
        let sc = byte_$F(o + 8u * hf + 2u * g + p);
        let dl = d * f32(sc & 0xfu);
        let ml = dmin * f32(sc >> 4u);
        for (var k = 0u; k < 4u; k++) {
            let w = word_$F(q0 + 16u * p + 4u * k) >> (2u * g);
            for (var b = 0u; b < 4u; b++) {
                (*y)[16u * p + 4u * k + b] = dl * f32((w >> (8u * b)) & 3u) - ml;
            }
        }
    }
}

// Q3_K (110 bytes): hmask[32], qs[64], scales[12] (sixteen 6-bit scales biased by 32), d:f16. Unit j: half j/4,
// 2-bit field g = j%4 of qs[32·half + l]; 4 is subtracted where bit 4·half + g of hmask[l] is clear.
fn dq_q3_k_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 110u;
    let j = u % 8u;
    let hf = j / 4u;
    let g = j % 4u;
    let d = half_$F(o + 108u);
    let q0 = o + 32u + 32u * hf;
    for (var p = 0u; p < 2u; p++) {
        // Scale i: low 4 bits in nibble i/8 of scales[i%8], high 2 in bits 2·(i/4) of scales[8 + i%4].
        let i = 8u * hf + 2u * g + p;
        let low = (byte_$F(o + 96u + i % 8u) >> (4u * (i / 8u))) & 0xfu;
        let high = (byte_$F(o + 104u + i % 4u) >> (2u * (i / 4u))) & 3u;
        let dl = d * f32(i32(low | (high << 4u)) - 32);
        for (var k = 0u; k < 4u; k++) {
            let w = word_$F(q0 + 16u * p + 4u * k) >> (2u * g);
            let h = word_$F(o + 16u * p + 4u * k) >> (4u * hf + g);
            for (var b = 0u; b < 4u; b++) {
                let q = i32((w >> (8u * b)) & 3u) - select(4, 0, ((h >> (8u * b)) & 1u) != 0u);
                (*y)[16u * p + 4u * k + b] = dl * f32(q);
            }
        }
    }
}

// The sixteen levels of IQ4_NL and IQ4_XS (kernels::iquants::KVALUES_IQ4NL), and 16 weights laid out as IQ4_NL's
// (byte j: weight j in the low nibble, j + 16 in the high) at byte `q`, times `dl`.
const IQ4NL_$F = array<f32, 16>(-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0,
                                53.0, 69.0, 89.0, 113.0);
fn iq4_unit_$F(q: u32, dl: f32, y: ptr<function, array<f32, 32>>) {
    for (var k = 0u; k < 4u; k++) {
        let w = word_$F(q + 4u * k);
        for (var b = 0u; b < 4u; b++) {
            let v = (w >> (8u * b)) & 0xffu;
            (*y)[4u * k + b] = dl * IQ4NL_$F[v & 15u];
            (*y)[4u * k + b + 16u] = dl * IQ4NL_$F[v >> 4u];
        }
    }
}
// IQ4_NL (18 bytes): d:f16, qs[16].
fn dq_iq4_nl_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + u * 18u;
    iq4_unit_$F(o + 2u, half_$F(o), y);
}
// IQ4_XS (136 bytes per 256 weights): d:f16, scales_h:u16, scales_l[4], qs[128]: unit j is IQ4_NL's qs at
// 8 + 16j with the 6-bit scale (nibble j%2 of scales_l[j/2], bits 2j of scales_h) minus 32.
fn dq_iq4_xs_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 136u;
    let j = u % 8u;
    let low = (byte_$F(o + 4u + j / 2u) >> (4u * (j % 2u))) & 0xfu;
    let high = (word_$F(o + 2u) >> (2u * j)) & 3u;
    iq4_unit_$F(o + 8u + 16u * j, half_$F(o) * f32(i32(low | (high << 4u)) - 32), y);
}

// The grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S) look their magnitudes up in codebooks held in
// one storage buffer per device, iq_grid (matmul_io.wgsl), as u32 words from the offsets GRID_<type> (matmul.rs).
// ksigns: the sign bits of 8 weights for 7-bit sign index i (kernels::iquants::KSIGNS): its 7 bits, and an eighth
// that makes the count of minus signs even. grid8: weights 8l..8l + 8 of a unit from one 8-magnitude entry (bytes
// of lo, then hi), each times db and negated where its bit of `signs` is set; db is d·(scale/2)·2·factor, as the
// CPU's dequantization computes it.
fn ksigns_$F(i: u32) -> u32 {
    return i | ((countOneBits(i) & 1u) << 7u);
}
fn grid8_$F(y: ptr<function, array<f32, 32>>, l: u32, lo: u32, hi: u32, signs: u32, db: f32) {
    for (var b = 0u; b < 8u; b++) {
        let m = db * f32((select(hi, lo, b < 4u) >> (8u * (b % 4u))) & 0xffu);
        (*y)[8u * l + b] = select(m, -m, ((signs >> b) & 1u) != 0u);
    }
}
// IQ2_XXS (66 bytes per 256 weights): d:f16, then per unit two u32: four byte indices into the grid, then four
// 7-bit sign indices and a 4-bit scale in the top bits.
fn dq_iq2_xxs_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 66u;
    let q = o + 2u + 8u * (u % 8u);
    let idx = word_$F(q);
    let aux = word_$F(q + 4u);
    let db = half_$F(o) * (f32(2u * (aux >> 28u) + 1u) * 0.5) * 0.25;
    for (var l = 0u; l < 4u; l++) {
        let e = GRID_IQ2XXS + 2u * ((idx >> (8u * l)) & 0xffu);
        grid8_$F(y, l, iq_grid[e], iq_grid[e + 1u], ksigns_$F((aux >> (7u * l)) & 127u), db);
    }
}
// IQ2_XS (74 bytes): d:f16, qs:u16[32] (a 9-bit grid index and a 7-bit sign index per 8 weights), scales[8] (a
// nibble per 16 weights).
fn dq_iq2_xs_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 74u;
    let j = u % 8u;
    let d = half_$F(o);
    let sc = byte_$F(o + 66u + j);
    for (var l = 0u; l < 4u; l++) {
        let q = word_$F(o + 2u + 8u * j + 2u * l) & 0xffffu;
        let s = (sc >> (4u * (l / 2u))) & 15u;
        let e = GRID_IQ2XS + 2u * (q & 511u);
        grid8_$F(y, l, iq_grid[e], iq_grid[e + 1u], ksigns_$F(q >> 9u), d * (f32(2u * s + 1u) * 0.5) * 0.25);
    }
}
// IQ2_S (82 bytes): d:f16, qs[32] (low 8 bits of a 10-bit grid index per 8 weights), signs[32] (a bit per weight),
// qh[8] (the indices' high 2 bits), scales[8].
fn dq_iq2_s_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 82u;
    let j = u % 8u;
    let d = half_$F(o);
    let sc = byte_$F(o + 74u + j);
    let qh = byte_$F(o + 66u + j);
    let signs = word_$F(o + 34u + 4u * j);
    for (var l = 0u; l < 4u; l++) {
        let s = (sc >> (4u * (l / 2u))) & 15u;
        let e = GRID_IQ2S + 2u * (byte_$F(o + 2u + 4u * j + l) | (((qh >> (2u * l)) & 3u) << 8u));
        grid8_$F(y, l, iq_grid[e], iq_grid[e + 1u], (signs >> (8u * l)) & 0xffu, d * (f32(2u * s + 1u) * 0.5) * 0.25);
    }
}
// IQ3_XXS (98 bytes): d:f16, qs[64] (byte indices into a grid of 4 magnitudes), then per unit a u32 of four 7-bit
// sign indices and a 4-bit scale.
fn dq_iq3_xxs_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 98u;
    let j = u % 8u;
    let aux = word_$F(o + 66u + 4u * j);
    let db = half_$F(o) * (f32(2u * (aux >> 28u) + 1u) * 0.5) * 0.5;
    let q = o + 2u + 8u * j;
    for (var l = 0u; l < 4u; l++) {
        let lo = iq_grid[GRID_IQ3XXS + byte_$F(q + 2u * l)];
        let hi = iq_grid[GRID_IQ3XXS + byte_$F(q + 2u * l + 1u)];
        grid8_$F(y, l, lo, hi, ksigns_$F((aux >> (7u * l)) & 127u), db);
    }
}
// IQ3_S (110 bytes): d:f16, qs[64] (low 8 bits of 9-bit indices into a grid of 4 magnitudes), qh[8], signs[32],
// scales[4] (a nibble per unit).
fn dq_iq3_s_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 110u;
    let j = u % 8u;
    let s = (byte_$F(o + 106u + j / 2u) >> (4u * (j % 2u))) & 15u;
    let db = half_$F(o) * (f32(2u * s + 1u) * 0.5) * 2.0;
    let qh = byte_$F(o + 66u + j);
    let signs = word_$F(o + 74u + 4u * j);
    let q = o + 2u + 8u * j;
    for (var l = 0u; l < 4u; l++) {
        let lo = iq_grid[GRID_IQ3S + (byte_$F(q + 2u * l) | (((qh >> (2u * l)) & 1u) << 8u))];
        let hi = iq_grid[GRID_IQ3S + (byte_$F(q + 2u * l + 1u) | (((qh >> (2u * l + 1u)) & 1u) << 8u))];
        grid8_$F(y, l, lo, hi, (signs >> (8u * l)) & 0xffu, db);
    }
}
// IQ1_S (50 bytes): d:f16, qs[32], qh:u16[8]: per 8 weights an 11-bit index into a grid of signed bytes (-1, 0, 1)
// (low 8 bits in qs, 3 in qh), per unit a 3-bit scale (odd: 2s + 1) and the sign of a ±1/8 shift.
fn dq_iq1_s_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    let o = rb + (u / 8u) * 50u;
    let j = u % 8u;
    let h = word_$F(o + 34u + 2u * j) & 0xffffu;
    let dl = half_$F(o) * f32(2u * ((h >> 12u) & 7u) + 1u);
    let delta = select(0.125, -0.125, (h & 0x8000u) != 0u);
    for (var l = 0u; l < 4u; l++) {
        let e = GRID_IQ1S + 2u * (byte_$F(o + 2u + 4u * j + l) | (((h >> (3u * l)) & 7u) << 8u));
        for (var b = 0u; b < 8u; b++) {
            let w = select(iq_grid[e + 1u], iq_grid[e], b < 4u);
            let v = bitcast<i32>(w << (24u - 8u * (b % 4u))) >> 24u;
            (*y)[8u * l + b] = dl * (f32(v) + delta);
        }
    }
}

fn dequant_$F(rb: u32, u: u32, y: ptr<function, array<f32, 32>>) {
    dq_$T_$F(rb, u, y);
}
