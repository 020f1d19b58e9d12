// One head of a row's Q, K or V made ready for attention, in the CPU's order (model/blocks.rs): its bias added
// (Qwen 2), RMS-normalised (Qwen 3, Gemma 3; Q and K only), rotated (Q and K); K and V then stored as f16 into the
// cache at the row's position, and into the run the host's copy of the cache is read back from. Shared by
// rope.wgsl (every head of a batch, a workgroup each) and attention.wgsl's decode step (each workgroup its query
// head, and the K and V of its own position).
//
// RoPE rotates adjacent pairs (2i, 2i+1) for Llama, halves (i, i + n_rot/2) for NeoX style, of the n_rot dimensions
// from rot_at (0; DeepSeek's latent attention turns the last n_rot of a head), by the angles of the
// CPU's table (kernels::ops::RopeTable), uploaded as (cos, sin) pairs per position, so both backends rotate by the
// same numbers. The biases and norm weights are one buffer (`aux`, at the Params offsets bq..kn).
//
// The including module defines WG, Params (with n_tok, n_head, n_head_kv, hdk, hdv, n_ctx, half_rot, neox,
// rope_ctx, eps, bq, bk, bv, qn, kn, fresh_at, rot_at), `p`, and the reductions (reduce.wgsl, f32).
//
// Cache layout, as the CPU's (engine::kv_cache): K [n_head_kv, n_ctx, hdk], V [n_head_kv, n_ctx, hdv], f16 packed
// two to a word; hdk and hdv are even and at most 256.

// The projections of each row side by side, as one matmul of the stacked matrices writes them: Q (n_head × hdk),
// K (n_head_kv × hdk), V (n_head_kv × hdv).
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
// The K and V rows written, again, for the host's copy of the cache: all the pass's layers in one run read back at
// once; a layer's run holds, per KV head, its K rows at the batch's positions, then its V rows (layers.rs).
@group(0) @binding(3) var<storage, read_write> fresh: array<u32>;
@group(0) @binding(4) var<storage, read_write> kc: array<u32>;
@group(0) @binding(5) var<storage, read_write> vc: array<u32>;
@group(0) @binding(6) var<storage, read> cs: array<vec2<f32>>;
@group(0) @binding(8) var<storage, read> aux: array<f32>;

const NONE: u32 = 0xffffffffu;
const Q_HEAD: u32 = 0u;
const K_HEAD: u32 = 1u;
const V_HEAD: u32 = 2u;

// The head being made ready.
var<workgroup> hv: array<f32, 256>;

// Head h of `kind` (Q_HEAD, K_HEAD or V_HEAD) of row t, at position ps, into `hv`. Every thread of the workgroup
// calls it (it holds barriers); it ends with a barrier, so `hv` is whole when it returns.
fn ready_head(t: u32, kind: u32, h: u32, ps: u32, li: u32) {
    let hd = select(p.hdk, p.hdv, kind == V_HEAD);
    let bias = select(select(p.bv, p.bk, kind == K_HEAD), p.bq, kind == Q_HEAD);
    let norm = select(select(NONE, p.kn, kind == K_HEAD), p.qn, kind == Q_HEAD);
    let q_width = p.n_head * p.hdk;
    let k_width = p.n_head_kv * p.hdk;
    let first = select(select(q_width + k_width, q_width, kind == K_HEAD), 0u, kind == Q_HEAD);
    let src = t * (q_width + k_width + p.n_head_kv * p.hdv) + first + h * hd;

    // The head, plus its bias, and its sum of squares (reduced only for a norm: a reduction's barriers are most
    // of this function's time on a CPU adapter).
    var part = 0.0;
    for (var i = li; i < hd; i += WG) {
        var x = qkv[src + i];
        if (bias != NONE) {
            x += aux[bias + h * hd + i];
        }
        hv[i] = x;
        part += x * x;
    }
    if (norm != NONE) {
        let ss = reduce_sum(li, part);
        let scale = 1.0 / sqrt(ss / f32(hd) + p.eps);
        for (var i = li; i < hd; i += WG) {
            hv[i] = hv[i] * scale * aux[norm + i];
        }
    }
    workgroupBarrier();

    if (kind != V_HEAD) {
        let pr = min(ps, p.rope_ctx - 1u);
        for (var i = li; i < p.half_rot; i += WG) {
            let c = cs[pr * p.half_rot + i];
            var a: u32;
            var b: u32;
            if (p.neox != 0u) {
                a = p.rot_at + i;
                b = a + p.half_rot;
            } else {
                a = p.rot_at + 2u * i;
                b = a + 1u;
            }
            let x0 = hv[a];
            let x1 = hv[b];
            hv[a] = x0 * c.x - x1 * c.y;
            hv[b] = x0 * c.y + x1 * c.x;
        }
    }
    workgroupBarrier();
}

// `hv`, K or V head h of row t, stored as f16 into the cache at position ps (< n_ctx) and into the host's run.
fn store_head(t: u32, kind: u32, h: u32, ps: u32, li: u32) {
    let hd = select(p.hdk, p.hdv, kind == V_HEAD);
    let at = ((h * p.n_ctx + ps) * hd) / 2u;
    let k_rows = p.n_tok * p.hdk / 2u;
    let head_run = p.fresh_at + h * (k_rows + p.n_tok * p.hdv / 2u);
    let f = head_run + select(k_rows + t * p.hdv / 2u, t * p.hdk / 2u, kind == K_HEAD);
    for (var i = li; i < hd / 2u; i += WG) {
        // Rounded as the CPU rounds (f16.wgsl): pack2x16float's own rounding is the implementation's, and of
        // values that are f16 already every implementation's is exact.
        let w = pack2x16float(vec2<f32>(f16_round(hv[2u * i]), f16_round(hv[2u * i + 1u])));
        if (kind == K_HEAD) {
            kc[at + i] = w;
        } else {
            vc[at + i] = w;
        }
        fresh[f + i] = w;
    }
}
