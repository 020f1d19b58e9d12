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

// A block dotted by PARTS lanes together (the mat-vecs on a GPU, LANES >= PARTS): part t of a block reads the
// words t, t + PARTS, ... of each of its runs of quants, so the lanes of a load read one run of neighbouring words.
// The unit walk above gives each lane a whole 32-weight unit: a load of its lanes touches as many cache sectors as
// it has lanes, and a Q4_K unit reads both nibbles of a word to keep one (measured on an H200: 270-580 GB/s for a
// Q4_K or Q6_K mat-vec, docs/gpu.md). A part's activations are loaded once (acts_*) and dotted with the same part
// of every row the thread takes (matmul.wgsl's MROWS), as llama.cpp's mat-vecs share theirs across 2 rows:
// pdot_<type>_$F(o, t, a) is part t's share of the block at byte o, given its activations a.

// Up to four runs of 4 activations a part dots with, and the sum of each run (for the types' offsets and mins).
struct Acts {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
    s: vec4<f32>,
}

// Four runs of activations and their sums.
fn acts4(x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>) -> Acts {
    let one = vec4<f32>(1.0);
    return Acts(x0, x1, x2, x3, vec4<f32>(dot(x0, one), dot(x1, one), dot(x2, one), dot(x3, one)));
}

// Q4_K and Q5_K, part t = 8c + l: activations 4l.. of units 2c, 2c + 1, 2c + 4, 2c + 5 of the block at x4[xb4].
fn acts_k4(t: u32, xb4: u32) -> Acts {
    let xi = xb4 + 16u * (t / 8u) + t % 8u;
    return acts4(x4[xi], x4[xi + 8u], x4[xi + 32u], x4[xi + 40u]);
}

// Q6_K, part t = 8h + l: activations 4l.. of the four 32-weight groups of half h.
fn acts_q6_k(t: u32, xb4: u32) -> Acts {
    let xi = xb4 + 32u * (t / 8u) + t % 8u;
    return acts4(x4[xi], x4[xi + 8u], x4[xi + 16u], x4[xi + 24u]);
}

// The 32-weight blocks, 4 parts: part t takes activations 4t.. (x0) and 16 + 4t.. (x1); s.x sums both.
fn acts_b32(t: u32, xb4: u32) -> Acts {
    let x0 = x4[xb4 + t];
    let x1 = x4[xb4 + 4u + t];
    let one = vec4<f32>(1.0);
    return Acts(x0, x1, vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(dot(x0 + x1, one), 0.0, 0.0, 0.0));
}

// Q4_K, 16 parts: part t = 8c + l takes word l of the 32-byte runs 2c and 2c + 1 of qs, holding weights 4l.. of
// units 2c, 2c + 1 (low, high nibbles) and 2c + 4, 2c + 5 (c = 0, 1).
fn pdot_q4_k_$F(o: u32, t: u32, a: Acts) -> f32 {
    let qa = word_$F(o + 16u + 4u * t);
    let qb = word_$F(o + 80u + 4u * t);
    let sm = k4_scales_$F(o, t / 8u);
    let dots = vec4<f32>(dot(nib4_$F(qa, 0u), a.x0), dot(nib4_$F(qa >> 4u, 0u), a.x1), dot(nib4_$F(qb, 0u), a.x2),
                         dot(nib4_$F(qb >> 4u, 0u), a.x3));
    return half_$F(o) * dot(sm[0], dots) - half_$F(o + 2u) * dot(sm[1], a.s);
}

// Q5_K, 16 parts as Q4_K's, the fifth bits of weights 4l.. of unit j in bit j of the qh word l.
fn pdot_q5_k_$F(o: u32, t: u32, a: Acts) -> f32 {
    let c = t / 8u;
    let qa = word_$F(o + 48u + 4u * t);
    let qb = word_$F(o + 112u + 4u * t);
    let h = word_$F(o + 16u + 4u * (t % 8u)) >> (2u * c);
    let sm = k4_scales_$F(o, c);
    let dots = vec4<f32>(dot(nib4_$F(qa, bits4_$F(h)), a.x0), dot(nib4_$F(qa >> 4u, bits4_$F(h >> 1u)), a.x1),
                         dot(nib4_$F(qb, bits4_$F(h >> 4u)), a.x2), dot(nib4_$F(qb >> 4u, bits4_$F(h >> 5u)), a.x3));
    return half_$F(o) * dot(sm[0], dots) - half_$F(o + 2u) * dot(sm[1], a.s);
}

// The 6-bit scales and mins of units 2c, 2c + 1, 2c + 4, 2c + 5 of the Q4_K / Q5_K block at byte o, as
// (scales, mins): the three words of scales[12] read once, both bytes of a pair taken together.
fn k4_scales_$F(o: u32, c: u32) -> mat2x4<f32> {
    let sh = 16u * c;
    let a = (word_$F(o + 4u) >> sh) & 0xffffu;
    let b = (word_$F(o + 8u) >> sh) & 0xffffu;
    let e = (word_$F(o + 12u) >> sh) & 0xffffu;
    let sc = vec2<u32>(a & 0x3f3fu, (e & 0x0f0fu) | ((a & 0xc0c0u) >> 2u));
    let mn = vec2<u32>(b & 0x3f3fu, ((e >> 4u) & 0x0f0fu) | ((b & 0xc0c0u) >> 2u));
    return mat2x4<f32>(
        vec4<f32>(f32(sc.x & 0xffu), f32(sc.x >> 8u), f32(sc.y & 0xffu), f32(sc.y >> 8u)),
        vec4<f32>(f32(mn.x & 0xffu), f32(mn.x >> 8u), f32(mn.y & 0xffu), f32(mn.y >> 8u)),
    );
}

// Q6_K's 4 quants of a word: 4 bits from each byte of ql, 2 from each byte of qh (both already shifted), unbiased
// later.
fn q6_quads_$F(ql: u32, qh: u32) -> vec4<f32> {
    return vec4<f32>(
        f32((ql & 15u) | ((qh & 3u) << 4u)),
        f32(((ql >> 8u) & 15u) | (((qh >> 8u) & 3u) << 4u)),
        f32(((ql >> 16u) & 15u) | (((qh >> 16u) & 3u) << 4u)),
        f32(((ql >> 24u) & 15u) | (((qh >> 24u) & 3u) << 4u)),
    );
}

// A Q6_K scale, a signed byte.
fn q6_scale_$F(at: u32) -> f32 {
    return f32(bitcast<i32>(byte_$F(at) << 24u) >> 24u);
}

// Q6_K, 16 parts: part t = 8h + l takes words l of half h's two 32-byte runs of ql and of its qh: weights 4l.. of
// the half's four 32-weight groups g (low nibbles of run 0 for g = 0, run 1 for g = 1, high ones for 2 and 3; bits
// 2g of qh), scaled by scales[8h + l/4 + 2g].
fn pdot_q6_k_$F(o: u32, t: u32, a: Acts) -> f32 {
    let hf = t / 8u;
    let l = t % 8u;
    let qa = word_$F(o + 64u * hf + 4u * l);
    let qb = word_$F(o + 64u * hf + 32u + 4u * l);
    let qh = word_$F(o + 128u + 32u * hf + 4u * l);
    let dots = vec4<f32>(dot(q6_quads_$F(qa, qh), a.x0), dot(q6_quads_$F(qb, qh >> 2u), a.x1),
                         dot(q6_quads_$F(qa >> 4u, qh >> 4u), a.x2), dot(q6_quads_$F(qb >> 4u, qh >> 6u), a.x3));
    let sb = o + 192u + 8u * hf + l / 4u;
    let sc = vec4<f32>(q6_scale_$F(sb), q6_scale_$F(sb + 2u), q6_scale_$F(sb + 4u), q6_scale_$F(sb + 6u));
    return half_$F(o + 208u) * dot(sc, dots - 32.0 * a.s);
}

// Q8_0, 4 parts: part t takes words t and t + 4 of qs, weights 4t.. and 16 + 4t...
fn pdot_q8_0_$F(o: u32, t: u32, a: Acts) -> f32 {
    return half_$F(o) * (dot(i8x4_$F(word_$F(o + 2u + 4u * t)), a.x0) + dot(i8x4_$F(word_$F(o + 18u + 4u * t)), a.x1));
}

// Σ q·x over part t's 8 weights of a 32-weight block whose nibbles start at byte qs (byte j: weight j low, j + 16
// high, as Q4_0's), the fifth bit of weight j being bit j of qh (0 for the 4-bit types).
fn pnib_$F(qs: u32, qh: u32, t: u32, a: Acts) -> f32 {
    let w = word_$F(qs + 4u * t);
    return dot(nib4_$F(w, qh >> (4u * t)), a.x0) + dot(nib4_$F(w >> 4u, qh >> (16u + 4u * t)), a.x1);
}

// Q4_0, 4 parts: d · (Σ q·x − 8 Σ x).
fn pdot_q4_0_$F(o: u32, t: u32, a: Acts) -> f32 {
    return half_$F(o) * (pnib_$F(o + 2u, 0u, t, a) - 8.0 * a.s.x);
}

// Q4_1, 4 parts: d · Σ q·x + m · Σ x.
fn pdot_q4_1_$F(o: u32, t: u32, a: Acts) -> f32 {
    return half_$F(o) * pnib_$F(o + 4u, 0u, t, a) + half_$F(o + 2u) * a.s.x;
}

// Q5_0, 4 parts: d · (Σ q·x − 16 Σ x).
fn pdot_q5_0_$F(o: u32, t: u32, a: Acts) -> f32 {
    return half_$F(o) * (pnib_$F(o + 6u, word_$F(o + 2u), t, a) - 16.0 * a.s.x);
}

// Q5_1, 4 parts: d · Σ q·x + m · Σ x.
fn pdot_q5_1_$F(o: u32, t: u32, a: Acts) -> f32 {
    return half_$F(o) * pnib_$F(o + 8u, word_$F(o + 4u), t, a) + half_$F(o + 2u) * a.s.x;
}

// The part walk for a thread's nr (<= MROWS) rows at rb, rb + p.row_bytes, ... of matrix a and, where `both`, of
// b, with the row of x at xr: blocks lane / PARTS, + LANES / PARTS, ..., part lane % PARTS of each (PARTS, the
// block's BLOCK_W weights and BLOCK_BYTES bytes, and its acts_$A and pdot_$P set by matmul.rs). Column 0 of the
// result holds a's sums, column 1 b's; component r row r's.
fn rows_dot_parts(rb: u32, xr: u32, lane: u32, nr: u32, both: bool) -> mat2x4<f32> {
    var s = mat2x4<f32>();
    let t = lane % PARTS;
    for (var b = lane / PARTS; b < p.cols / BLOCK_W; b += LANES / PARTS) {
        let a = acts_$A(t, (xr + b * BLOCK_W) >> 2u);
        for (var r = 0u; r < MROWS; r++) {
            if (r < nr) {
                let o = rb + r * p.row_bytes + b * BLOCK_BYTES;
                s[0][r] += pdot_$P_a(o, t, a);
                if (both) {
                    s[1][r] += pdot_$P_b(o, t, a);
                }
            }
        }
    }
    return s;
}

// The unit walk for the same rows, each row on its own (row_dot_units_*): the types and shapes without a part walk.
fn rows_dot_units(rb: u32, xr: u32, lane: u32, nr: u32, both: bool) -> mat2x4<f32> {
    var s = mat2x4<f32>();
    for (var r = 0u; r < MROWS; r++) {
        if (r < nr) {
            let o = rb + r * p.row_bytes;
            s[0][r] = row_dot_units_a(o, xr, lane);
            if (both) {
                s[1][r] = row_dot_units_b(o, xr, lane);
            }
        }
    }
    return s;
}

// This lane's share of row rb's dot with the row of x starting at xr: units lane, lane + LANES, ... A unit past
// the row's end (a float matrix whose rows are not a whole number of units, padded in buffers.rs) or activations
// that are not whole vec4s take the scalar loop.
fn row_dot_units_$F(rb: u32, xr: u32, lane: u32) -> f32 {
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
