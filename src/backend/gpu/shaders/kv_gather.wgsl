// The KV rows a forward pass wrote into one layer's f16 caches, gathered into one run for the host's copy
// (layers.rs): per KV head h, its K rows at positions pos0..pos0 + n, then its V rows, as the host's cache holds
// each head's rows. A thread copies a word (two halves; head sizes are even). One dispatch where the copies were
// two a head.

struct Params {
    // Words to copy: n_head_kv · n · (k_row + v_row).
    total: u32,
    // Words per K row and per V row (hdk / 2, hdv / 2).
    k_row: u32,
    v_row: u32,
    // Rows (n) and the caches' positions a head (n_ctx).
    n: u32,
    n_ctx: u32,
    pad: u32,
    // Where in `out` this layer's run starts, in words.
    at: u32,
    nx: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> kc: array<u32>;
@group(0) @binding(2) var<storage, read> vc: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;
// The batch's positions, the first of which is the first row's (read here, not passed, so that a decode step's
// bind group is the same at every position).
@group(0) @binding(4) var<storage, read> pos: array<u32>;

@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * p.nx) * 256u + li;
    if (i >= p.total) {
        return;
    }
    let kw = p.n * p.k_row;
    let per_head = kw + p.n * p.v_row;
    let h = i / per_head;
    let r = i % per_head;
    let row0 = h * p.n_ctx + pos[0];
    if (r < kw) {
        out[p.at + i] = kc[row0 * p.k_row + r];
    } else {
        out[p.at + i] = vc[row0 * p.v_row + (r - kw)];
    }
}
