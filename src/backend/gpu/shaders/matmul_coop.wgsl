// The tiled y[t, row0 + r] = W[r, :] · x[t, :] on the adapter's matrix units (coop.rs): cooperative matrices of
// S × S (8 or 16) f16 inputs with f32 sums. The module's head (coop.rs) enables f16 and cooperative matrices and
// names the types (MA, MB, MC), S and SG, the subgroup size; the weights' dequantizers (quant.wgsl) and the
// parameters (matmul_io.wgsl) are matmul_tiled.wgsl's.
//
// A workgroup of 4 subgroups owns a tile of 64 weight rows × 64 tokens (matmul_glu: 32 gate rows and the same 32
// up rows) and walks the columns a 32-weight unit at a time: its threads dequantize the tile's rows of the unit
// into workgroup memory as f16 (wt) and copy the tokens' halves there (xt); after a barrier each subgroup
// multiplies its quadrant (32 rows × 32 tokens; matmul_glu: 16 gate and 16 up rows × 32 tokens) S columns at a
// time. The activations come as halves.wgsl wrote them: each row scaled by a power of two that keeps it inside
// f16's range, the scale after the rows; the sums are multiplied back by it as they are stored. Rows and tokens
// past the matrix or the batch are zeros in the tiles and are not written. Which tokens a tile takes and where its
// outputs go are the rows module's (tiled_span.wgsl: a batch's, or a mixture's picks grouped by expert). The grid
// and the column slices ("split-K") are matmul_tiled.wgsl's, whose reduce_k adds the slices' partial products.

const BM: u32 = 64u;
const BN: u32 = 64u;
// Halves a tile row takes in workgroup memory: a unit's 32 and 8 more, so each row starts 16 bytes after a bank
// boundary the row before did not.
const LD: u32 = 40u;
const WG: u32 = 4u * SG;
// Accumulators a subgroup holds: 32 / S row blocks × 32 / S token blocks (matmul_glu: 16 / S row blocks, twice).
const NI: u32 = 32u / S;
const NJ: u32 = 32u / S;
const NI_GLU: u32 = 16u / S;

var<workgroup> wt: array<f16, 2560>;
var<workgroup> xt: array<f16, 2560>;
// Each subgroup's accumulator on its way out (matmul_glu: the gate's, then the up's).
var<workgroup> cs: array<f32, 8u * S * S>;

// The activations' halves: x's row xr at words xr·cols/2.., then the rows' scales (f32 bits), as halves.wgsl
// wrote them.
@group(0) @binding(7) var<storage, read> xh: array<u32>;

// The scale of x's row xr: after all the rows, the batch's tokens or the picks' input rows (n_tok picks, x_div a
// row).
fn row_scale(xr: u32) -> f32 {
    let rows = select(p.n_tok, p.n_tok / max(p.x_div, 1u), p.x_div > 0u);
    return bitcast<f32>(xh[rows * (p.cols / 2u) + xr]);
}

// Unit u of the tile's rows (from wk.r0; matmul_glu: tile rows 32.. are the up's) and tokens into wt and xt.
fn load_unit(li: u32, wk: Walk, u: u32, is_glu: bool) {
    for (var r = li; r < BM; r += WG) {
        let row = w_row(wk.s, select(wk.r0 + r, wk.r0 + r % 32u, is_glu));
        var w: array<f32, 32>;
        if (row != NONE) {
            if (is_glu && r >= 32u) {
                dequant_b(row * p.row_bytes, u, &w);
            } else {
                dequant_a(row * p.row_bytes, u, &w);
            }
        }
        for (var k = 0u; k < 32u; k++) {
            wt[r * LD + k] = f16(w[k]);
        }
    }
    for (var i = li; i < BN * 16u; i += WG) {
        let t = i / 16u;
        let j = i % 16u;
        var v = vec2<f16>(0.0h);
        let xr = x_row(wk.s, t);
        if (xr != NONE) {
            // (Exact: the halves' values through f32. naga 30 types `bitcast<vec2<f16>>` of a u32 as f32.)
            v = vec2<f16>(unpack2x16float(xh[xr * (p.cols / 2u) + u * 16u + j]));
        }
        xt[t * LD + 2u * j] = v.x;
        xt[t * LD + 2u * j + 1u] = v.y;
    }
}

// The tile's first row, its tokens (the rows module's span, its column slice) and units.
struct Walk {
    r0: u32,
    s: Span,
    u0: u32,
    u1: u32,
}

// The slice and its units from the grid, not from the span (a picks' span comes from a buffer, which naga does not
// count as uniform, and the matrix units' loads must be in uniform control flow; a picks tile is never split).
fn walk(wid: vec3<u32>, rows_per_tile: u32) -> Walk {
    let splits = max(p.k_split, 1u);
    let slice = wid.z % splits;
    let per_slice = (p.units + splits - 1u) / splits;
    return Walk((wid.x + wid.y * p.nx) * rows_per_tile, span(wid), slice * per_slice,
                min(p.units, (slice + 1u) * per_slice));
}

// Whether the tile takes no tokens (tiled_picks.wgsl: past the groups' tiles), as a uniform value: the workgroup
// returns at once, in uniform control flow.
var<workgroup> no_tokens: bool;

fn empty(li: u32, wk: Walk) -> bool {
    if (li == 0u) {
        no_tokens = wk.s.n == 0u;
    }
    return workgroupUniformLoad(&no_tokens);
}

// Tile row `row`'s sum v for the tile's token tl into y, times its input row's scale, where it goes anywhere.
fn put(wk: Walk, row: u32, tl: u32, v: f32) {
    let at = y_at(wk.s, row, tl);
    if (at != NONE) {
        y[at] = v * row_scale(x_row(wk.s, tl));
    }
}

@compute @workgroup_size(WG)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
          @builtin(subgroup_id) sid: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let wk = walk(wid, BM);
    if (empty(li, wk)) {
        return;
    }
    // The subgroup's quadrant: rows mr.., tokens mt.. of the tile.
    let mr = (sid % 2u) * 32u;
    let mt = (sid / 2u) * 32u;
    var acc: array<MC, NI * NJ>;
    for (var i = 0u; i < NI * NJ; i++) {
        acc[i] = MC();
    }
    for (var u = wk.u0; u < wk.u1; u++) {
        load_unit(li, wk, u, false);
        workgroupBarrier();
        for (var kk = 0u; kk < 32u; kk += S) {
            var b: array<MB, NJ>;
            for (var j = 0u; j < NJ; j++) {
                b[j] = coopLoad<MB>(&xt[(mt + j * S) * LD + kk], LD);
            }
            for (var i = 0u; i < NI; i++) {
                let a = coopLoadT<MA>(&wt[(mr + i * S) * LD + kk], LD);
                for (var j = 0u; j < NJ; j++) {
                    acc[i * NJ + j] = coopMultiplyAdd(a, b[j], acc[i * NJ + j]);
                }
            }
        }
        workgroupBarrier();
    }
    let c0 = sid * 2u * S * S;
    for (var i = 0u; i < NI; i++) {
        for (var j = 0u; j < NJ; j++) {
            // Column-major: cs[c0 + t·S + r] is row r, token t of the block.
            coopStore(acc[i * NJ + j], &cs[c0], S);
            workgroupBarrier();
            for (var e = lane; e < S * S; e += SG) {
                put(wk, wk.r0 + mr + i * S + e % S, mt + j * S + e / S, cs[c0 + e]);
            }
            workgroupBarrier();
        }
    }
}

// y[t, r] = act(G[r, :]·x[t, :]) · (U[r, :]·x[t, :]), gate in wa, up in wb (of one type). Never split: the
// activation needs the whole sums.
@compute @workgroup_size(WG)
fn matmul_glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
              @builtin(subgroup_id) sid: u32, @builtin(subgroup_invocation_id) lane: u32) {
    let wk = walk(wid, 32u);
    if (empty(li, wk)) {
        return;
    }
    // The subgroup's gate rows mr.. (its up rows 32 + mr..) and tokens mt.. of the tile.
    let mr = (sid % 2u) * 16u;
    let mt = (sid / 2u) * 32u;
    var gacc: array<MC, NI_GLU * NJ>;
    var uacc: array<MC, NI_GLU * NJ>;
    for (var i = 0u; i < NI_GLU * NJ; i++) {
        gacc[i] = MC();
        uacc[i] = MC();
    }
    for (var u = wk.u0; u < wk.u1; u++) {
        load_unit(li, wk, u, true);
        workgroupBarrier();
        for (var kk = 0u; kk < 32u; kk += S) {
            var b: array<MB, NJ>;
            for (var j = 0u; j < NJ; j++) {
                b[j] = coopLoad<MB>(&xt[(mt + j * S) * LD + kk], LD);
            }
            for (var i = 0u; i < NI_GLU; i++) {
                let g = coopLoadT<MA>(&wt[(mr + i * S) * LD + kk], LD);
                let v = coopLoadT<MA>(&wt[(32u + mr + i * S) * LD + kk], LD);
                for (var j = 0u; j < NJ; j++) {
                    gacc[i * NJ + j] = coopMultiplyAdd(g, b[j], gacc[i * NJ + j]);
                    uacc[i * NJ + j] = coopMultiplyAdd(v, b[j], uacc[i * NJ + j]);
                }
            }
        }
        workgroupBarrier();
    }
    let c0 = sid * 2u * S * S;
    for (var i = 0u; i < NI_GLU; i++) {
        for (var j = 0u; j < NJ; j++) {
            coopStore(gacc[i * NJ + j], &cs[c0], S);
            coopStore(uacc[i * NJ + j], &cs[c0 + S * S], S);
            workgroupBarrier();
            for (var e = lane; e < S * S; e += SG) {
                let tl = mt + j * S + e / S;
                let at = y_at(wk.s, wk.r0 + mr + i * S + e % S, tl);
                if (at != NONE) {
                    let s = row_scale(x_row(wk.s, tl));
                    y[at] = glu(p.act, cs[c0 + e] * s, cs[c0 + S * S + e] * s);
                }
            }
            workgroupBarrier();
        }
    }
}
