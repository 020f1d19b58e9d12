// DeepSeek's latent attention (model/deepseek2.rs): every head's K and V of a batch's rows, assembled from
// attn_kv_b's products and the RoPE key the heads share, into the K and V parts of the rows' Q, K and V (the layout
// the stacked projections of the other architectures write), so rope.wgsl and attention.wgsl take them as theirs.
// One thread a value: K head h is [K_nope of h | k_pe], V head h is V of h. RoPE turns k_pe afterwards, in each
// head's copy (the CPU turns it once and copies it: the same operations on the same numbers).

struct Params {
    n_tok: u32,
    n_head: u32,
    // Each K head's unrotated and rotated dimensions (hdk = nope + rot), and a V head's.
    nope: u32,
    rot: u32,
    hdv: u32,
    // Where k_pe is: at k_pe_at in rows of k_pe_stride.
    k_pe_stride: u32,
    k_pe_at: u32,
    // Where K starts in a row of `qkv` (n_head · hdk), and its width (Q, K and V).
    q_width: u32,
    qkv_width: u32,
    nx: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// attn_kv_a_mqa's products (each row the compressed vector, then k_pe, not rotated yet), in wider rows.
@group(0) @binding(1) var<storage, read> k_pe: array<f32>;
// attn_kv_b's products: each row, per head, its K_nope (nope values), then its V (hdv).
@group(0) @binding(2) var<storage, read> kvb: array<f32>;
@group(0) @binding(3) var<storage, read_write> qkv: array<f32>;

@compute @workgroup_size(256)
fn latent_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let hdk = p.nope + p.rot;
    let per_row = p.n_head * (hdk + p.hdv);
    let g = (wid.x + wid.y * p.nx) * 256u + li;
    if (g >= p.n_tok * per_row) {
        return;
    }
    let t = g / per_row;
    let i = g % per_row;
    let kvb_row = t * p.n_head * (p.nope + p.hdv);
    var x: f32;
    if (i < p.n_head * hdk) {
        let h = i / hdk;
        let d = i % hdk;
        if (d < p.nope) {
            x = kvb[kvb_row + h * (p.nope + p.hdv) + d];
        } else {
            x = k_pe[t * p.k_pe_stride + p.k_pe_at + d - p.nope];
        }
    } else {
        let j = i - p.n_head * hdk;
        let h = j / p.hdv;
        x = kvb[kvb_row + h * (p.nope + p.hdv) + p.nope + j % p.hdv];
    }
    qkv[t * p.qkv_width + p.q_width + i] = x;
}
