// The tiled matmul's rows (matmul_tiled.wgsl) for a batch: tile z of each column slice takes tokens 64z.. in order,
// weight row r is row r of the matrix (of this part of it), and token t's output is y[t, row0 + r] (split-K: the
// slice's partial product, at [slice, t, row0 + r]).

fn span(wid: vec3<u32>) -> Span {
    let splits = max(p.k_split, 1u);
    let t0 = (wid.z / splits) * BN;
    return Span(t0, select(0u, min(BN, p.n_tok - t0), t0 < p.n_tok), wid.z % splits, 0u);
}

// x's row for the tile's token tl, NONE past the batch.
fn x_row(s: Span, tl: u32) -> u32 {
    return select(NONE, s.t0 + tl, tl < s.n);
}

// The weights' row r in this part's buffer, NONE past the matrix.
fn w_row(s: Span, r: u32) -> u32 {
    return select(NONE, r, r < p.rows);
}

// Where row r's output for the tile's token tl goes in y, NONE for none.
fn y_at(s: Span, r: u32, tl: u32) -> u32 {
    if (tl >= s.n || r >= p.rows) {
        return NONE;
    }
    return (s.slice * p.n_tok + s.t0 + tl) * p.y_stride + p.row0 + r;
}
