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
    var acc: array<f32, 32>;
    for (var u = 0u; u < p.units; u++) {
        var w: array<f32, 32>;
        if (r0 + li < p.rows) {
            dequant_a((r0 + li) * p.row_bytes, u, &w);
        }
        store_w(li, &w);
        load_x(li, t0, u);
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            var a: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                a[i] = ws[(tr + 16u * i) * S + k];
            }
            for (var j = 0u; j < 8u; j++) {
                let b = xs[(tc + 4u * j) * S + k];
                for (var i = 0u; i < 4u; i++) {
                    acc[i * 8u + j] += a[i] * b;
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = r0 + tr + 16u * i;
        for (var j = 0u; j < 8u; j++) {
            let t = t0 + tc + 4u * j;
            if (row < p.rows && t < p.n_tok) {
                y[t * p.y_stride + p.row0 + row] = acc[i * 8u + j];
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
    var acc_g: array<f32, 16>;
    var acc_u: array<f32, 16>;
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
            var g: array<f32, 4>;
            var v: array<f32, 4>;
            for (var i = 0u; i < 4u; i++) {
                g[i] = ws[(tr + 8u * i) * S + k];
                v[i] = ws[(32u + tr + 8u * i) * S + k];
            }
            for (var j = 0u; j < 4u; j++) {
                let b = xs[(tc + 8u * j) * S + k];
                for (var i = 0u; i < 4u; i++) {
                    acc_g[i * 4u + j] += g[i] * b;
                    acc_u[i * 4u + j] += v[i] * b;
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = r0 + tr + 8u * i;
        for (var j = 0u; j < 4u; j++) {
            let t = t0 + tc + 8u * j;
            if (row < p.rows && t < p.n_tok) {
                y[t * p.y_stride + p.row0 + row] = glu(p.act, acc_g[i * 4u + j], acc_u[i * 4u + j]);
            }
        }
    }
}
