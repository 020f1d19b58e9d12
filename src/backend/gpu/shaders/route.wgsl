// A mixture of experts' routing (model::moe::route, llama.cpp's build_moe_ffn), one thread per row: the router's
// logits of the row become probabilities in place (softmax or sigmoid); an expert's selection score is its
// probability plus its bias (exp_probs_b) where the layer has one; with groups, each group scores the sum of its
// two best scores and only the n_group_used best groups' experts may be chosen; the top k by score, in descending
// order, the lowest index first among equals (a NaN ranks below every number); their weights are their unbiased
// probabilities, renormalised to sum to 1 if asked (the sum clamped to f16's smallest normal), then scaled. The
// expert ids go to ids[row * k + j] and the weights to wts[row * k + j], in the row's top-k order, where the
// indexed matmuls (matmul.wgsl) and the weighted sum (moe.wgsl) read them: no read-back to the host.

struct Params {
    n_rows: u32,
    n_expert: u32,
    k: u32,
    // 0 softmax, 1 sigmoid.
    gating: u32,
    normalise: u32,
    // f32 bits.
    scale: u32,
    n_group: u32,
    n_group_used: u32,
    has_bias: u32,
    nx: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> probs: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> wts: array<f32>;

fn is_nan(a: f32) -> bool {
    return !(a == a);
}

// Strictly greater: the lowest index wins a tie (the caller walks up); a NaN ranks below every number.
fn better(a: f32, b: f32) -> bool {
    return a > b || (is_nan(b) && !is_nan(a));
}

fn score(base: u32, e: u32) -> f32 {
    if (p.has_bias != 0u) {
        return probs[base + e] + bias[e];
    }
    return probs[base + e];
}

@compute @workgroup_size(64)
fn route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = (wid.x + wid.y * p.nx) * 64u + li;
    if (row >= p.n_rows) {
        return;
    }
    let n = p.n_expert;
    let base = row * n;
    if (p.gating == 0u) {
        var mx = probs[base];
        for (var e = 1u; e < n; e++) {
            mx = max(mx, probs[base + e]);
        }
        var sum = 0.0;
        for (var e = 0u; e < n; e++) {
            let v = exp(probs[base + e] - mx);
            probs[base + e] = v;
            if (!is_nan(v)) {
                sum += v;
            }
        }
        let inv = 1.0 / sum;
        for (var e = 0u; e < n; e++) {
            probs[base + e] *= inv;
        }
    } else {
        for (var e = 0u; e < n; e++) {
            probs[base + e] = 1.0 / (1.0 + exp(-probs[base + e]));
        }
    }

    // The kept groups as a 64-bit mask (at most 64 groups, checked at upload); every expert without groups.
    var kept = vec2<u32>(0xffffffffu, 0xffffffffu);
    var per = n;
    if (p.n_group > 1u) {
        per = n / p.n_group;
        // -inf, which the CPU starts each group's two best from.
        let ninf = bitcast<f32>(0xff800000u);
        kept = vec2<u32>(0u, 0u);
        for (var round = 0u; round < p.n_group_used; round++) {
            var best = -1;
            var best_s = 0.0;
            for (var g = 0u; g < p.n_group; g++) {
                if ((kept[g / 32u] & (1u << (g % 32u))) != 0u) {
                    continue;
                }
                var a = ninf;
                var b = ninf;
                for (var e = g * per; e < (g + 1u) * per; e++) {
                    let s = score(base, e);
                    if (better(s, a)) {
                        b = a;
                        a = s;
                    } else if (better(s, b)) {
                        b = s;
                    }
                }
                let gs = a + b;
                if (best < 0 || better(gs, best_s)) {
                    best = i32(g);
                    best_s = gs;
                }
            }
            if (best >= 0) {
                let g = u32(best);
                kept[g / 32u] |= 1u << (g % 32u);
            }
        }
    }

    let out = row * p.k;
    for (var j = 0u; j < p.k; j++) {
        var best = -1;
        for (var e = 0u; e < n; e++) {
            let g = e / per;
            if ((kept[g / 32u] & (1u << (g % 32u))) == 0u) {
                continue;
            }
            var taken = false;
            for (var i = 0u; i < j; i++) {
                if (ids[out + i] == e) {
                    taken = true;
                }
            }
            if (taken) {
                continue;
            }
            if (best < 0 || better(score(base, e), score(base, u32(best)))) {
                best = i32(e);
            }
        }
        let e = u32(max(best, 0));
        ids[out + j] = e;
        wts[out + j] = probs[base + e];
    }
    if (p.normalise != 0u) {
        var sum = 0.0;
        for (var j = 0u; j < p.k; j++) {
            sum += wts[out + j];
        }
        sum = max(sum, 6.1035156e-5);
        for (var j = 0u; j < p.k; j++) {
            wts[out + j] /= sum;
        }
    }
    let scale = bitcast<f32>(p.scale);
    if (scale != 1.0) {
        for (var j = 0u; j < p.k; j++) {
            wts[out + j] *= scale;
        }
    }
}
