//! The KV cache of one layer range: preallocated for the session's context, written in place, positions in order.
//! Per layer, K is `[n_head_kv, n_ctx, head_dim_k]` (after RoPE) and V `[n_head_kv, n_ctx, head_dim_v]`, which is
//! also the layout of snapshots and of KV on the wire, so export is a copy of contiguous runs.
//!
//! Values are stored in f16, as llama.cpp stores them by default: a decode step at a long context reads every
//! cached row, so half the bytes is nearly half the time there, and half the memory. Snapshots and the wire carry
//! them as f32, f16 (exact), bf16 or 8 bits ([`crate::engine::snapshot::KvBlock`] converts).

use crate::backend::LayerKv;
use crate::model::Hparams;
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::ops::Range;

pub struct KvCache {
    /// Global indices of the layers held.
    pub layers: Range<usize>,
    pub n_ctx: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    /// Positions `0..n_pos` hold valid entries.
    n_pos: usize,
}

impl KvCache {
    pub fn new(hp: &Hparams, layers: Range<usize>, n_ctx: usize) -> KvCache {
        let n = layers.len();
        KvCache {
            k: (0..n)
                .map(|_| vec![f16::ZERO; hp.n_head_kv * n_ctx * hp.head_dim_k])
                .collect(),
            v: (0..n)
                .map(|_| vec![f16::ZERO; hp.n_head_kv * n_ctx * hp.head_dim_v])
                .collect(),
            layers,
            n_ctx,
            n_head_kv: hp.n_head_kv,
            head_dim_k: hp.head_dim_k,
            head_dim_v: hp.head_dim_v,
            n_pos: 0,
        }
    }

    pub fn n_pos(&self) -> usize {
        self.n_pos
    }

    /// Marks positions `0..n` as valid (after a forward pass or an import wrote them).
    pub fn set_n_pos(&mut self, n: usize) {
        assert!(n <= self.n_ctx);
        self.n_pos = n;
    }

    /// Forgets every position from `n` on; the next write goes to position `n`.
    pub fn rewind(&mut self, n: usize) {
        self.n_pos = self.n_pos.min(n);
    }

    pub fn layer_mut(&mut self, il: usize) -> LayerKv<'_> {
        let i = il - self.layers.start;
        LayerKv {
            k: &mut self.k[i],
            v: &mut self.v[i],
            n_ctx: self.n_ctx,
        }
    }

    /// One layer's K and V to read (the layout of [`KvCache::layer_mut`]).
    pub fn layer(&self, il: usize) -> (&[f16], &[f16]) {
        let i = il - self.layers.start;
        (&self.k[i], &self.v[i])
    }

    /// K rows of one head for positions `pos`: `[pos.len(), head_dim_k]`, contiguous.
    pub fn k_rows(&self, il: usize, head: usize, pos: Range<usize>) -> &[f16] {
        let i = il - self.layers.start;
        let d = self.head_dim_k;
        &self.k[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d]
    }

    pub fn v_rows(&self, il: usize, head: usize, pos: Range<usize>) -> &[f16] {
        let i = il - self.layers.start;
        let d = self.head_dim_v;
        &self.v[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d]
    }

    /// Appends the K rows of one head for positions `pos` to `out`, widened to f32.
    pub fn read_k_rows(&self, il: usize, head: usize, pos: Range<usize>, out: &mut Vec<f32>) {
        widen_into(self.k_rows(il, head, pos), out);
    }

    /// Appends the V rows of one head for positions `pos` to `out`, widened to f32.
    pub fn read_v_rows(&self, il: usize, head: usize, pos: Range<usize>, out: &mut Vec<f32>) {
        widen_into(self.v_rows(il, head, pos), out);
    }

    /// Stores the K rows of one head for positions `pos` (`[pos.len(), head_dim_k]`, rounded to f16).
    pub fn write_k_rows(&mut self, il: usize, head: usize, pos: Range<usize>, rows: &[f32]) {
        let i = il - self.layers.start;
        let d = self.head_dim_k;
        self.k[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d].convert_from_f32_slice(rows);
    }

    /// Stores the V rows of one head for positions `pos` (`[pos.len(), head_dim_v]`, rounded to f16).
    pub fn write_v_rows(&mut self, il: usize, head: usize, pos: Range<usize>, rows: &[f32]) {
        let i = il - self.layers.start;
        let d = self.head_dim_v;
        self.v[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d].convert_from_f32_slice(rows);
    }

    /// Bytes held (both K and V, all layers, whole context).
    pub fn size_bytes(&self) -> usize {
        self.layers.len() * self.n_head_kv * self.n_ctx * (self.head_dim_k + self.head_dim_v) * 2
    }

    /// Bytes a cache of `n_layers` layers of `hp` over `n_ctx` positions holds.
    pub fn bytes_for(hp: &Hparams, n_layers: usize, n_ctx: usize) -> usize {
        n_layers * hp.n_head_kv * n_ctx * (hp.head_dim_k + hp.head_dim_v) * 2
    }
}

/// Appends `src` widened to f32 to `out`.
fn widen_into(src: &[f16], out: &mut Vec<f32>) {
    let n = out.len();
    out.resize(n + src.len(), 0.0);
    src.convert_to_f32_slice(&mut out[n..]);
}
