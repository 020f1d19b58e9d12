// RoPE over n_rows rows of n_heads heads of head_dim values, row t at position pos[t]: one thread per rotated
// pair. Adjacent pairs (2i, 2i+1) for Llama, halves (i, i + n_rot/2) for NeoX style. The angles come from the
// CPU's table (kernels::ops::RopeTable), uploaded as (cos, sin) pairs per position, so both backends rotate by
// the same numbers.

struct Params {
    n_rows: u32,
    n_heads: u32,
    head_dim: u32,
    half_rot: u32,
    neox: u32,
    nx: u32,
    n_ctx: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> cs: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = (wid.x + wid.y * p.nx) * 64u + li;
    let per_row = p.n_heads * p.half_rot;
    if (g >= p.n_rows * per_row) {
        return;
    }
    let t = g / per_row;
    let h = (g % per_row) / p.half_rot;
    let i = g % p.half_rot;
    let ps = min(pos[t], p.n_ctx - 1u);
    let c = cs[ps * p.half_rot + i];
    let base = (t * p.n_heads + h) * p.head_dim;
    var a: u32;
    var b: u32;
    if (p.neox != 0u) {
        a = base + i;
        b = base + i + p.half_rot;
    } else {
        a = base + 2u * i;
        b = a + 1u;
    }
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * c.x - x1 * c.y;
    x[b] = x0 * c.y + x1 * c.x;
}
