//! `qwen3` (dense Qwen 3): llama's block with RMSNorm of each query and key head before RoPE (as Gemma 3, without its
//! other norms and scales), NeoX RoPE, and a head size that need not be `n_embd / n_head`.

use super::LayerWeights;
use super::blocks::{self, Buffers, Step};
use super::llama;
use crate::backend::RowsKv;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    blocks::norm_rows(s, x, &lw.attn_norm, &mut b.xn);
    blocks::qkv(s, lw, b);
    blocks::qk_norm(s, lw, b);
    blocks::rope_and_store(s, b, kv);
    blocks::attend(s, b, kv);
    blocks::attn_output(s, lw, b);
    blocks::add(s, x, &b.xn);
    llama::feed_forward(s, lw, x, b);
}
