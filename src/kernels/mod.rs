//! The few coarse ops a forward pass needs. Quantized matmul (GEMV for decode, tiled GEMM for prefill) lives in
//! the per-format files; element-wise and attention helpers in [`ops`]. SIMD paths are chosen at run time and each
//! has a scalar reference it is tested against.

pub mod matrix;
pub mod ops;
pub mod pool;

pub use matrix::Matrix;
pub use pool::ThreadPool;

use crate::gguf::GgmlType;

/// Dequantizes one row: `src` holds `dst.len() / ty.block_size()` blocks of `ty`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let _ = (ty, src, dst);
    todo!("kernels owner")
}

/// Reusable buffers for [`matmul`] (quantized activations), so a decoded token allocates nothing.
#[derive(Default)]
pub struct Scratch {}

/// `y[t * w.rows + r] = Σ_k W[r, k] · x[t * w.cols + k]` for each of the `n_tok` input rows.
pub fn matmul(
    pool: &ThreadPool,
    w: &Matrix,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    scratch: &mut Scratch,
) {
    let _ = (pool, w, x, n_tok, y, scratch);
    todo!("kernels owner")
}
