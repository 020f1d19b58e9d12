//! `llama` (SmolLM2 and the Llama family): pre-norm blocks with RMSNorm, grouped-query attention with RoPE on
//! adjacent pairs, and a SwiGLU feed-forward.

use super::LayerWeights;
use super::blocks::{self, Buffers, RowsKv, Step};
use crate::kernels::ops;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    let n = s.n_tok * s.hp.n_embd;

    // Attention.
    blocks::norm_rows(s, x, &lw.attn_norm, &mut b.xn);
    blocks::qkv(s, lw, b);
    blocks::rope_and_store(s, b, kv);
    blocks::attend(s, b, kv);
    blocks::project(s, &lw.wo, &b.att, &mut b.o, &mut b.mm);
    ops::add_inplace(&mut x[..n], &b.o[..n]);

    // Feed-forward: down(silu(gate(x)) * up(x)).
    blocks::norm_rows(s, x, &lw.ffn_norm, &mut b.xn);
    blocks::project(s, &lw.ffn_gate, &b.xn, &mut b.g, &mut b.mm);
    blocks::project(s, &lw.ffn_up, &b.xn, &mut b.u, &mut b.mm);
    let nf = s.n_tok * s.hp.n_ff;
    blocks::swiglu(s, &mut b.g[..nf], &b.u[..nf]);
    blocks::project(s, &lw.ffn_down, &b.g, &mut b.o, &mut b.mm);
    ops::add_inplace(&mut x[..n], &b.o[..n]);
}
