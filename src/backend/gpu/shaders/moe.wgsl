// A mixture of experts' output: each row's picks' expert outputs weighted by their routing weights and summed in
// the row's top-k order, as the CPU's (model::moe::ffn, llama.cpp's chain of adds): y[t, i] = o[t·k, i]·w[t·k] +
// o[t·k + 1, i]·w[t·k + 1] + ..., then the shared experts' output sh[t, i] added (moe_sum_shared). One thread per
// output value.

struct Params {
    n: u32,
    width: u32,
    k: u32,
    nx: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> o: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> sh: array<f32>;

fn weighted(i: u32) -> f32 {
    let t = i / p.width;
    let c = i % p.width;
    var s = o[t * p.k * p.width + c] * w[t * p.k];
    for (var j = 1u; j < p.k; j++) {
        let slot = t * p.k + j;
        s += o[slot * p.width + c] * w[slot];
    }
    return s;
}

@compute @workgroup_size(256)
fn moe_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * p.nx) * 256u + li;
    if (i < p.n) {
        y[i] = weighted(i);
    }
}

@compute @workgroup_size(256)
fn moe_sum_shared(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * p.nx) * 256u + li;
    if (i < p.n) {
        y[i] = weighted(i) + sh[i];
    }
}
