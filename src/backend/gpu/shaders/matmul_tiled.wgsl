// The tiled y[t, row0 + r] = W[r, :] · x[t, :] for batches of many tokens (prefill), over the same quantized
// weights (quant.wgsl) and parameters (matmul_io.wgsl) as matmul.wgsl, which keeps the mat-vec and small batches.
//
// A workgroup of 64 threads owns a tile of 64 weight rows × 64 tokens (matmul_glu: 32 gate rows and the same 32
// up rows) and walks the columns one 32-weight unit (the K-chunk) at a time: each thread dequantizes one row's unit
// into workgroup memory (ws) and loads 8 vec4s of the tile's activations (xs); after a barrier each thread multiplies
// its 8 rows × 8 tokens out of workgroup memory into 16 vec4 registers: per column, 4 vec4 loads for 64
// multiply-adds (the previous 64 × 32 tile with 4 × 8 a thread took 12 scalar loads for 32). Each weight is
// dequantized once per 64 tokens, each activation read once per 64 rows. Rows and tokens past the matrix or the
// batch are zeros in the tiles and are not written.
// The grid: (x, y) over the row tiles (index wid.x + wid.y·nx, see device::grid), z over the token tiles and, for
// a plain matmul with few tiles, the column slices (p.k_split, "split-K": a 2048-row matrix at 512 tokens has only
// 256 tiles, 2 warps each, too few to keep a large GPU's memory busy). A slice's partial products go to y as
// [slice, token, row] (the host binds a scratch tensor there) and reduce_k adds them up.
//
// Which tokens a tile takes and where its outputs go are the rows module's (tiled_span.wgsl), the kernel's
// arithmetic the same for both.

const BN: u32 = 64u;
// A measuring aid (matmul.rs, tiled_probe): 0 the whole kernel; 1 no dequantizing, 2 one column's products a unit,
// 3 no activation loads.
override PROBE: u32 = 0u;

// ws[k * 16 + q]: rows 4q..4q + 4 of the tile at column k of the unit (matmul_glu: quads 0..8 the gate's rows,
// 8..16 the up's), so a thread reads its 4 rows as one vec4.
var<workgroup> ws: array<vec4<f32>, 512>;
// xs[k * 16 + (q ^ ((k / 4) % 8))]: tokens 4q..4q + 4 at column k. The quad index is XOR-ed with k / 4 so that
// the loads' stores (a warp: 4 tokens × 8 vec4s of columns) fall on 32 different banks.
var<workgroup> xs: array<vec4<f32>, 512>;

// The activations again, as vectors (x's buffer bound a second time, matmul.rs).
@group(0) @binding(7) var<storage, read> x4: array<vec4<f32>>;

// Vec4 j of 8 (columns 4j..4j + 4 of unit u) of x's row xr, zeros past the row or for no row (NONE).
fn x_vec(xr: u32, j: u32, u: u32) -> vec4<f32> {
    let k = u * 32u + 4u * j;
    if (xr == NONE || k >= p.cols) {
        return vec4<f32>(0.0);
    }
    if ((p.cols & 3u) == 0u) {
        return x4[(xr * p.cols + k) >> 2u];
    }
    // Rows whose length is not a multiple of 4 (float matrices only): 4 scalars, zeros past the row.
    let b = xr * p.cols + k;
    var v = vec4<f32>(0.0);
    for (var i = 0u; i < min(4u, p.cols - k); i++) {
        v[i] = x[b + i];
    }
    return v;
}

// Thread li's 8 of the 512 vec4s of the tile's 64 tokens at unit u: vec4 i = li + 64m is token i / 8, columns
// 4(i % 8).. (a warp reads 4 tokens' 128 contiguous bytes). Written out so the 8 loads are in flight together (a
// loop that loads and stores in turn waited for each load: a measured half of the kernel's time). The thread's 8
// tokens' rows of x (`x_rows`) are found once, before the walk over the columns.
struct XLoad {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
    v4: vec4<f32>,
    v5: vec4<f32>,
    v6: vec4<f32>,
    v7: vec4<f32>,
}

struct XRows {
    a: vec4<u32>,
    b: vec4<u32>,
}

fn x_rows(li: u32, s: Span) -> XRows {
    let t = li / 8u;
    return XRows(vec4<u32>(x_row(s, t), x_row(s, t + 8u), x_row(s, t + 16u), x_row(s, t + 24u)),
                 vec4<u32>(x_row(s, t + 32u), x_row(s, t + 40u), x_row(s, t + 48u), x_row(s, t + 56u)));
}

fn load_x(li: u32, r: XRows, u: u32) -> XLoad {
    let j = li % 8u;
    return XLoad(x_vec(r.a.x, j, u), x_vec(r.a.y, j, u), x_vec(r.a.z, j, u), x_vec(r.a.w, j, u),
                 x_vec(r.b.x, j, u), x_vec(r.b.y, j, u), x_vec(r.b.z, j, u), x_vec(r.b.w, j, u));
}

// Vec4 `v` of token tl (within the tile), columns 4j..4j + 4, into xs.
fn store_x(tl: u32, j: u32, v: vec4<f32>) {
    let q = (tl / 4u) ^ j;
    let c = tl % 4u;
    xs[(4u * j) * 16u + q][c] = v.x;
    xs[(4u * j + 1u) * 16u + q][c] = v.y;
    xs[(4u * j + 2u) * 16u + q][c] = v.z;
    xs[(4u * j + 3u) * 16u + q][c] = v.w;
}

fn store_xs(li: u32, l: XLoad) {
    let tl = li / 8u;
    let j = li % 8u;
    store_x(tl, j, l.v0);
    store_x(tl + 8u, j, l.v1);
    store_x(tl + 16u, j, l.v2);
    store_x(tl + 24u, j, l.v3);
    store_x(tl + 32u, j, l.v4);
    store_x(tl + 40u, j, l.v5);
    store_x(tl + 48u, j, l.v6);
    store_x(tl + 56u, j, l.v7);
}

// y at rows row..row + 4 for the tile's token tl, those the rows module places (`y_at`).
fn store4(s: Span, row: u32, tl: u32, v: vec4<f32>) {
    for (var i = 0u; i < 4u; i++) {
        let at = y_at(s, row + i, tl);
        if (at != NONE) {
            y[at] = v[i];
        }
    }
}

fn glu4(g: vec4<f32>, u: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(glu(p.act, g.x, u.x), glu(p.act, g.y, u.y), glu(p.act, g.z, u.z), glu(p.act, g.w, u.w));
}

// One tile. Thread (tr, tc) sums rows quads tr and tr + 8 (matmul_glu: the gate's and the up's quad tr) for token
// quads tc and tc + 8: c0j for the first rows, c1j for the second, j the token (0..4 in quad tc, 4..8 in tc + 8).
// A tile of no tokens (tiled_picks.wgsl: past the groups' tiles) returns at once.
fn tile(wid: vec3<u32>, li: u32, is_glu: bool) {
    let s = span(wid);
    if (s.n == 0u) {
        return;
    }
    let rows_per_tile = select(64u, 32u, is_glu);
    let r0 = (wid.x + wid.y * p.nx) * rows_per_tile;
    let splits = max(p.k_split, 1u);
    let slice = s.slice;
    let per_slice = (p.units + splits - 1u) / splits;
    let u_end = min(p.units, (slice + 1u) * per_slice);
    let xr = x_rows(li, s);
    let tr = li % 8u;
    let tc = li / 8u;
    // Plain vector variables, which every compiler keeps in registers (an indexed function array may go to
    // memory, a load and a store per product).
    var c00 = vec4<f32>(0.0);
    var c01 = vec4<f32>(0.0);
    var c02 = vec4<f32>(0.0);
    var c03 = vec4<f32>(0.0);
    var c04 = vec4<f32>(0.0);
    var c05 = vec4<f32>(0.0);
    var c06 = vec4<f32>(0.0);
    var c07 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0);
    var c11 = vec4<f32>(0.0);
    var c12 = vec4<f32>(0.0);
    var c13 = vec4<f32>(0.0);
    var c14 = vec4<f32>(0.0);
    var c15 = vec4<f32>(0.0);
    var c16 = vec4<f32>(0.0);
    var c17 = vec4<f32>(0.0);
    // The row this thread dequantizes, and from which matrix.
    let row = w_row(s, select(r0 + li, r0 + li % 32u, is_glu));
    let from_b = is_glu && li >= 32u;
    for (var u = slice * per_slice; u < u_end; u++) {
        // The activations' loads first, so they are in flight while the weights are dequantized.
        var xl = XLoad(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0),
                       vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
        if (PROBE != 3u) {
            xl = load_x(li, xr, u);
        }
        var w: array<f32, 32>;
        if (row != NONE && PROBE != 1u) {
            if (from_b) {
                dequant_b(row * p.row_bytes, u, &w);
            } else {
                dequant_a(row * p.row_bytes, u, &w);
            }
        }
        for (var k = 0u; k < 32u; k++) {
            ws[k * 16u + li / 4u][li % 4u] = w[k];
        }
        store_xs(li, xl);
        workgroupBarrier();
        for (var k = 0u; k < select(32u, 1u, PROBE == 2u); k++) {
            let a0 = ws[k * 16u + tr];
            let a1 = ws[k * 16u + 8u + tr];
            let sw = (k / 4u) & 7u;
            let b0 = xs[k * 16u + (tc ^ sw)];
            let b1 = xs[k * 16u + ((tc + 8u) ^ sw)];
            c00 += a0 * b0.x;
            c01 += a0 * b0.y;
            c02 += a0 * b0.z;
            c03 += a0 * b0.w;
            c04 += a0 * b1.x;
            c05 += a0 * b1.y;
            c06 += a0 * b1.z;
            c07 += a0 * b1.w;
            c10 += a1 * b0.x;
            c11 += a1 * b0.y;
            c12 += a1 * b0.z;
            c13 += a1 * b0.w;
            c14 += a1 * b1.x;
            c15 += a1 * b1.y;
            c16 += a1 * b1.z;
            c17 += a1 * b1.w;
        }
        workgroupBarrier();
    }
    let ra = r0 + 4u * tr;
    let ta = 4u * tc;
    let tb = ta + 32u;
    if (is_glu) {
        store4(s, ra, ta, glu4(c00, c10));
        store4(s, ra, ta + 1u, glu4(c01, c11));
        store4(s, ra, ta + 2u, glu4(c02, c12));
        store4(s, ra, ta + 3u, glu4(c03, c13));
        store4(s, ra, tb, glu4(c04, c14));
        store4(s, ra, tb + 1u, glu4(c05, c15));
        store4(s, ra, tb + 2u, glu4(c06, c16));
        store4(s, ra, tb + 3u, glu4(c07, c17));
    } else {
        let rb = ra + 32u;
        store4(s, ra, ta, c00);
        store4(s, ra, ta + 1u, c01);
        store4(s, ra, ta + 2u, c02);
        store4(s, ra, ta + 3u, c03);
        store4(s, ra, tb, c04);
        store4(s, ra, tb + 1u, c05);
        store4(s, ra, tb + 2u, c06);
        store4(s, ra, tb + 3u, c07);
        store4(s, rb, ta, c10);
        store4(s, rb, ta + 1u, c11);
        store4(s, rb, ta + 2u, c12);
        store4(s, rb, ta + 3u, c13);
        store4(s, rb, tb, c14);
        store4(s, rb, tb + 1u, c15);
        store4(s, rb, tb + 2u, c16);
        store4(s, rb, tb + 3u, c17);
    }
}

@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    tile(wid, li, false);
}

// Split-K's sum: y[t, row0 + r] = Σ_s x[s, t, row0 + r] over the p.k_split slices' partial products (the scratch tensor
// bound as x), in slice order; a thread a value, the grid (x, y) over groups of 256.
@compute @workgroup_size(256)
fn reduce_k(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * p.nx) * 256u + li;
    if (i >= p.rows * p.n_tok) {
        return;
    }
    // The partial products are laid out as the output, a slice's after the one before.
    let at = (i / p.rows) * p.y_stride + p.row0 + i % p.rows;
    var s = 0.0;
    for (var k = 0u; k < p.k_split; k++) {
        s += x[k * p.n_tok * p.y_stride + at];
    }
    y[at] = s;
}

// y[t, r] = act(G[r, :]·x[t, :]) · (U[r, :]·x[t, :]), gate in wa, up in wb (of one type): threads 0..32
// dequantize the gate's rows, 32..64 the up's. Never split: the activation needs the whole sums.
@compute @workgroup_size(64)
fn matmul_glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    tile(wid, li, true);
}
