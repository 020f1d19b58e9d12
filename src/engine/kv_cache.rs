//! The KV cache of one layer range: preallocated for the session's context, written in place, positions in order.
//! Per layer, K is `[n_head_kv, n_ctx, head_dim_k]` (after RoPE) and V `[n_head_kv, n_ctx, head_dim_v]`, which is
//! also the layout of snapshots and of KV on the wire, so export is a copy of contiguous runs.

use crate::model::Hparams;
use crate::model::blocks::LayerKv;
use std::ops::Range;

pub struct KvCache {
    /// Global indices of the layers held.
    pub layers: Range<usize>,
    pub n_ctx: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Positions `0..n_pos` hold valid entries.
    n_pos: usize,
}

impl KvCache {
    pub fn new(hp: &Hparams, layers: Range<usize>, n_ctx: usize) -> KvCache {
        let n = layers.len();
        KvCache {
            k: (0..n)
                .map(|_| vec![0.0; hp.n_head_kv * n_ctx * hp.head_dim_k])
                .collect(),
            v: (0..n)
                .map(|_| vec![0.0; hp.n_head_kv * n_ctx * hp.head_dim_v])
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
    pub fn layer(&self, il: usize) -> (&[f32], &[f32]) {
        let i = il - self.layers.start;
        (&self.k[i], &self.v[i])
    }

    /// K rows of one head for positions `pos`: `[pos.len(), head_dim_k]`, contiguous.
    pub fn k_rows(&self, il: usize, head: usize, pos: Range<usize>) -> &[f32] {
        let i = il - self.layers.start;
        let d = self.head_dim_k;
        &self.k[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d]
    }

    pub fn v_rows(&self, il: usize, head: usize, pos: Range<usize>) -> &[f32] {
        let i = il - self.layers.start;
        let d = self.head_dim_v;
        &self.v[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d]
    }

    pub fn k_rows_mut(&mut self, il: usize, head: usize, pos: Range<usize>) -> &mut [f32] {
        let i = il - self.layers.start;
        let d = self.head_dim_k;
        &mut self.k[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d]
    }

    pub fn v_rows_mut(&mut self, il: usize, head: usize, pos: Range<usize>) -> &mut [f32] {
        let i = il - self.layers.start;
        let d = self.head_dim_v;
        &mut self.v[i][(head * self.n_ctx + pos.start) * d..(head * self.n_ctx + pos.end) * d]
    }

    /// Bytes held (both K and V, all layers, whole context).
    pub fn size_bytes(&self) -> usize {
        self.layers.len() * self.n_head_kv * self.n_ctx * (self.head_dim_k + self.head_dim_v) * 4
    }

    /// Bytes a cache of `n_layers` layers of `hp` over `n_ctx` positions holds.
    pub fn bytes_for(hp: &Hparams, n_layers: usize, n_ctx: usize) -> usize {
        n_layers * hp.n_head_kv * n_ctx * (hp.head_dim_k + hp.head_dim_v) * 4
    }
}
