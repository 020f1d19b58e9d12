// y[t, row0 + r] = W[r, :] · x[t, :] over quantized weights (quant.wgsl, dot.wgsl), f32 activations and f32 sums:
// W is one part of a matrix (rows row0.. of it, see buffers.rs), y has rows of y_stride values.
//
// A workgroup of 64 threads takes RPW = 64 / LANES weight rows for up to TT = 8 tokens: LANES threads per row walk
// the row's 32-weight units, then the lanes' sums are added in workgroup memory. For one token (matvec) each unit
// is dotted straight from its block (dot.wgsl), and where the type has a part walk each thread takes MROWS rows
// (RPW = 64 / LANES · MROWS), dotting the activations it loads with all of them; for several tokens (matmul) a unit
// is dequantized once into an array and dotted with every token's activations, so the weights are decoded once per
// 8 tokens. LANES is 32 on a GPU (threads of a row read neighbouring blocks) and 1 on a software adapter, where a
// barrier costs more than a whole row's work. The workgroup grid is (x, y) over the row groups (index wid.x + wid.y·nx, see device::grid) and z
// over the token tiles. Batches from TILED_MIN tokens on take matmul_tiled.wgsl.

override LANES: u32 = 16u;
// Rows a thread of the mat-vecs (matvec, matvec_glu and the indexed matmul_ids, matmul_glu_ids) takes, sharing
// each block's activation loads among them (dot.wgsl's part walk); 1 for the several-token kernels. RPW = 64 / LANES · MROWS rows a workgroup.
override MROWS: u32 = 1u;
override RPW: u32 = 4u;
const TT: u32 = 8u;

var<workgroup> red_a: array<f32, 512>;
var<workgroup> red_b: array<f32, 512>;

// The activations again, as vectors (x's buffer at a second binding, matmul.rs): a unit's 32 values are 8 loads,
// not 32. The lanes of a row read units 128 bytes apart, so each load instruction touches as many cache lines
// whatever its width: a quarter of the instructions is a quarter of the traffic.
@group(0) @binding(7) var<storage, read> x4: array<vec4<f32>>;

// Row `row`'s dot products with tokens t0.. (nt of them) of one unit.
fn dot_unit(w: ptr<function, array<f32, 32>>, u: u32, t0: u32, nt: u32, acc: ptr<function, array<f32, 8>>) {
    for (var t = 0u; t < TT; t++) {
        if (t < nt) {
            let xb = (t0 + t) * p.cols + u * 32u;
            var s = 0.0;
            if (u * 32u + 32u <= p.cols && (p.cols & 3u) == 0u) {
                var s4 = vec4<f32>(0.0);
                for (var i = 0u; i < 8u; i++) {
                    let wv = vec4<f32>((*w)[4u * i], (*w)[4u * i + 1u], (*w)[4u * i + 2u], (*w)[4u * i + 3u]);
                    s4 += wv * x4[(xb >> 2u) + i];
                }
                s = (s4.x + s4.y) + (s4.z + s4.w);
            } else {
                // Rows whose length is not a multiple of 4, or a float matrix's last unit padded past the row
                // (buffers.rs).
                for (var i = 0u; i < min(32u, p.cols - u * 32u); i++) {
                    s += (*w)[i] * x[xb + i];
                }
            }
            (*acc)[t] += s;
        }
    }
}

@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let row = (wid.x + wid.y * p.nx) * RPW + li / LANES;
    let t0 = wid.z * TT;
    let nt = min(TT, p.n_tok - t0);
    var acc: array<f32, 8>;
    if (row < p.rows) {
        let rb = row * p.row_bytes;
        for (var u = lane; u < p.units; u += LANES) {
            var w: array<f32, 32>;
            dequant_a(rb, u, &w);
            dot_unit(&w, u, t0, nt, &acc);
        }
    }
    if (LANES == 1u) {
        if (row < p.rows) {
            for (var t = 0u; t < nt; t++) {
                y[(t0 + t) * p.y_stride + p.row0 + row] = acc[t];
            }
        }
        return;
    }
    for (var t = 0u; t < TT; t++) {
        red_a[li * TT + t] = acc[t];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            for (var t = 0u; t < TT; t++) {
                red_a[li * TT + t] += red_a[(li + s) * TT + t];
            }
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        for (var t = 0u; t < nt; t++) {
            y[(t0 + t) * p.y_stride + p.row0 + row] = red_a[li * TT + t];
        }
    }
}

// The gated feed-forward's first half: y[t, r] = act(G[r, :]·x[t, :]) · (U[r, :]·x[t, :]), gate in wa, up in wb
// (both of the same type).
@compute @workgroup_size(64)
fn matmul_glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let row = (wid.x + wid.y * p.nx) * RPW + li / LANES;
    let t0 = wid.z * TT;
    let nt = min(TT, p.n_tok - t0);
    var acc_g: array<f32, 8>;
    var acc_u: array<f32, 8>;
    if (row < p.rows) {
        let rb = row * p.row_bytes;
        for (var u = lane; u < p.units; u += LANES) {
            var w: array<f32, 32>;
            dequant_a(rb, u, &w);
            dot_unit(&w, u, t0, nt, &acc_g);
            dequant_b(rb, u, &w);
            dot_unit(&w, u, t0, nt, &acc_u);
        }
    }
    if (LANES == 1u) {
        if (row < p.rows) {
            for (var t = 0u; t < nt; t++) {
                y[(t0 + t) * p.y_stride + p.row0 + row] = glu(p.act, acc_g[t], acc_u[t]);
            }
        }
        return;
    }
    for (var t = 0u; t < TT; t++) {
        red_a[li * TT + t] = acc_g[t];
        red_b[li * TT + t] = acc_u[t];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            for (var t = 0u; t < TT; t++) {
                red_a[li * TT + t] += red_a[(li + s) * TT + t];
                red_b[li * TT + t] += red_b[(li + s) * TT + t];
            }
        }
        workgroupBarrier();
    }
    if (lane == 0u && row < p.rows) {
        for (var t = 0u; t < nt; t++) {
            y[(t0 + t) * p.y_stride + p.row0 + row] = glu(p.act, red_a[li * TT + t], red_b[li * TT + t]);
        }
    }
}

// Sums a thread's row sums (column 0: matrix a's, column 1: b's where `both`; component r < MROWS: its row r's)
// over the LANES threads of its rows, for the rows' lane 0: every thread of the workgroup calls it (it may hold
// barriers). Runs of min(LANES, SG) lanes add by subgroup shuffles (subgroup.wgsl; none where SG = 0); what is
// left, the runs' sums, by a tree in workgroup memory. On a GPU whose subgroups are 32 wide a row of 32 lanes
// takes no barrier.
fn lanes_sum(li: u32, v: mat2x4<f32>, both: bool) -> mat2x4<f32> {
    if (LANES == 1u) {
        return v;
    }
    let w = max(min(LANES, SG), 1u);
    var s = v;
    if (w > 1u) {
        for (var r = 0u; r < MROWS; r++) {
            s[0][r] = run_sum(v[0][r], w);
            if (both) {
                s[1][r] = run_sum(v[1][r], w);
            }
        }
        if (w == LANES) {
            return s;
        }
    }
    // Each thread's rows at 4·li.. of red_a (matrix a) and red_b (b).
    let lane = li % LANES;
    for (var r = 0u; r < MROWS; r++) {
        red_a[li * 4u + r] = s[0][r];
        red_b[li * 4u + r] = s[1][r];
    }
    workgroupBarrier();
    for (var k = LANES / 2u; k >= w; k = k / 2u) {
        if (lane < k) {
            for (var r = 0u; r < MROWS; r++) {
                red_a[li * 4u + r] += red_a[(li + k) * 4u + r];
                if (both) {
                    red_b[li * 4u + r] += red_b[(li + k) * 4u + r];
                }
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < MROWS; r++) {
        s[0][r] = red_a[li * 4u + r];
        s[1][r] = red_b[li * 4u + r];
    }
    return s;
}

// What a decode step's mat-vec does around its dot products, so that the RMSNorm before it and the residual add
// after it are not dispatches of their own (matmul.rs, `Fuse`): 0 nothing; 1 (NORM) the input row is the residual
// stream times the norm's weights (written so by the mat-vec before, 3), and the row's 1 / rms, taken from the
// residual stream at binding 8 by each workgroup (the same f32 sum in every one), scales the products; 2 (ADD) the
// products are added into y, the residual stream, rather than written; 3 (ADD and WEIGH) also the new residual
// times the next norm's weights (binding 8) into binding 9, the next mat-vec's input under NORM.
override FUSE: u32 = 0u;
const WG: u32 = 64u;

@group(0) @binding(8) var<storage, read> aux: array<f32>;
@group(0) @binding(9) var<storage, read_write> weighed: array<f32>;

// The RMSNorm's 1 / rms of the residual row at binding 8 (p.cols values) under NORM, else 1; every thread calls it.
fn norm_scale(li: u32) -> f32 {
    if (FUSE != 1u) {
        return 1.0;
    }
    var part = 0.0;
    for (var i = li; i < p.cols; i += WG) {
        let v = aux[i];
        part += v * v;
    }
    return 1.0 / sqrt(reduce_sum(li, part) / f32(p.cols) + p.eps);
}

// Row `row`'s result `v` into y: written, or added to it (ADD), and the sum weighed into `weighed` (WEIGH).
fn put(row: u32, v: f32) {
    let r = p.row0 + row;
    if (FUSE == 2u || FUSE == 3u) {
        let s = y[r] + v;
        y[r] = s;
        if (FUSE == 3u) {
            weighed[r] = s * aux[r];
        }
    } else {
        y[r] = v;
    }
}

// This thread's first row in a decode mat-vec, and how many of its MROWS rows the matrix has (0 past its end).
fn thread_rows(wid: vec3<u32>, li: u32) -> vec2<u32> {
    let row = (wid.x + wid.y * p.nx) * RPW + (li / LANES) * MROWS;
    if (row >= p.rows) {
        return vec2<u32>(row, 0u);
    }
    return vec2<u32>(row, min(MROWS, p.rows - row));
}

// A decode step's mat-vec (one token) of matrix a, or where `glu` the gated feed-forward's first half,
// y[r] = act(G[r, :]·x) · (U[r, :]·x) with the gate in a and up in b: each unit dotted straight from its block
// (dot.wgsl), no array. Every thread of the workgroup calls it (lanes_sum may hold barriers).
fn matvec_rows(wid: vec3<u32>, li: u32, glu_up: bool) {
    let scale = norm_scale(li);
    let rows = thread_rows(wid, li);
    var d = mat2x4<f32>();
    if (rows.y > 0u) {
        d = rows_dot(rows.x * p.row_bytes, 0u, li % LANES, rows.y, glu_up);
    }
    let s = lanes_sum(li, d, glu_up);
    if (li % LANES == 0u) {
        for (var r = 0u; r < rows.y; r++) {
            if (glu_up) {
                put(rows.x + r, glu(p.act, s[0][r] * scale, s[1][r] * scale));
            } else {
                put(rows.x + r, s[0][r] * scale);
            }
        }
    }
}

@compute @workgroup_size(64)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    matvec_rows(wid, li, false);
}

@compute @workgroup_size(64)
fn matvec_glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    matvec_rows(wid, li, true);
}

// The indexed mat-vecs of a mixture of experts: W is a 3-D expert tensor as its 2-D view (expert e's matrix is
// rows e·R..(e+1)·R, R = p.y_stride) or one part of it (rows row0..row0 + rows of the view). Workgroup z takes one
// pick (a row's slot): its expert comes from ids[z], written on the device by the routing (route.wgsl), and its
// input is row z / p.x_div of x (x_div = k: the picks of a token share its input; 1: each pick has its own, the
// down projection's). y[z, r] = W_e[r, :] · x[z / x_div, :], for the R rows of the expert that this part holds.

@group(0) @binding(6) var<storage, read> ids: array<u32>;

// This thread's rows of pick z's expert that this part holds, of the expert's rows r..r + MROWS (r from the grid,
// as thread_rows): the first as a row of the expert and as a row of this part's buffer, and how many (0: none).
// The expert's rows are consecutive in the view, so the rows a part holds are one run; where a part's boundary falls
// inside a thread's rows, each part's dispatch takes its side of it.
fn pick_rows(wid: vec3<u32>, li: u32, z: u32) -> vec3<u32> {
    let r = (wid.x + wid.y * p.nx) * RPW + (li / LANES) * MROWS;
    let base = ids[z] * p.y_stride;
    let lo = max(base + r, p.row0);
    let hi = min(base + min(r + MROWS, p.y_stride), p.row0 + p.rows);
    if (r >= p.y_stride || lo >= hi) {
        return vec3<u32>(0u);
    }
    return vec3<u32>(lo - base, lo - p.row0, hi - lo);
}

// Pick z = wid.z's mat-vec of its expert, or where `glu_up` the gated feed-forward's first half (gate in a, up in
// b), its rows as a decode mat-vec's (matvec_rows). Every thread of the workgroup calls it.
fn pick_matvec(wid: vec3<u32>, li: u32, glu_up: bool) {
    let z = wid.z;
    let rows = pick_rows(wid, li, z);
    var d = mat2x4<f32>();
    if (rows.z > 0u) {
        d = rows_dot(rows.y * p.row_bytes, (z / p.x_div) * p.cols, li % LANES, rows.z, glu_up);
    }
    let s = lanes_sum(li, d, glu_up);
    if (li % LANES == 0u) {
        for (var i = 0u; i < rows.z; i++) {
            let at = z * p.y_stride + rows.x + i;
            if (glu_up) {
                y[at] = glu(p.act, s[0][i], s[1][i]);
            } else {
                y[at] = s[0][i];
            }
        }
    }
}

@compute @workgroup_size(64)
fn matmul_ids(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    pick_matvec(wid, li, false);
}

// The experts' gate and up projections together: y[z, r] = act(G_e[r, :]·x) · (U_e[r, :]·x), gate in wa, up in wb.
@compute @workgroup_size(64)
fn matmul_glu_ids(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    pick_matvec(wid, li, true);
}
