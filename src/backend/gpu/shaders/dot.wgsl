// The dot product of one 32-weight unit of a weight row with 32 activations, straight from the GGUF block: the
// per-row matmul's inner loop (matmul.wgsl). A template over quant.wgsl's readers, instantiated as it is ($W, $F);
// matmul.rs keeps only the weight type's own dot_<type> and names it in dot_$F.
//
// Why not dequant_$F and a loop: that fills a 32-float function array indexed in loops, which a driver may keep in
// memory rather than registers (the tiled kernel's accumulators did, docs/gpu.md). Here the weights go from the
// loaded word to a vec4 and into vec4 sums, and a block's scale and offset multiply the sums once, not each weight.
// Each dot_<type> reads the activations as x4[xb4 ..], xb4 the unit's first activation over 4; the types without
// one here (Q2_K, Q3_K, the i-quants) go through dot_dq, which does dequantize into an array.

// The low nibbles of w's 4 bytes, with bit j of h as their fifth bit.
fn nib4_$F(w: u32, h: u32) -> vec4<f32> {
    return vec4<f32>(
        f32((w & 15u) | ((h & 1u) << 4u)),
        f32(((w >> 8u) & 15u) | ((h & 2u) << 3u)),
        f32(((w >> 16u) & 15u) | ((h & 4u) << 2u)),
        f32(((w >> 24u) & 15u) | ((h & 8u) << 1u)),
    );
}

// Bit 0 of each of h's 4 bytes, as 4 bits.
fn bits4_$F(h: u32) -> u32 {
    return (h & 1u) | ((h >> 7u) & 2u) | ((h >> 14u) & 4u) | ((h >> 21u) & 8u);
}

// w's 4 bytes as signed 8-bit values.
fn i8x4_$F(w: u32) -> vec4<f32> {
    return vec4<f32>(
        f32(bitcast<i32>(w << 24u) >> 24u),
        f32(bitcast<i32>(w << 16u) >> 24u),
        f32(bitcast<i32>(w << 8u) >> 24u),
        f32(bitcast<i32>(w) >> 24u),
    );
}

fn hsum_$F(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

fn dot_f32_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let w0 = (rb + u * 128u) >> 2u;
    var s = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        let k = w0 + 4u * i;
        let w = vec4<f32>(bitcast<f32>($W[k]), bitcast<f32>($W[k + 1u]), bitcast<f32>($W[k + 2u]),
                          bitcast<f32>($W[k + 3u]));
        s += w * x4[xb4 + i];
    }
    return hsum_$F(s);
}

fn dot_f16_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let w0 = (rb + u * 64u) >> 2u;
    var s = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        let w = vec4<f32>(unpack2x16float($W[w0 + 2u * i]), unpack2x16float($W[w0 + 2u * i + 1u]));
        s += w * x4[xb4 + i];
    }
    return hsum_$F(s);
}

fn dot_bf16_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let w0 = (rb + u * 64u) >> 2u;
    var s = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        let a = $W[w0 + 2u * i];
        let b = $W[w0 + 2u * i + 1u];
        let w = vec4<f32>(bitcast<f32>(a << 16u), bitcast<f32>(a & 0xffff0000u), bitcast<f32>(b << 16u),
                          bitcast<f32>(b & 0xffff0000u));
        s += w * x4[xb4 + i];
    }
    return hsum_$F(s);
}

// Q8_0: d · Σ q·x.
fn dot_q8_0_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + u * 34u;
    var s = vec4<f32>(0.0);
    for (var k = 0u; k < 8u; k++) {
        s += i8x4_$F(word_$F(o + 2u + 4u * k)) * x4[xb4 + k];
    }
    return half_$F(o) * hsum_$F(s);
}

// (Σ q·x, Σ x) over a unit of 16 bytes of nibbles at byte qs, laid out as Q4_0's (byte j: weight j in the low
// nibble, j + 16 in the high), the fifth bit of weight j being bit j of qh (0 for the 4-bit types).
fn nib32_$F(qs: u32, qh: u32, xb4: u32) -> vec2<f32> {
    var s = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let w = word_$F(qs + 4u * k);
        let xa = x4[xb4 + k];
        let xb = x4[xb4 + 4u + k];
        s += nib4_$F(w, qh >> (4u * k)) * xa + nib4_$F(w >> 4u, qh >> (16u + 4u * k)) * xb;
        sx += xa + xb;
    }
    return vec2<f32>(hsum_$F(s), hsum_$F(sx));
}

// Q4_0: d · (Σ q·x − 8 Σ x).
fn dot_q4_0_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + u * 18u;
    let r = nib32_$F(o + 2u, 0u, xb4);
    return half_$F(o) * (r.x - 8.0 * r.y);
}

// Q4_1: d · Σ q·x + m · Σ x.
fn dot_q4_1_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + u * 20u;
    let r = nib32_$F(o + 4u, 0u, xb4);
    return half_$F(o) * r.x + half_$F(o + 2u) * r.y;
}

// Q5_0: d · (Σ q·x − 16 Σ x).
fn dot_q5_0_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + u * 22u;
    let r = nib32_$F(o + 6u, word_$F(o + 2u), xb4);
    return half_$F(o) * (r.x - 16.0 * r.y);
}

// Q5_1: d · Σ q·x + m · Σ x.
fn dot_q5_1_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + u * 24u;
    let r = nib32_$F(o + 8u, word_$F(o + 4u), xb4);
    return half_$F(o) * r.x + half_$F(o + 2u) * r.y;
}

// Q4_K: d·scale_j · Σ q·x − dmin·min_j · Σ x.
fn dot_q4_k_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + (u / 8u) * 144u;
    let j = u % 8u;
    let sm = scale_min_k4_$F(j, o + 4u);
    let q0 = o + 16u + 32u * (j / 2u);
    let shift = 4u * (j & 1u);
    var s = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    for (var k = 0u; k < 8u; k++) {
        let xv = x4[xb4 + k];
        s += nib4_$F(word_$F(q0 + 4u * k) >> shift, 0u) * xv;
        sx += xv;
    }
    return half_$F(o) * f32(sm.x) * hsum_$F(s) - half_$F(o + 2u) * f32(sm.y) * hsum_$F(sx);
}

// Q5_K: as Q4_K, the fifth bit of unit j's weight l being bit j of qh[l].
fn dot_q5_k_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + (u / 8u) * 176u;
    let j = u % 8u;
    let sm = scale_min_k4_$F(j, o + 4u);
    let q0 = o + 48u + 32u * (j / 2u);
    let shift = 4u * (j & 1u);
    var s = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    for (var k = 0u; k < 8u; k++) {
        let xv = x4[xb4 + k];
        let h = bits4_$F(word_$F(o + 16u + 4u * k) >> j);
        s += nib4_$F(word_$F(q0 + 4u * k) >> shift, h) * xv;
        sx += xv;
    }
    return half_$F(o) * f32(sm.x) * hsum_$F(s) - half_$F(o + 2u) * f32(sm.y) * hsum_$F(sx);
}

// Weights k0·4 .. k0·4 + 16 of a Q6_K unit: (Σ q·x, Σ x) over them, q unbiased.
fn q6_part_$F(ql: u32, qh: u32, lshift: u32, hshift: u32, xb4: u32, k0: u32) -> vec2<f32> {
    var s = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    for (var k = k0; k < k0 + 4u; k++) {
        let wl = word_$F(ql + 4u * k) >> lshift;
        let wh = word_$F(qh + 4u * k) >> hshift;
        let q = vec4<f32>(
            f32((wl & 15u) | ((wh & 3u) << 4u)),
            f32(((wl >> 8u) & 15u) | (((wh >> 8u) & 3u) << 4u)),
            f32(((wl >> 16u) & 15u) | (((wh >> 16u) & 3u) << 4u)),
            f32(((wl >> 24u) & 15u) | (((wh >> 24u) & 3u) << 4u)),
        );
        let xv = x4[xb4 + k];
        s += q * xv;
        sx += xv;
    }
    return vec2<f32>(hsum_$F(s), hsum_$F(sx));
}
// Q6_K: two 16-weight halves of a unit with a scale each: d · Σ_half scale · (Σ q·x − 32 Σ x).
fn dot_q6_k_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    let o = rb + (u / 8u) * 210u;
    let j = u % 8u;
    let hf = j / 4u;
    let g = j % 4u;
    let ql = o + 64u * hf + 32u * (g & 1u);
    let qh = o + 128u + 32u * hf;
    let sbase = o + 192u + 8u * hf + 2u * g;
    let a = q6_part_$F(ql, qh, 4u * (g >> 1u), 2u * g, xb4, 0u);
    let b = q6_part_$F(ql, qh, 4u * (g >> 1u), 2u * g, xb4, 4u);
    let s0 = f32(bitcast<i32>(byte_$F(sbase) << 24u) >> 24u);
    let s1 = f32(bitcast<i32>(byte_$F(sbase + 1u) << 24u) >> 24u);
    return half_$F(o + 208u) * (s0 * (a.x - 32.0 * a.y) + s1 * (b.x - 32.0 * b.y));
}

// Any type, through its dequantizer (quant.wgsl).
fn dot_dq_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    var w: array<f32, 32>;
    dequant_$F(rb, u, &w);
    var s = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        s += vec4<f32>(w[4u * i], w[4u * i + 1u], w[4u * i + 2u], w[4u * i + 3u]) * x4[xb4 + i];
    }
    return hsum_$F(s);
}

fn dot_$F(rb: u32, u: u32, xb4: u32) -> f32 {
    return dot_$D_$F(rb, u, xb4);
}

// This lane's share of row rb's dot with the row of x starting at xr: units lane, lane + LANES, ... A unit past
// the row's end (a float matrix whose rows are not a whole number of units, padded in buffers.rs) or activations
// that are not whole vec4s take the scalar loop.
fn row_dot_$F(rb: u32, xr: u32, lane: u32) -> f32 {
    var acc = 0.0;
    for (var u = lane; u < p.units; u += LANES) {
        if (u * 32u + 32u <= p.cols && (p.cols & 3u) == 0u) {
            acc += dot_$F(rb, u, (xr + u * 32u) >> 2u);
        } else {
            var w: array<f32, 32>;
            dequant_$F(rb, u, &w);
            for (var i = 0u; i < min(32u, p.cols - u * 32u); i++) {
                acc += w[i] * x[xr + u * 32u + i];
            }
        }
    }
    return acc;
}
