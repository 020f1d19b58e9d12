//! The KV cache of one layer range: preallocated for the session's context, written in place, positions in order.
//! Per layer, K is `[n_head_kv, n_ctx, head_dim_k]` (after RoPE) and V `[n_head_kv, n_ctx, head_dim_v]`, which is
//! also the layout of snapshots and of KV on the wire, so export is a copy of contiguous runs.
//!
//! Values are stored in f16, as llama.cpp stores them by default: a decode step at a long context reads every
//! cached row, so half the bytes is nearly half the time there, and half the memory. Snapshots and the wire carry
//! them as f32, f16 (exact), bf16 or 8 bits ([`KvBlock`] carries them as f32; `engine::snapshot` converts).

use crate::backend::{KvLayers, LayerKv};
use crate::model::Hparams;
use anyhow::{Result, bail};
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
    /// Saturates instead of overflowing: memory checks compare it with what a machine has.
    pub fn bytes_for(hp: &Hparams, n_layers: usize, n_ctx: usize) -> usize {
        LayerKv::bytes_for(n_layers, hp.n_head_kv, n_ctx, hp.head_dim_k, hp.head_dim_v)
    }
}

impl KvLayers for KvCache {
    fn kv_layer(&self, il: usize) -> (&[f16], &[f16], usize) {
        let (k, v) = self.layer(il);
        (k, v, self.n_ctx)
    }

    fn kv_layer_mut(&mut self, il: usize) -> LayerKv<'_> {
        self.layer_mut(il)
    }
}

/// Appends `src` widened to f32 to `out`.
fn widen_into(src: &[f16], out: &mut Vec<f32>) {
    let n = out.len();
    out.resize(n + src.len(), 0.0);
    src.convert_to_f32_slice(&mut out[n..]);
}

/// KV rows of a layer range for a position range, in the snapshot layout: per layer, K `[n_head_kv, n_pos,
/// head_dim_k]` and V `[n_head_kv, n_pos, head_dim_v]`. What a snapshot file holds and what one KV chunk on the wire
/// carries (disaggregated prefill), so both use `snapshot::encode_block` and `snapshot::decode_block`.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBlock {
    pub layers: Range<usize>,
    pub pos: Range<usize>,
    /// One entry per layer of `layers`.
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    /// Token ids of the positions, when known.
    pub tokens: Option<Vec<u32>>,
}

impl KvBlock {
    /// Copies layers `layers`, positions `pos` out of a cache (which must hold them).
    pub fn from_cache(kv: &KvCache, layers: Range<usize>, pos: Range<usize>) -> KvBlock {
        let n_pos = pos.len();
        let mut k = Vec::with_capacity(layers.len());
        let mut v = Vec::with_capacity(layers.len());
        for il in layers.clone() {
            let mut kr = Vec::with_capacity(kv.n_head_kv * n_pos * kv.head_dim_k);
            let mut vr = Vec::with_capacity(kv.n_head_kv * n_pos * kv.head_dim_v);
            for h in 0..kv.n_head_kv {
                kv.read_k_rows(il, h, pos.clone(), &mut kr);
                kv.read_v_rows(il, h, pos.clone(), &mut vr);
            }
            k.push(kr);
            v.push(vr);
        }
        KvBlock {
            layers,
            pos,
            k,
            v,
            tokens: None,
        }
    }

    /// Writes the rows into a cache that holds the block's layers and has room for its positions. Does not change
    /// which positions the cache counts as valid (the caller does, once every layer is in).
    pub fn write_into(&self, kv: &mut KvCache) -> Result<()> {
        if self.layers.start < kv.layers.start || self.layers.end > kv.layers.end || self.pos.end > kv.n_ctx {
            bail!(
                "KV of layers {:?} positions {:?} does not fit a cache of layers {:?} and {} positions",
                self.layers,
                self.pos,
                kv.layers,
                kv.n_ctx
            );
        }
        let n_pos = self.pos.len();
        let (dk, dv) = (kv.head_dim_k, kv.head_dim_v);
        for (i, il) in self.layers.clone().enumerate() {
            for h in 0..kv.n_head_kv {
                kv.write_k_rows(
                    il,
                    h,
                    self.pos.clone(),
                    &self.k[i][h * n_pos * dk..(h + 1) * n_pos * dk],
                );
                kv.write_v_rows(
                    il,
                    h,
                    self.pos.clone(),
                    &self.v[i][h * n_pos * dv..(h + 1) * n_pos * dv],
                );
            }
        }
        Ok(())
    }
}
