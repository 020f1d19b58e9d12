// A batch's activations as f16 for the matrix-unit matmul (matmul_coop.wgsl): row r's values times 2^-k_r, packed
// two to a word (low half first) at words r·cols/2.., then each row's 2^k_r (f32 bits) after all rows. k_r is the
// least k ≥ 0 that brings the row's largest magnitude under 2^15, so a row keeps f16's 11 bits of precision and
// stays inside its range (65504); most rows take k = 0. A workgroup of 256 threads a row.

struct Params {
    rows: u32,
    cols: u32, // even
    nx: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<u32>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn halve(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x + wid.y * p.nx;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.cols;
    var m = 0.0;
    for (var i = li; i < p.cols; i += WG) {
        m = max(m, abs(x[base + i]));
    }
    m = reduce_max(li, m);
    // The exponent of m (0 for 0 and f32's subnormals), k from it, and the two powers of two by their bits.
    let e = i32((bitcast<u32>(m) >> 23u) & 0xffu) - 127;
    let k = u32(max(e - 14, 0));
    let down = bitcast<f32>((127u - min(k, 126u)) << 23u);
    let half_cols = p.cols / 2u;
    for (var i = li; i < half_cols; i += WG) {
        y[r * half_cols + i] = pack2x16float(vec2<f32>(x[base + 2u * i], x[base + 2u * i + 1u]) * down);
    }
    if (li == 0u) {
        y[p.rows * half_cols + r] = (127u + k) << 23u;
    }
}
