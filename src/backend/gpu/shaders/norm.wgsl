// RMSNorm: out = x / sqrt(mean(x²) + eps) · w, one row per workgroup of 256 threads. The sum of squares is
// taken in f32 (the CPU takes it in f64): partial sums per thread, then subgroup shuffles and workgroup memory
// (reduce.wgsl). And the residual add fused with the RMSNorm that follows it (add_rms_norm), one dispatch where
// there were two or three.

struct Params {
    n_rows: u32,
    width: u32,
    eps: f32,
    nx: u32,
    // add_rms_norm: whether the added rows are RMS-normalised by `pw` first (Gemma 3's post-norms).
    post: u32,
    // rms_norm: where row r of `x` starts, r·x_stride + x_at (a slice of wider rows: DeepSeek's compressed KV
    // vector sits before its RoPE key).
    x_stride: u32,
    x_at: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read_write> io: array<f32>;
@group(0) @binding(5) var<storage, read_write> res: array<f32>;
@group(0) @binding(6) var<storage, read> pw: array<f32>;

const WG: u32 = 256u;

// 1 / rms of a row, from each thread's partial sum of squares (reduce.wgsl).
fn inv_rms(li: u32, part: f32) -> f32 {
    return 1.0 / sqrt(reduce_sum(li, part) / f32(p.width) + p.eps);
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x + wid.y * p.nx;
    if (r >= p.n_rows) {
        return;
    }
    let src = r * p.x_stride + p.x_at;
    var part = 0.0;
    for (var i = li; i < p.width; i += WG) {
        let v = x[src + i];
        part += v * v;
    }
    let scale = inv_rms(li, part);
    let base = r * p.width;
    for (var i = li; i < p.width; i += WG) {
        out[base + i] = x[src + i] * scale * w[i];
    }
}

@compute @workgroup_size(256)
fn rms_norm_inplace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x + wid.y * p.nx;
    if (r >= p.n_rows) {
        return;
    }
    let base = r * p.width;
    var part = 0.0;
    for (var i = li; i < p.width; i += WG) {
        let v = io[base + i];
        part += v * v;
    }
    let scale = inv_rms(li, part);
    for (var i = li; i < p.width; i += WG) {
        io[base + i] = io[base + i] * scale * w[i];
    }
}

// The residual add and the next RMSNorm, in the CPU's order: y = io's row (first y = rmsnorm(y)·pw where p.post is
// set), res += y, then io = rmsnorm(res)·w. Each thread reads back only the values it wrote itself.
@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x + wid.y * p.nx;
    if (r >= p.n_rows) {
        return;
    }
    let base = r * p.width;
    // The sum of squares of the new residual is taken as it is written (from the value in hand, not read back).
    var part = 0.0;
    if (p.post != 0u) {
        var ypart = 0.0;
        for (var i = li; i < p.width; i += WG) {
            let v = io[base + i];
            ypart += v * v;
        }
        let yscale = inv_rms(li, ypart);
        for (var i = li; i < p.width; i += WG) {
            let v = res[base + i] + io[base + i] * yscale * pw[i];
            res[base + i] = v;
            part += v * v;
        }
    } else {
        for (var i = li; i < p.width; i += WG) {
            let v = res[base + i] + io[base + i];
            res[base + i] = v;
            part += v * v;
        }
    }
    let scale = inv_rms(li, part);
    for (var i = li; i < p.width; i += WG) {
        io[base + i] = res[base + i] * scale * w[i];
    }
}
