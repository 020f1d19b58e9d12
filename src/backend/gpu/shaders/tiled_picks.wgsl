// The tiled matmul's rows (matmul_tiled.wgsl) for a mixture's picks grouped by expert on the device (picks.wgsl):
// tile z is (expert e, first slot s0, picks n) at tiles[3z..3z + 3], n = 0 past the groups' tiles, and its token
// tl is the pick z' = order[s0 + tl], whose input is row z' / x_div of x (x_div = k: a token's picks share its
// input; 1: each pick has its own) and whose output is y[z', r], rows of R = p.y_stride values. W is the expert
// tensor's 2-D view (expert e's matrix is rows e·R..(e + 1)·R) or one part of it (rows row0..row0 + rows), as for
// matmul.wgsl's indexed mat-vecs; the grid's rows cover one expert's R, and each part writes the rows it holds.
// So each weight of an expert is read once per 64 of the batch's picks of it, not once per pick.

@group(0) @binding(6) var<storage, read> order: array<u32>;
@group(0) @binding(8) var<storage, read> tiles: array<u32>;

fn span(wid: vec3<u32>) -> Span {
    let g = 3u * wid.z;
    return Span(tiles[g + 1u], tiles[g + 2u], 0u, tiles[g]);
}

fn x_row(s: Span, tl: u32) -> u32 {
    if (tl >= s.n) {
        return NONE;
    }
    return order[s.t0 + tl] / p.x_div;
}

fn w_row(s: Span, r: u32) -> u32 {
    let g = s.e * p.y_stride + r;
    if (r >= p.y_stride || g < p.row0 || g >= p.row0 + p.rows) {
        return NONE;
    }
    return g - p.row0;
}

fn y_at(s: Span, r: u32, tl: u32) -> u32 {
    if (tl >= s.n || w_row(s, r) == NONE) {
        return NONE;
    }
    return order[s.t0 + tl] * p.y_stride + r;
}
