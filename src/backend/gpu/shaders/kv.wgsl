// Writes rows of K or V into the f16 cache: src is [n_tok, n_head_kv, hd] f32 (after RoPE, for K), row t goes to
// position pos[t] of each head's run in the cache [n_head_kv, n_ctx, hd]. One thread per pair of values, written
// as one packed word, so hd is even.

struct Params {
    n_tok: u32,
    n_head_kv: u32,
    hd: u32,
    n_ctx: u32,
    nx: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<u32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;

@compute @workgroup_size(64)
fn kv_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = (wid.x + wid.y * p.nx) * 64u + li;
    let pairs = p.hd / 2u;
    if (g >= p.n_tok * p.n_head_kv * pairs) {
        return;
    }
    let t = g / (p.n_head_kv * pairs);
    let h = (g / pairs) % p.n_head_kv;
    let i = g % pairs;
    let s = (t * p.n_head_kv + h) * p.hd + 2u * i;
    let ps = pos[t];
    if (ps >= p.n_ctx) {
        return;
    }
    cache[((h * p.n_ctx + ps) * p.hd) / 2u + i] = pack2x16float(vec2<f32>(src[s], src[s + 1u]));
}
