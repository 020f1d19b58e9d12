// The tiled y[t, row0 + r] = W[r, :] · x[t, :] for batches of many tokens (prefill), over the same quantized
// weights (quant.wgsl) and parameters (matmul_io.wgsl) as matmul.wgsl, which stays the decode kernel (up to 8 tokens).
//
// A workgroup of 64 threads owns a tile of BM weight rows × BN = 32 tokens and walks the columns one 32-weight unit
// (the K-chunk) at a time: each thread dequantizes one row's unit into workgroup memory (ws) and loads 16 of the
// tile's activations (xs), so each weight is dequantized once per 32 tokens and each activation read once per BM
// rows; after a barrier each thread multiplies its 4 rows × 8 tokens (matmul, BM = 64) or 4 rows × 4 tokens of
// both gate and up (matmul_glu, BM = 32 rows of each) out of workgroup memory into registers. Rows and tokens past
// the matrix or the batch are zeros in the tiles and are not written. A thread's rows and tokens are strided (tr +
// 16i, tc + 4j) and the tiles' rows padded to 33 floats, so neighbouring threads read different memory banks.
// The grid: (x, y) over the row tiles (index wid.x + wid.y·nx, see device::grid), z over the token tiles.

const BN: u32 = 32u;
const S: u32 = 33u;

// 64 weight rows (matmul; matmul_glu: gate rows in slots 0..32, up rows in 32..64) and 32 tokens, one unit each.
var<workgroup> ws: array<f32, 2112>;
var<workgroup> xs: array<f32, 1056>;

// Unit u of the activations of tokens t0..t0 + 32 into xs, 16 values per thread, zeros past the batch and past a
// row (a float matrix's last unit may be padding, buffers.rs).
fn load_x(li: u32, t0: u32, u: u32) {
    for (var m = 0u; m < 16u; m++) {
        let i = li + 64u * m;
        let t = i / 32u;
        let k = i % 32u;
        var v = 0.0;
        if (t0 + t < p.n_tok && u * 32u + k < p.cols) {
            v = x[(t0 + t) * p.cols + u * 32u + k];
        }
        xs[t * S + k] = v;
    }
}

// A dequantized unit into tile row `slot` of ws.
fn store_w(slot: u32, w: ptr<function, array<f32, 32>>) {
    for (var k = 0u; k < 32u; k++) {
        ws[slot * S + k] = (*w)[k];
    }
}

@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r0 = (wid.x + wid.y * p.nx) * 64u;
    let t0 = wid.z * BN;
    let tr = li % 16u;
    let tc = li / 16u;
    // c[j] holds the thread's 4 rows (tr + 16i) for token tc + 4j: plain vector variables, which every compiler
    // keeps in registers (an indexed function array may go to memory, one load and store per product).
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0);
    var c5 = vec4<f32>(0.0);
    var c6 = vec4<f32>(0.0);
    var c7 = vec4<f32>(0.0);
    for (var u = 0u; u < p.units; u++) {
        var w: array<f32, 32>;
        if (r0 + li < p.rows) {
            dequant_a((r0 + li) * p.row_bytes, u, &w);
        }
        store_w(li, &w);
        load_x(li, t0, u);
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            let a = vec4<f32>(ws[tr * S + k], ws[(tr + 16u) * S + k], ws[(tr + 32u) * S + k], ws[(tr + 48u) * S + k]);
            c0 += a * xs[tc * S + k];
            c1 += a * xs[(tc + 4u) * S + k];
            c2 += a * xs[(tc + 8u) * S + k];
            c3 += a * xs[(tc + 12u) * S + k];
            c4 += a * xs[(tc + 16u) * S + k];
            c5 += a * xs[(tc + 20u) * S + k];
            c6 += a * xs[(tc + 24u) * S + k];
            c7 += a * xs[(tc + 28u) * S + k];
        }
        workgroupBarrier();
    }
    store_tile(r0 + tr, t0 + tc, c0, c1, c2, c3, c4, c5, c6, c7);
}

// A thread's 4 rows (row + 16i) × 8 tokens (tok + 4j) of y, those inside the matrix and the batch.
fn store_tile(row: u32, tok: u32, c0: vec4<f32>, c1: vec4<f32>, c2: vec4<f32>, c3: vec4<f32>, c4: vec4<f32>,
              c5: vec4<f32>, c6: vec4<f32>, c7: vec4<f32>) {
    let c = array<vec4<f32>, 8>(c0, c1, c2, c3, c4, c5, c6, c7);
    for (var j = 0u; j < 8u; j++) {
        let t = tok + 4u * j;
        for (var i = 0u; i < 4u; i++) {
            if (row + 16u * i < p.rows && t < p.n_tok) {
                y[t * p.y_stride + p.row0 + row + 16u * i] = c[j][i];
            }
        }
    }
}

// y[t, r] = act(G[r, :]·x[t, :]) · (U[r, :]·x[t, :]), gate in wa, up in wb (of one type), 32 rows of each a tile:
// threads 0..32 dequantize the gate's rows, 32..64 the up's, and each thread sums rows tr + 8i × tokens tc + 8j.
@compute @workgroup_size(64)
fn matmul_glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r0 = (wid.x + wid.y * p.nx) * 32u;
    let t0 = wid.z * BN;
    let tr = li % 8u;
    let tc = li / 8u;
    // g[j] / v[j]: the gate's and the up's 4 rows (tr + 8i) for token tc + 8j, in registers as in matmul.
    var g0 = vec4<f32>(0.0);
    var g1 = vec4<f32>(0.0);
    var g2 = vec4<f32>(0.0);
    var g3 = vec4<f32>(0.0);
    var v0 = vec4<f32>(0.0);
    var v1 = vec4<f32>(0.0);
    var v2 = vec4<f32>(0.0);
    var v3 = vec4<f32>(0.0);
    for (var u = 0u; u < p.units; u++) {
        var w: array<f32, 32>;
        let row = r0 + li % 32u;
        if (row < p.rows) {
            if (li < 32u) {
                dequant_a(row * p.row_bytes, u, &w);
            } else {
                dequant_b(row * p.row_bytes, u, &w);
            }
        }
        store_w(li, &w);
        load_x(li, t0, u);
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            let a = vec4<f32>(ws[tr * S + k], ws[(tr + 8u) * S + k], ws[(tr + 16u) * S + k], ws[(tr + 24u) * S + k]);
            let b = vec4<f32>(ws[(32u + tr) * S + k], ws[(40u + tr) * S + k], ws[(48u + tr) * S + k],
                              ws[(56u + tr) * S + k]);
            let x0 = xs[tc * S + k];
            let x1 = xs[(tc + 8u) * S + k];
            let x2 = xs[(tc + 16u) * S + k];
            let x3 = xs[(tc + 24u) * S + k];
            g0 += a * x0;
            g1 += a * x1;
            g2 += a * x2;
            g3 += a * x3;
            v0 += b * x0;
            v1 += b * x1;
            v2 += b * x2;
            v3 += b * x3;
        }
        workgroupBarrier();
    }
    let g = array<vec4<f32>, 4>(g0, g1, g2, g3);
    let v = array<vec4<f32>, 4>(v0, v1, v2, v3);
    for (var i = 0u; i < 4u; i++) {
        let row = r0 + tr + 8u * i;
        for (var j = 0u; j < 4u; j++) {
            let t = t0 + tc + 8u * j;
            if (row < p.rows && t < p.n_tok) {
                y[t * p.y_stride + p.row0 + row] = glu(p.act, g[j][i], v[j][i]);
            }
        }
    }
}
