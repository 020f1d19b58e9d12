//! `gemma3`: like llama, plus RMSNorm of each query and key head, a norm after attention and after the
//! feed-forward (four norms per block), GELU-tanh gating, embeddings scaled by √n_embd, and five sliding-window
//! layers (RoPE base 10 000) for each global layer (RoPE base 1 000 000). The window is applied in
//! [`blocks::attend`] from [`super::Hparams::window`], at prefill and decode alike.

use super::LayerWeights;
use super::blocks::{self, Buffers, Step};
use crate::backend::RowsKv;
use crate::kernels::Glu;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    // Attention, with per-head Q/K norms before RoPE and a norm on its output before the residual add.
    blocks::self_attention(s, lw, x, b, kv);
    blocks::norm_rows_inplace(s, &mut b.xn, lw.post_attn_norm.as_deref().unwrap());
    blocks::add(s, x, &b.xn);

    // Feed-forward: down(gelu(gate(x)) * up(x)), normalised before the residual add.
    blocks::norm_rows(s, x, &lw.ffn_norm, &mut b.xn);
    blocks::ffn(s, lw, b, Glu::Gelu);
    blocks::norm_rows_inplace(s, &mut b.xn, lw.post_ffn_norm.as_deref().unwrap());
    blocks::add(s, x, &b.xn);
}
