//! `ggml_compute_forward_mul_mat` as llama.cpp runs it on x86 for the weight types it supports here: the activation
//! rows quantized by ggml's quantizer for the weight type's `vec_dot_type`, then each output one [`super::dot`]
//! kernel in ggml's lane order. Each output's arithmetic does not depend on how ggml splits the work over threads or
//! tiles (tinyBLAS and `vec_dot` accumulate every output on its own), so the split here is Baton's.

use super::{dot, kquant, quant};
use crate::gguf::GgmlType;
use crate::kernels::matrix::{Layout, Matrix};
use crate::kernels::{SyncPtr, ThreadPool, interleaved, pool::split_range};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Whether [`matmul`] reproduces llama.cpp for weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K
    )
}

/// Row `r` of `w` as ggml stores it (its blocks in order), gathered from an interleaved layout when repacked.
pub fn row_bytes<'a>(w: &'a Matrix, r: usize, buf: &'a mut Vec<u8>) -> &'a [u8] {
    let rb = w.row_bytes();
    let grouped = w.rows / interleaved::ROWS * interleaved::ROWS;
    match w.layout {
        Layout::Rows => &w.bytes()[r * rb..(r + 1) * rb],
        Layout::X16 if r >= grouped => {
            let off = w.interleaved_tail_offset(r);
            &w.bytes()[off..off + rb]
        }
        Layout::X16 => {
            let nb = w.cols / w.ty.block_size();
            let (bs, gbb) = (w.ty.type_size(), interleaved::group_block(w.ty));
            buf.resize(rb, 0);
            let g = &w.bytes()[(r / interleaved::ROWS) * nb * gbb..];
            let mut blk = [0u8; interleaved::MAX_BLOCK];
            for b in 0..nb {
                let n = interleaved::unpack_block_into(w.ty, &g[b * gbb..], r % interleaved::ROWS, &mut blk);
                buf[b * bs..b * bs + n].copy_from_slice(&blk[..n]);
            }
            &buf[..rb]
        }
    }
}

/// `y[t * w.rows + r] = W[r] · x[t]` with llama.cpp's arithmetic (see the module). Panics for a weight type that
/// [`supports`] rejects.
pub fn matmul(pool: &ThreadPool, w: &Matrix, x: &[f32], n_tok: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(x.len() >= n_tok * cols && y.len() >= n_tok * rows);
    if matches!(w.ty, GgmlType::Q4K | GgmlType::Q6K) {
        return matmul_k(pool, w, x, n_tok, y);
    }
    let nb = cols / 32;
    type Quantize = fn(&[f32], &mut [u8]);
    type VecDot = fn(usize, &[u8], &[u8]) -> f32;
    let (xrb, quantize, vec_dot): (usize, Quantize, VecDot) = match w.ty {
        GgmlType::Q4_1 => (nb * dot::Q8_1, quant::quantize_row_q8_1, dot::dot_q4_1_q8_1),
        GgmlType::Q8_0 => (nb * dot::Q8_0, quant::quantize_row_q8_0, dot::dot_q8_0_q8_0),
        GgmlType::Q5_0 => (nb * dot::Q8_0, quant::quantize_row_q8_0, dot::dot_q5_0_q8_0),
        ty => panic!("ggml numerics: no {ty} matmul"),
    };
    let mut xq = vec![0u8; n_tok * xrb];
    {
        let p = xq.as_mut_ptr() as usize;
        pool.run(|i, n| {
            for t in split_range(n_tok, i, n) {
                // SAFETY: each thread quantizes its own token rows.
                let out = unsafe { std::slice::from_raw_parts_mut((p as *mut u8).add(t * xrb), xrb) };
                quantize(&x[t * cols..(t + 1) * cols], out);
            }
        });
    }
    let yp = SyncPtr::new(y.as_mut_ptr());
    for_each_row(pool, rows, 16, |r, buf: &mut Vec<u8>| {
        let wr = row_bytes(w, r, buf);
        for t in 0..n_tok {
            let v = vec_dot(nb, wr, &xq[t * xrb..(t + 1) * xrb]);
            // SAFETY: output (t, r) belongs to the thread that took row r.
            unsafe { *yp.get().add(t * rows + r) = v };
        }
    });
}

/// Deals the weight rows to the pool's threads `chunk` at a time, in order; `row(r, state)` computes row `r`'s output
/// for every token, with a per-thread `state` (unpacked-row buffers) kept from row to row.
fn for_each_row<S: Default>(pool: &ThreadPool, rows: usize, chunk: usize, row: impl Fn(usize, &mut S) + Sync) {
    let next = AtomicUsize::new(0);
    pool.run(|_, _| {
        let mut state = S::default();
        loop {
            let r0 = next.fetch_add(1, Ordering::Relaxed) * chunk;
            if r0 >= rows {
                break;
            }
            for r in r0..(r0 + chunk).min(rows) {
                row(r, &mut state);
            }
        }
    });
}

/// [`matmul`] for Q4_K and Q6_K weights ([`kquant`]): the activations quantized to Q8_K (Q4_K: whole groups of four
/// rows as `ggml_quantize_mat_q8_K_4x8` does, the rest as `quantize_row_q8_K`), then each weight row unpacked once
/// and dotted with every activation row.
fn matmul_k(pool: &ThreadPool, w: &Matrix, x: &[f32], n_tok: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let q4 = w.ty == GgmlType::Q4K;
    let grouped = if q4 { n_tok / 4 * 4 } else { 0 };
    let mut xq = kquant::Q8K::new(n_tok, cols);
    {
        let xp = SyncQ8K(&mut xq as *mut kquant::Q8K);
        pool.run(|i, n| {
            for t in split_range(n_tok, i, n) {
                let block = if t < grouped {
                    kquant::quantize_block_q8_k_4x8
                } else {
                    kquant::quantize_block_q8_k_ref
                };
                // SAFETY: each thread writes only its own token rows of the buffers.
                kquant::quantize_row(&x[t * cols..(t + 1) * cols], unsafe { &mut *xp.get() }, t, block);
            }
        });
    }
    let yp = SyncPtr::new(y.as_mut_ptr());
    let xq = &xq;
    type State = (Vec<u8>, kquant::RowQ4K, kquant::RowQ6K);
    for_each_row(pool, rows, 8, |r, (buf, r4, r6): &mut State| {
        let wr = row_bytes(w, r, buf);
        if q4 {
            r4.unpack(wr, cols);
        } else {
            r6.unpack(wr, cols);
        }
        for t in 0..n_tok {
            let v = if q4 {
                kquant::dot_q4_k(r4, xq, t)
            } else {
                kquant::dot_q6_k(r6, xq, t)
            };
            // SAFETY: output (t, r) belongs to the thread that took row r.
            unsafe { *yp.get().add(t * rows + r) = v };
        }
    });
}

#[derive(Clone, Copy)]
struct SyncQ8K(*mut kquant::Q8K);
// SAFETY: used for disjoint per-row writes within one pool job.
unsafe impl Send for SyncQ8K {}
unsafe impl Sync for SyncQ8K {}
impl SyncQ8K {
    fn get(self) -> *mut kquant::Q8K {
        self.0
    }
}
