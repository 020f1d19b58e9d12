// Q, K and V of a batch made ready for attention in one dispatch, one workgroup of 64 threads per (row, head): the
// row's n_head query heads, then its n_head_kv K heads, then its n_head_kv V heads. Each head, in the CPU's order
// (model/blocks.rs): its bias added (Qwen 2), RMS-normalised (Qwen 3, Gemma 3; Q and K only), rotated (Q and K);
// then Q is written out for attention and K and V are stored as f16 into the cache at the row's position, and into
// the run the host's copy of the cache is read back from.
//
// RoPE rotates adjacent pairs (2i, 2i+1) for Llama, halves (i, i + n_rot/2) for NeoX style, by the angles of the
// CPU's table (kernels::ops::RopeTable), uploaded as (cos, sin) pairs per position, so both backends rotate by the
// same numbers. The biases and norm weights are one buffer (`aux`, at the offsets below), so the dispatch binds
// eight storage buffers, the portable limit.
//
// Cache layout, as the CPU's (engine::kv_cache): K [n_head_kv, n_ctx, hdk], V [n_head_kv, n_ctx, hdv], f16 packed
// two to a word; hdk and hdv are even and at most 256.

struct Params {
    n_tok: u32,
    n_head: u32,
    n_head_kv: u32,
    hdk: u32,
    hdv: u32,
    // Rotated pairs per head, and the positions of the angle table.
    half_rot: u32,
    neox: u32,
    rope_ctx: u32,
    // Positions of the cache.
    n_ctx: u32,
    eps: f32,
    nx: u32,
    // Offsets in `aux` of the Q, K and V biases and the Q and K norms' weights; NONE where the layer has none.
    bq: u32,
    bk: u32,
    bv: u32,
    qn: u32,
    kn: u32,
    // Where this layer's rows start in `fresh`, in words.
    fresh_at: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The rotated query heads, [n_tok, n_head, hdk].
@group(0) @binding(1) var<storage, read_write> q: array<f32>;
// The projections of each row side by side, as one matmul of the stacked matrices writes them: Q (n_head × hdk),
// K (n_head_kv × hdk), V (n_head_kv × hdv).
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
// The K and V rows written, again, for the host's copy of the cache: all the pass's layers in one run read back at
// once; a layer's run holds, per KV head, its K rows at the batch's positions, then its V rows (layers.rs).
@group(0) @binding(3) var<storage, read_write> fresh: array<u32>;
@group(0) @binding(4) var<storage, read_write> kc: array<u32>;
@group(0) @binding(5) var<storage, read_write> vc: array<u32>;
@group(0) @binding(6) var<storage, read> cs: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read> pos: array<u32>;
@group(0) @binding(8) var<storage, read> aux: array<f32>;

const WG: u32 = 64u;
const NONE: u32 = 0xffffffffu;

// The head being prepared.
var<workgroup> hv: array<f32, 256>;

@compute @workgroup_size(64)
fn rope_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = wid.x + wid.y * p.nx;
    let per_row = p.n_head + 2u * p.n_head_kv;
    if (g >= p.n_tok * per_row) {
        return;
    }
    let t = g / per_row;
    let j = g % per_row;
    // 0: a query head, 1: a K head, 2: a V head.
    let kind = select(select(2u, 1u, j < p.n_head + p.n_head_kv), 0u, j < p.n_head);
    let h = select(select(j - p.n_head - p.n_head_kv, j - p.n_head, kind == 1u), j, kind == 0u);
    let hd = select(p.hdk, p.hdv, kind == 2u);
    let bias = select(select(p.bv, p.bk, kind == 1u), p.bq, kind == 0u);
    let norm = select(select(NONE, p.kn, kind == 1u), p.qn, kind == 0u);
    let q_width = p.n_head * p.hdk;
    let k_width = p.n_head_kv * p.hdk;
    let first = select(select(q_width + k_width, q_width, kind == 1u), 0u, kind == 0u);
    let src = t * (q_width + k_width + p.n_head_kv * p.hdv) + first + h * hd;

    // The head, plus its bias, and its sum of squares.
    var part = 0.0;
    for (var i = li; i < hd; i += WG) {
        var x = qkv[src + i];
        if (bias != NONE) {
            x += aux[bias + h * hd + i];
        }
        hv[i] = x;
        part += x * x;
    }
    let ss = reduce_sum(li, part); // reduce.wgsl
    if (norm != NONE) {
        let scale = 1.0 / sqrt(ss / f32(hd) + p.eps);
        for (var i = li; i < hd; i += WG) {
            hv[i] = hv[i] * scale * aux[norm + i];
        }
    }
    workgroupBarrier();

    if (kind < 2u) {
        let ps = min(pos[t], p.rope_ctx - 1u);
        for (var i = li; i < p.half_rot; i += WG) {
            let c = cs[ps * p.half_rot + i];
            var a: u32;
            var b: u32;
            if (p.neox != 0u) {
                a = i;
                b = i + p.half_rot;
            } else {
                a = 2u * i;
                b = a + 1u;
            }
            let x0 = hv[a];
            let x1 = hv[b];
            hv[a] = x0 * c.x - x1 * c.y;
            hv[b] = x0 * c.y + x1 * c.x;
        }
    }
    workgroupBarrier();

    if (kind == 0u) {
        for (var i = li; i < hd; i += WG) {
            q[(t * p.n_head + h) * hd + i] = hv[i];
        }
        return;
    }
    let ps = pos[t];
    if (ps >= p.n_ctx) {
        return;
    }
    let at = ((h * p.n_ctx + ps) * hd) / 2u;
    let k_rows = p.n_tok * p.hdk / 2u;
    let head_run = p.fresh_at + h * (k_rows + p.n_tok * p.hdv / 2u);
    let f = head_run + select(k_rows + t * p.hdv / 2u, t * p.hdk / 2u, kind == 1u);
    for (var i = li; i < hd / 2u; i += WG) {
        // Rounded as the CPU rounds (f16.wgsl): pack2x16float's own rounding is the implementation's, and of
        // values that are f16 already every implementation's is exact.
        let w = pack2x16float(vec2<f32>(f16_round(hv[2u * i]), f16_round(hv[2u * i + 1u])));
        if (kind == 1u) {
            kc[at + i] = w;
        } else {
            vc[at + i] = w;
        }
        fresh[f + i] = w;
    }
}
