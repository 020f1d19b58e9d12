// The parameters and bindings both mat-mul kernels (matmul.wgsl for decode, matmul_tiled.wgsl for prefill) take,
// in one place so they cannot drift apart: the Rust side fills one parameter block and one bind group layout for
// either kernel (matmul.rs).

struct Params {
    rows: u32,
    cols: u32,
    n_tok: u32,
    row_bytes: u32,
    units: u32,
    nx: u32,
    act: u32,
    y_stride: u32,
    row0: u32,
    // The indexed matmuls (matmul.wgsl): picks per row of x; 0 elsewhere.
    x_div: u32,
    // The tiled matmul (matmul_tiled.wgsl): slices of the columns ("split-K"), each summed into its own partial
    // product; 0 or 1: none.
    k_split: u32,
    // The decode mat-vecs that fold in an RMSNorm (matmul.wgsl's FUSE = 1): its epsilon.
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wa: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> wb: array<u32>;
// The grid i-quants' codebooks (quant.wgsl), bound only for those types.
@group(0) @binding(5) var<storage, read> iq_grid: array<u32>;
