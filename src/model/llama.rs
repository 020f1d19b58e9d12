//! `llama` (SmolLM2 and the Llama family): pre-norm blocks with RMSNorm, grouped-query attention with RoPE on
//! adjacent pairs, and a SwiGLU feed-forward. Also Qwen 2: the same block, with the Q/K/V biases [`blocks::qkv`] adds
//! where a layer has them (llama.cpp's llama graph adds them too) and NeoX RoPE (from [`super::Hparams`]).

use super::LayerWeights;
use super::blocks::{self, Buffers, Step};
use crate::backend::RowsKv;
use crate::kernels::Glu;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    // Attention.
    blocks::norm_rows(s, x, &lw.attn_norm, &mut b.xn);
    blocks::qkv(s, lw, b);
    blocks::rope_and_store(s, b, kv);
    blocks::attend(s, b, kv);
    blocks::attn_output(s, lw, b);
    blocks::add(s, x, &b.xn);

    feed_forward(s, lw, x, b);
}

/// The SwiGLU feed-forward sub-block with its pre-norm and residual add: `x += down(silu(gate(n)) * up(n))`.
pub fn feed_forward(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers) {
    blocks::norm_rows(s, x, &lw.ffn_norm, &mut b.xn);
    blocks::ffn(s, lw, b, Glu::Silu);
    blocks::add(s, x, &b.xn);
}
