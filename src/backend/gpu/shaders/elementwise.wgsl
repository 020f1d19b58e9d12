// Element-wise ops over n values, 256 per workgroup: the residual add and the GLU activation (act.wgsl).

struct Params {
    n: u32,
    nx: u32,
    act: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;

fn index(wid: vec3<u32>, li: u32) -> u32 {
    return (wid.x + wid.y * p.nx) * 256u + li;
}

// a += b.
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = index(wid, li);
    if (i < p.n) {
        a[i] += b[i];
    }
}

// a = act(a) · b: the gate and up projections of a feed-forward whose two matrices are stored differently.
@compute @workgroup_size(256)
fn glu_mul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = index(wid, li);
    if (i < p.n) {
        a[i] = glu(p.act, a[i], b[i]);
    }
}
