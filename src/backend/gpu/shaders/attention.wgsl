// Causal attention over the f16 KV cache, one workgroup of 64 threads per (query head, row, split): the row at
// position pos[t] attends to positions lo..=pos[t] (lo = 0, or the sliding window's start). Positions go in chunks
// of 256 with a streaming softmax: each chunk's scores are kept in workgroup memory, the running maximum, sum and
// output are rescaled when the maximum grows. Query head h reads KV head h / (n_head / n_head_kv) (GQA).
//
// A decode step has few (head, row) pairs, far fewer workgroups than a GPU runs at once, so the positions are also
// split (flash decoding): with n_split > 1, workgroup z takes positions z·split..(z+1)·split of the row's range and
// writes its running maximum, sum and unnormalised output to `part`, and `merge` combines a row's splits.
//
// Cache layout, as the CPU's (engine::kv_cache): K [n_head_kv, n_ctx, hdk], V [n_head_kv, n_ctx, hdv], f16
// packed two to a word; hdk and hdv are even and at most 256.

struct Params {
    n_tok: u32,
    n_head: u32,
    n_head_kv: u32,
    hdk: u32,
    hdv: u32,
    n_ctx: u32,
    window: u32,
    scale: f32,
    // Positions per split (a multiple of CHUNK) and splits per (head, row).
    split: u32,
    n_split: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<u32>;
@group(0) @binding(3) var<storage, read> v: array<u32>;
@group(0) @binding(4) var<storage, read> pos: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
// With n_split > 1: per (row, head, split), the maximum, the sum and hdv unnormalised outputs.
@group(0) @binding(6) var<storage, read_write> part: array<f32>;

const WG: u32 = 64u;
const CHUNK: u32 = 256u;
// Output values per thread: hdv ≤ 256 = 4 · 64.
const PER: u32 = 4u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 256>;

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let z = wid.z;
    let kvh = h / (p.n_head / p.n_head_kv);
    var hi = pos[t] + 1u;
    var lo = 0u;
    if (p.window > 0u && hi > p.window) {
        lo = hi - p.window;
    }
    // This split's part of lo..hi (maybe none).
    lo = max(lo, z * p.split);
    hi = min(hi, (z + 1u) * p.split);
    let qb = (t * p.n_head + h) * p.hdk;
    for (var i = li; i < p.hdk; i += WG) {
        qs[i] = q[qb + i];
    }
    workgroupBarrier();

    let kbase = kvh * p.n_ctx * p.hdk;
    let vbase = kvh * p.n_ctx * p.hdv;
    var m = -3.0e38;
    var l = 0.0;
    var acc: array<f32, 4>;
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        let n = min(CHUNK, hi - c0);
        // Scores of this chunk, and their maximum.
        var cmax = -3.0e38;
        for (var j = li; j < n; j += WG) {
            let kb = (kbase + (c0 + j) * p.hdk) >> 1u;
            var s = 0.0;
            for (var i = 0u; i < p.hdk / 2u; i++) {
                let kv = unpack2x16float(k[kb + i]);
                s += qs[2u * i] * kv.x + qs[2u * i + 1u] * kv.y;
            }
            s *= p.scale;
            sc[j] = s;
            cmax = max(cmax, s);
        }
        let mnew = max(m, reduce_max(li, cmax));
        // Exponentials, their sum, and the rescaling of what came before.
        var part = 0.0;
        for (var j = li; j < n; j += WG) {
            let e = exp(sc[j] - mnew);
            sc[j] = e;
            part += e;
        }
        let csum = reduce_sum(li, part);
        let f = exp(m - mnew);
        l = l * f + csum;
        m = mnew;
        // Each thread's output values: dimension li + 64·r.
        for (var r = 0u; r < PER; r++) {
            let d = li + WG * r;
            if (d < p.hdv) {
                var s = acc[r] * f;
                for (var j = 0u; j < n; j++) {
                    let vi = vbase + (c0 + j) * p.hdv + d;
                    let vv = unpack2x16float(v[vi >> 1u]);
                    s += sc[j] * select(vv.x, vv.y, (vi & 1u) == 1u);
                }
                acc[r] = s;
            }
        }
        workgroupBarrier();
    }
    if (p.n_split > 1u) {
        let pb = ((t * p.n_head + h) * p.n_split + z) * (p.hdv + 2u);
        if (li == 0u) {
            part[pb] = m;
            part[pb + 1u] = l;
        }
        for (var r = 0u; r < PER; r++) {
            let d = li + WG * r;
            if (d < p.hdv) {
                part[pb + 2u + d] = acc[r];
            }
        }
        return;
    }
    let ob = (t * p.n_head + h) * p.hdv;
    for (var r = 0u; r < PER; r++) {
        let d = li + WG * r;
        if (d < p.hdv) {
            out[ob + d] = acc[r] / l;
        }
    }
}

// A row's splits combined, one workgroup per (head, row): each split's sum and outputs rescaled to the largest
// maximum. A split with no positions has maximum -3e38 and sum 0, so it adds nothing.
@compute @workgroup_size(64)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let pb = (t * p.n_head + h) * p.n_split * (p.hdv + 2u);
    var m = -3.0e38;
    for (var z = 0u; z < p.n_split; z++) {
        m = max(m, part[pb + z * (p.hdv + 2u)]);
    }
    var l = 0.0;
    for (var z = 0u; z < p.n_split; z++) {
        let b = pb + z * (p.hdv + 2u);
        l += part[b + 1u] * exp(part[b] - m);
    }
    let ob = (t * p.n_head + h) * p.hdv;
    for (var d = li; d < p.hdv; d += WG) {
        var s = 0.0;
        for (var z = 0u; z < p.n_split; z++) {
            let b = pb + z * (p.hdv + 2u);
            s += part[b + 2u + d] * exp(part[b] - m);
        }
        out[ob + d] = s / l;
    }
}
