// Embedding lookup: x[t, :] = scale · row tok[t] of the embedding matrix, dequantized by quant.wgsl (instantiated
// for `wa`). The matrix may be in parts (buffers.rs): a dispatch reads one part, rows row0..row0 + rows, and
// writes only the tokens whose rows it holds. A thread per (token, 32-weight unit), 64 per workgroup; the grid is
// (x, y) over the workgroups (index wid.x + wid.y·nx, see device::grid).

struct Params {
    n_tok: u32,
    cols: u32,
    row_bytes: u32,
    units: u32,
    row0: u32,
    rows: u32,
    nx: u32,
    // The scale's f32 bits (Gemma's √n_embd; 1 for the others).
    scale: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wa: array<u32>;
@group(0) @binding(2) var<storage, read> tok: array<u32>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;
// The grid i-quants' codebooks (quant.wgsl), bound only for those types.
@group(0) @binding(5) var<storage, read> iq_grid: array<u32>;

@compute @workgroup_size(64)
fn embed(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * p.nx) * 64u + li;
    if (i >= p.n_tok * p.units) {
        return;
    }
    let t = i / p.units;
    let u = i % p.units;
    let id = tok[t];
    if (id < p.row0 || id >= p.row0 + p.rows) {
        return;
    }
    var w: array<f32, 32>;
    dequant_a((id - p.row0) * p.row_bytes, u, &w);
    let s = bitcast<f32>(p.scale);
    for (var k = 0u; k < 32u; k++) {
        x[t * p.cols + u * 32u + k] = w[k] * s;
    }
}
