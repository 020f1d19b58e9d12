// y[t, row0 + r] = W[r, :] · x[t, :] over quantized weights (quant.wgsl), f32 activations and f32 sums: W is one
// part of a matrix (rows row0.. of it, see buffers.rs), y has rows of y_stride values.
//
// A workgroup of 64 threads takes RPW = 64 / LANES weight rows for up to TT = 8 tokens: LANES threads per row walk
// the row's 32-weight units, each unit dequantized once and dotted with every token's activations (so a prefill
// reads the weights once per 8 tokens, a decode step once), then the lanes' sums are added in workgroup memory.
// LANES is 16 on a GPU (threads of a row read neighbouring blocks) and 1 on a software adapter, where a barrier
// costs more than a whole row's work. The workgroup grid is (x, y) over the row groups (index wid.x + wid.y·nx, see
// device::grid) and z over the token tiles.

override LANES: u32 = 16u;
override RPW: u32 = 4u;
const TT: u32 = 8u;

var<workgroup> red_a: array<f32, 512>;
var<workgroup> red_b: array<f32, 512>;

// Row `row`'s dot products with tokens t0.. (nt of them) of one unit.
fn dot_unit(w: ptr<function, array<f32, 32>>, u: u32, t0: u32, nt: u32, acc: ptr<function, array<f32, 8>>) {
    for (var t = 0u; t < TT; t++) {
        if (t < nt) {
            let xb = (t0 + t) * p.cols + u * 32u;
            var s = 0.0;
            for (var i = 0u; i < 32u; i++) {
                s += (*w)[i] * x[xb + i];
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
