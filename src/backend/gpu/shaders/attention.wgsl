// Causal attention over the f16 KV cache, one workgroup of 256 threads per (query head, ROWS rows, split): the
// row at position pos[t] attends to positions lo..=pos[t] (lo = 0, or the sliding window's start). Positions go in
// chunks of 256 with a streaming softmax: each chunk's scores are kept in workgroup memory, the running maximum, sum
// and output are rescaled when the maximum grows. Query head h reads KV head h / (n_head / n_head_kv) (GQA).
//
// ROWS is 1 (Red = f32) for a decode step, 4 (Red = vec4<f32>, a row a component) for a batch: the module's head
// (attention.rs) defines ROWS, Red and the two helpers `lane` and `pick`. A batch's 4 rows then share each key and
// value the workgroup loads, a quarter of the loads of one row a workgroup, and the vector arithmetic is the same
// per row as the scalar. Rows past the batch, and positions outside a row's range, score -3e38 and weigh 0.
//
// A decode step has few (head, row) pairs, far fewer workgroups than a GPU runs at once, so the positions are also
// split (flash decoding): with n_split > 1, workgroup z takes positions z·split..(z+1)·split of the rows' range and
// writes its running maximum, sum and unnormalised output to `part`, and `merge` combines a row's splits.
//
// The module's head says where the queries come from (attention.rs): attention_cached.wgsl reads them rotated
// (rope.wgsl's), from the cache all the keys and values; attention_fresh.wgsl (a decode step, ROWS 1) makes each
// workgroup's query head ready itself from the projections (qkv_head.wgsl), and the K and V of the row's own
// position too, which it attends to without reading them back and stores into the cache (FRESH), so that the
// rotation needs no dispatch of its own.
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
    // From here as rope.wgsl's, for attention_fresh.wgsl (rope.rs, `Ready::words`; zeros otherwise).
    half_rot: u32,
    neox: u32,
    rope_ctx: u32,
    eps: f32,
    bq: u32,
    bk: u32,
    bv: u32,
    qn: u32,
    kn: u32,
    fresh_at: u32,
    // The first dimension of a Q or K head that RoPE turns (DeepSeek's heads end in their rotated part).
    rot_at: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The queries and the cache `kc` and `vc` are the head's bindings (1 to 6 and 8).
@group(0) @binding(7) var<storage, read> pos: array<u32>;
@group(0) @binding(9) var<storage, read_write> out: array<f32>;
// With n_split > 1: per (row, head, split), the maximum, the sum and hdv unnormalised outputs.
@group(0) @binding(10) var<storage, read_write> part: array<f32>;

const WG: u32 = 256u;
const CHUNK: u32 = 256u;

// The rows' queries (dimension i of row r in qs[i][r]) and a chunk's weights.
var<workgroup> qs: array<Red, 256>;
var<workgroup> sc: array<Red, 256>;

// A key's scores against the queries in `qs`: the dot products of hdk values, the key f16 from word kb on, in two
// sums so that two loads are in flight.
fn score(kb: u32) -> Red {
    let hw = p.hdk / 2u;
    var s0 = Red(0.0);
    var s1 = Red(0.0);
    var i = 0u;
    for (; i + 1u < hw; i += 2u) {
        let a = unpack2x16float(kc[kb + i]);
        let b = unpack2x16float(kc[kb + i + 1u]);
        s0 += qs[2u * i] * a.x + qs[2u * i + 1u] * a.y;
        s1 += qs[2u * i + 2u] * b.x + qs[2u * i + 3u] * b.y;
    }
    if (i < hw) {
        let a = unpack2x16float(kc[kb + i]);
        s0 += qs[2u * i] * a.x + qs[2u * i + 1u] * a.y;
    }
    return (s0 + s1) * p.scale;
}

// Value dimension d of position `at` (f16, two to a word).
fn value(at: u32, d: u32) -> f32 {
    let vi = at * p.hdv + d;
    let vv = unpack2x16float(vc[vi >> 1u]);
    return select(vv.x, vv.y, (vi & 1u) == 1u);
}

// Each thread scores one position of a chunk (for every row). For the weighted sum of values, thread li takes
// dimension li % hdv of the positions j ≡ g (mod ng), g = li / hdv: ng = 256 / hdv groups of threads (4 for heads
// of 64) walk a chunk's positions side by side, two at a time, and their sums are added at the end.
@compute @workgroup_size(256)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t0 = wid.y * ROWS;
    let z = wid.z;
    let kvh = h / (p.n_head / p.n_head_kv);
    // Each row's range rlo..rhi (empty past the batch), and the workgroup's lo..hi, which holds them all.
    var rlo: array<u32, ROWS>;
    var rhi: array<u32, ROWS>;
    var lo = 0xffffffffu;
    var hi = 0u;
    for (var r = 0u; r < ROWS; r++) {
        rlo[r] = 0u;
        rhi[r] = 0u;
        if (t0 + r < p.n_tok) {
            rhi[r] = pos[t0 + r] + 1u;
            if (p.window > 0u && rhi[r] > p.window) {
                rlo[r] = rhi[r] - p.window;
            }
            lo = min(lo, rlo[r]);
            hi = max(hi, rhi[r]);
        }
    }
    // This split's part of lo..hi (maybe none); with FRESH, the row's own position is not read from the cache.
    lo = max(lo, z * p.split);
    hi = min(hi, (z + 1u) * p.split);
    if (FRESH) {
        hi = min(hi, rhi[0] - 1u);
    }
    queries(h, t0, li);
    workgroupBarrier();

    let kbase = kvh * p.n_ctx * p.hdk;
    let vpos = kvh * p.n_ctx;
    let ng = WG / p.hdv;
    let g = li / p.hdv;
    let d = li % p.hdv;
    var m = Red(-3.0e38);
    var l = Red(0.0);
    var acc = Red(0.0);
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        let n = min(CHUNK, hi - c0);
        // This thread's scores, those of rows whose range holds the position, and the chunk's maxima.
        var s = Red(-3.0e38);
        if (li < n) {
            let at = c0 + li;
            let all = score((kbase + at * p.hdk) >> 1u);
            for (var r = 0u; r < ROWS; r++) {
                if (at >= rlo[r] && at < rhi[r]) {
                    lane(&s, r, pick(all, r));
                }
            }
        }
        let mnew = max(m, reduce_max(li, s));
        // Exponentials (0 where there is no score), their sum (whose barriers publish `sc`), and the rescaling of
        // what came before.
        let e = select(Red(0.0), exp(s - mnew), s > Red(-1.0e38));
        if (li < n) {
            sc[li] = e;
        }
        let csum = reduce_sum(li, e);
        let f = exp(m - mnew);
        l = l * f + csum;
        m = mnew;
        if (g < ng) {
            var a0 = acc * f;
            var a1 = Red(0.0);
            var j = g;
            for (; j + ng < n; j += 2u * ng) {
                a0 += sc[j] * value(vpos + c0 + j, d);
                a1 += sc[j + ng] * value(vpos + c0 + j + ng, d);
            }
            if (j < n) {
                a0 += sc[j] * value(vpos + c0 + j, d);
            }
            acc = a0 + a1;
        }
        workgroupBarrier();
    }
    if (FRESH) {
        fresh_position(h, kvh, z, li, g, d, &m, &l, &acc);
    }
    // The groups' sums added: group g's in sc[g·hdv + d], summed by the first hdv threads.
    if (g < ng) {
        sc[li] = acc;
    }
    workgroupBarrier();
    if (li >= p.hdv) {
        return;
    }
    var o = Red(0.0);
    for (var gg = 0u; gg < ng; gg++) {
        o += sc[gg * p.hdv + li];
    }
    for (var r = 0u; r < ROWS; r++) {
        let t = t0 + r;
        if (t >= p.n_tok) {
            break;
        }
        if (p.n_split > 1u) {
            let pb = ((t * p.n_head + h) * p.n_split + z) * (p.hdv + 2u);
            if (li == 0u) {
                part[pb] = pick(m, r);
                part[pb + 1u] = pick(l, r);
            }
            part[pb + 2u + li] = pick(o, r);
        } else {
            out[(t * p.n_head + h) * p.hdv + li] = pick(o, r) / pick(l, r);
        }
    }
}

// A row's splits combined, one workgroup per (head, row): each split's sum and outputs rescaled to the largest
// maximum. A split with no positions has maximum -3e38 and sum 0, so it adds nothing.
@compute @workgroup_size(256)
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
