//! `llama` (SmolLM2 and the Llama family), and the Qwen 2 and Qwen 3 blocks, which are llama's with an addition
//! each: pre-norm blocks with RMSNorm, grouped-query attention with RoPE, and a SwiGLU feed-forward. `qwen2` adds
//! biases to Q, K and V; `qwen3` (dense) RMS-normalises each Q and K head before RoPE and may have a head size other
//! than `n_embd / n_head`. [`blocks::self_attention`] applies both where a layer has the tensors (as llama.cpp's
//! llama graph adds Q/K/V biases where present); the loader requires them of qwen2/qwen3 and refuses norms on llama.
//! Both Qwens rotate the two halves of each head (NeoX RoPE), llama adjacent pairs: [`super::Hparams::rope_type`].
//! `qwen3moe` is qwen3's block with a mixture of experts for its feed-forward (as llama.cpp's qwen3moe graph is
//! qwen3's with `build_moe_ffn`): [`blocks::ffn`] runs whichever feed-forward the layer has ([`super::moe`]). So is
//! `dots1` (no GQA, leading dense layers, DeepSeek V3-style routing with a shared expert: data of the same layer).
//! `glm4moe` (GLM-4.5) is this block too, as llama.cpp's graph shows: Q/K/V biases and, where a layer has them, Q/K
//! norms; RoPE on the first `n_rot` dimensions of each head only (the rest pass through, as ggml's); its pre-FFN
//! norm, stored as `post_attention_norm`, is loaded as the layer's `ffn_norm`; the feed-forward is dots1's kind.

use super::LayerWeights;
use super::blocks::{self, Buffers, Step};
use crate::backend::RowsKv;
use crate::kernels::Glu;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    blocks::self_attention(s, lw, x, b, kv);
    blocks::add(s, x, &b.xn);

    // Feed-forward: down(silu(gate(x)) * up(x)).
    blocks::norm_rows(s, x, &lw.ffn_norm, &mut b.xn);
    blocks::ffn(s, lw, b, Glu::Silu);
    blocks::add(s, x, &b.xn);
}
