// Q, K and V of a batch made ready for attention in one dispatch, one workgroup of 64 threads per (row, head): the
// row's n_head query heads, then its n_head_kv K heads, then its n_head_kv V heads, each by qkv_head.wgsl; Q is
// then written out for attention, K and V stored into the cache. The dispatch binds eight storage buffers, the
// portable limit.

struct Params {
    n_tok: u32,
    n_head: u32,
    n_head_kv: u32,
    hdk: u32,
    hdv: u32,
    // Positions of the cache.
    n_ctx: u32,
    nx: u32,
    // From here as attention.wgsl's (rope.rs, `Ready::words`): rotated pairs per head, and the positions of the
    // angle table.
    half_rot: u32,
    neox: u32,
    rope_ctx: u32,
    eps: f32,
    // Offsets in `aux` of the Q, K and V biases and the Q and K norms' weights; NONE where the layer has none.
    bq: u32,
    bk: u32,
    bv: u32,
    qn: u32,
    kn: u32,
    // Where this layer's rows start in `fresh`, in words.
    fresh_at: u32,
    // The first dimension of a Q or K head that RoPE turns (DeepSeek's heads end in their rotated part).
    rot_at: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The rotated query heads, [n_tok, n_head, hdk].
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
@group(0) @binding(7) var<storage, read> pos: array<u32>;

const WG: u32 = 64u;

@compute @workgroup_size(64)
fn rope_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = wid.x + wid.y * p.nx;
    let per_row = p.n_head + 2u * p.n_head_kv;
    if (g >= p.n_tok * per_row) {
        return;
    }
    let t = g / per_row;
    let j = g % per_row;
    let kind = select(select(V_HEAD, K_HEAD, j < p.n_head + p.n_head_kv), Q_HEAD, j < p.n_head);
    let h = select(select(j - p.n_head - p.n_head_kv, j - p.n_head, kind == K_HEAD), j, kind == Q_HEAD);
    let ps = pos[t];
    ready_head(t, kind, h, ps, li);
    if (kind == Q_HEAD) {
        for (var i = li; i < p.hdk; i += WG) {
            q[(t * p.n_head + h) * p.hdk + i] = hv[i];
        }
    } else if (ps < p.n_ctx) {
        store_head(t, kind, h, ps, li);
    }
}
