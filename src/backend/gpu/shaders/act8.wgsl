// A batch's activations rounded to the 8-bit grid the CPU backend quantizes them to before a matmul of quantized
// weights (kernels/table.rs): blocks of 32 with the scale d = f16(amax / 127) for Q4_0..Q8_0 (Q8_0 and Q8_1), or
// of 256 with d = max / -127 for the K- and i-quants (Q8_K, `max` the value of largest magnitude). The f32 matmul
// kernels then take d·q in place of x, so a batch's products are the CPU's up to the order of the sums.
//
// A workgroup of 64 threads rounds 256 values, 4 a thread; a block is `group` threads (8 or 64). Blocks never
// cross a workgroup: rows are whole blocks, and 256 is a whole number of either.

struct Params {
    n: u32,     // values (rows × columns, a multiple of 32)
    nx: u32,    // workgroups in a grid row
    group: u32, // threads per block: 8 (blocks of 32) or 64 (blocks of 256)
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;

// Each thread's value of largest magnitude, with its sign.
var<workgroup> big: array<f32, 64>;

// The first value of largest magnitude, as the CPU's loops find it: only a strictly larger one replaces it.
fn larger(m: f32, c: f32) -> f32 {
    return select(m, c, abs(c) > abs(m));
}

@compute @workgroup_size(64)
fn round8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = (wid.x + wid.y * p.nx) * 64u + li;
    let live = i * 4u < p.n;
    var v = vec4<f32>(0.0);
    if (live) {
        v = x[i];
    }
    big[li] = larger(larger(larger(larger(0.0, v.x), v.y), v.z), v.w);
    workgroupBarrier();
    let g0 = li / p.group * p.group;
    var m = 0.0;
    for (var t = g0; t < g0 + p.group; t++) {
        m = larger(m, big[t]);
    }
    if (!live) {
        return;
    }
    if (m == 0.0) {
        y[i] = vec4<f32>(0.0);
        return;
    }
    if (p.group == 64u) {
        // Q8_K: the largest value maps to -127; the scale kept is 1 / iscale, in f32.
        let iscale = -127.0 / m;
        y[i] = (1.0 / iscale) * min(round(iscale * v), vec4<f32>(127.0));
    } else {
        // Q8_0 / Q8_1: the scale is stored as f16, the quants taken with the f32 one.
        let a = abs(m);
        let d = f16_round(a / 127.0);
        y[i] = d * round(v * (127.0 / a));
    }
}
