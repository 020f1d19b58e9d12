//! `deepseek2` (DeepSeek V2/V3, Kimi K2): llama's pre-norm block with multi-head latent attention (MLA) and, after
//! leading dense layers, a mixture of experts with shared experts ([`blocks::ffn`], dots1's kind of routing).
//!
//! The attention is llama.cpp's deepseek2 graph without the absorption (files with `attn_kv_b`):
//! - Q is `attn_q · x`, or `attn_q_b · norm(attn_q_a · x)` where `q_lora_rank` > 0;
//! - one row of `attn_kv_a_mqa · x` holds the compressed KV vector (`kv_lora_rank`) and then the RoPE key `k_pe`
//!   (`n_rot`), which all heads share;
//! - the compressed vector, RMS-normalised by `attn_kv_a_norm`, gives every head's `K_nope` and `V` through
//!   `attn_kv_b` (each head's rows: `n_nope` of K, then `head_dim_v` of V);
//! - each head's K is `[K_nope | k_pe]`, RoPE (adjacent pairs) turning the last `n_rot` dimensions of each Q and K
//!   head; the attention scale is `1/√head_dim_k` (llama.cpp's kq_scale without YaRN, which is refused at load).
//!
//! The full per-head K and V go into the ordinary KV cache (K and V of different head sizes), not the compressed
//! vector llama.cpp's absorbed form caches: more cache per token, the same attention.

use super::LayerWeights;
use super::blocks::{self, Attn, Buffers, Step};
use crate::backend::RowsKv;
use crate::kernels::Glu;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    blocks::norm_rows(s, x, &lw.attn_norm, &mut b.xn);
    latent_qkv(s, lw, b, kv);
    blocks::attend(s, b, kv);
    blocks::attn_output(s, lw, b);
    blocks::add(s, x, &b.xn);

    blocks::norm_rows(s, x, &lw.ffn_norm, &mut b.xn);
    blocks::ffn(s, lw, b, Glu::Silu);
    blocks::add(s, x, &b.xn);
}

/// Q, K and V of the batch from the normalised input `b.xn` (module doc), rotated, with each row's K and V stored
/// in its cache.
fn latent_qkv(s: &Step, lw: &LayerWeights, b: &mut Buffers, rows: &mut impl RowsKv) {
    let hp = s.hp;
    let m = hp.mla.as_ref().expect("deepseek2 has MLA hparams");
    let mw = lw.mla.as_ref().expect("deepseek2 layers have MLA weights");
    let n = s.n_tok;
    let (r, rot, nope, hdk, hdv, nh) = (
        m.kv_lora_rank,
        hp.n_rot,
        m.n_nope,
        hp.head_dim_k,
        hp.head_dim_v,
        hp.n_head,
    );
    let (ckv_w, kvb_w) = (r + rot, nope + hdv);

    let split = b.work.len() - b.mla_len;
    let (front, tail) = b.work.split_at_mut(split);
    let a = Attn::split(front, b.qkv_len);
    let (qa, tail) = tail.split_at_mut(b.n_rows * m.q_lora_rank);
    let (ckv, tail) = tail.split_at_mut(b.n_rows * ckv_w);
    let (cn, kvb) = tail.split_at_mut(b.n_rows * r);

    // Q, through the low-rank pair where the layer has one.
    match &mw.q_a {
        Some((q_a, q_a_norm)) => {
            blocks::project(s, q_a, &b.xn, qa, &mut b.sc);
            blocks::norm_rows_inplace(s, qa, q_a_norm);
            blocks::project(s, &lw.wq, qa, a.q, &mut b.sc);
        }
        None => blocks::project(s, &lw.wq, &b.xn, a.q, &mut b.sc),
    }

    // The compressed vector (normalised) and the shared RoPE key (rotated once: every head's copy is the same).
    blocks::project(s, &lw.wk, &b.xn, ckv, &mut b.sc);
    for t in 0..n {
        let row = &mut ckv[t * ckv_w..(t + 1) * ckv_w];
        cn[t * r..(t + 1) * r].copy_from_slice(&row[..r]);
        s.be.rope(s.rope, &mut row[r..], rot, rows.pos(t), false);
    }
    blocks::norm_rows_inplace(s, cn, &mw.kv_a_norm);

    // Every head's K_nope and V.
    blocks::project(s, &lw.wv, cn, kvb, &mut b.sc);
    for t in 0..n {
        let pos = rows.pos(t);
        let k_pe = &ckv[t * ckv_w + r..(t + 1) * ckv_w];
        let (k, v) = (
            &mut a.k[t * nh * hdk..(t + 1) * nh * hdk],
            &mut a.v[t * nh * hdv..(t + 1) * nh * hdv],
        );
        for h in 0..nh {
            let src = &kvb[(t * nh + h) * kvb_w..(t * nh + h + 1) * kvb_w];
            let kh = &mut k[h * hdk..(h + 1) * hdk];
            kh[..nope].copy_from_slice(&src[..nope]);
            kh[nope..].copy_from_slice(k_pe);
            v[h * hdv..(h + 1) * hdv].copy_from_slice(&src[nope..]);
            let qh = &mut a.q[(t * nh + h) * hdk..(t * nh + h + 1) * hdk];
            s.be.rope(s.rope, &mut qh[nope..], rot, pos, false);
        }
        blocks::store(hp, pos, k, v, rows.write(t));
    }
}
