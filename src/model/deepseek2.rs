//! `deepseek2` (DeepSeek V2/V3, Kimi K2): llama's pre-norm block with multi-head latent attention (MLA) and, after
//! leading dense layers, a mixture of experts with shared experts ([`blocks::ffn`], dots1's kind of routing).
//!
//! The attention is llama.cpp's deepseek2 graph, in either of its layouts ([`super::Mla`]):
//! - Q is `attn_q · x`, or `attn_q_b · norm(attn_q_a · x)` where `q_lora_rank` > 0: each head `n_nope` values, then
//!   `n_rot` that RoPE (adjacent pairs) turns;
//! - one row of `attn_kv_a_mqa · x` holds the compressed KV vector (`kv_lora_rank`) and then the RoPE key `k_pe`
//!   (`n_rot`), which all heads share; the compressed vector is RMS-normalised by `attn_kv_a_norm`;
//! - without the absorption (`attn_kv_b`), the compressed vector gives every head's `K_nope` and `V` through
//!   `attn_kv_b`, each head's K is `[K_nope | k_pe]`, and the cache holds every head's K and V;
//! - absorbed (`attn_k_b`, `attn_v_b`), the cache holds one KV head, K `[compressed | k_pe]` and V the compressed
//!   vector; each head's query is `[attn_k_b · Q_nope | Q_pe]`, and its attention output (compressed) goes through its
//!   `attn_v_b` before `attn_output`.
//!
//! The attention scale is llama.cpp's kq_scale (`Hparams::attn_scale`, with YaRN's mscale).

use super::blocks::{self, Attn, Buffers, Step};
use super::{Absorbed, LayerWeights, MlaWeights};
use crate::backend::RowsKv;
use crate::kernels::Glu;

/// One block over the batch; `x` is the residual stream `[n_tok, n_embd]`, updated in place; `kv` says where each
/// row keeps its KV.
pub fn layer(s: &Step, lw: &LayerWeights, x: &mut [f32], b: &mut Buffers, kv: &mut impl RowsKv) {
    let mw = lw.mla.as_ref().expect("deepseek2 layers have MLA weights");
    blocks::norm_rows(s, x, &lw.attn_norm, &mut b.xn);
    latent_qkv(s, lw, mw, b, kv);
    blocks::attend(s, b, kv);
    match &mw.absorbed {
        Some(ab) => absorbed_output(s, lw, ab, b),
        None => blocks::attn_output(s, lw, b),
    }
    blocks::add(s, x, &b.xn);

    blocks::norm_rows(s, x, &lw.ffn_norm, &mut b.xn);
    blocks::ffn(s, lw, b, Glu::Silu);
    blocks::add(s, x, &b.xn);
}

/// The latent attention's views of the working buffer: the attention's Q/K/V/output, then its own intermediates
/// (`Buffers::mla_len`), for `n_rows` rows.
struct Latent<'a> {
    a: Attn<'a>,
    /// Q's low-rank intermediate `[n, q_lora_rank]`.
    qa: &'a mut [f32],
    /// `attn_kv_a_mqa`'s rows `[n, kv_lora_rank + n_rot]`.
    ckv: &'a mut [f32],
    /// The normalised compressed vectors `[n, kv_lora_rank]`.
    cn: &'a mut [f32],
    /// `attn_kv_b`'s rows, or (absorbed) Q as `attn_q_b` writes it and one head's gathered input and output.
    last: &'a mut [f32],
}

impl<'a> Latent<'a> {
    /// Splits `b.work` (the fields apart, so `b.xn` and `b.sc` stay free to borrow).
    fn split(s: &Step, work: &'a mut [f32], mla_len: usize, qkv_len: [usize; 3], n_rows: usize) -> Latent<'a> {
        let m = s.hp.mla.as_ref().expect("deepseek2 has MLA hparams");
        let split = work.len() - mla_len;
        let (front, tail) = work.split_at_mut(split);
        let (qa, tail) = tail.split_at_mut(n_rows * m.q_lora_rank);
        let (ckv, tail) = tail.split_at_mut(n_rows * (m.kv_lora_rank + s.hp.n_rot));
        let (cn, last) = tail.split_at_mut(n_rows * m.kv_lora_rank);
        Latent {
            a: Attn::split(front, qkv_len),
            qa,
            ckv,
            cn,
            last,
        }
    }
}

/// Q, K and V of the batch from the normalised input `b.xn` (module doc), rotated, with each row's K and V stored
/// in its cache.
fn latent_qkv(s: &Step, lw: &LayerWeights, mw: &MlaWeights, b: &mut Buffers, rows: &mut impl RowsKv) {
    let hp = s.hp;
    let m = hp.mla.as_ref().expect("deepseek2 has MLA hparams");
    let n = s.n_tok;
    let (r, rot, nope, nh) = (m.kv_lora_rank, hp.n_rot, m.n_nope, hp.n_head);
    let (q_head, ckv_w) = (m.q_head(rot), r + rot);
    let (xn, sc) = (&b.xn, &mut b.sc);
    let Latent { a, qa, ckv, cn, last } = Latent::split(s, &mut b.work, b.mla_len, b.qkv_len, b.n_rows);
    let mut l = Parts { qa, ckv, cn };

    let Some(ab) = &mw.absorbed else {
        // Q straight into the attention's; every head's K_nope and V through `attn_kv_b`; K is [K_nope | k_pe].
        q_and_compressed(s, lw, mw, xn, a.q, &mut l, rows, sc);
        let (hdk, hdv, kvb_w) = (hp.head_dim_k, hp.head_dim_v, nope + hp.head_dim_v);
        blocks::project(s, &lw.wv, l.cn, last, sc);
        for t in 0..n {
            let k_pe = &l.ckv[t * ckv_w + r..(t + 1) * ckv_w];
            let (k, v) = (
                &mut a.k[t * nh * hdk..(t + 1) * nh * hdk],
                &mut a.v[t * nh * hdv..(t + 1) * nh * hdv],
            );
            for h in 0..nh {
                let src = &last[(t * nh + h) * kvb_w..(t * nh + h + 1) * kvb_w];
                let kh = &mut k[h * hdk..(h + 1) * hdk];
                kh[..nope].copy_from_slice(&src[..nope]);
                kh[nope..].copy_from_slice(k_pe);
                v[h * hdv..(h + 1) * hdv].copy_from_slice(&src[nope..]);
            }
            blocks::store(hp, rows.pos(t), k, v, rows.write(t));
        }
        return;
    };

    // Absorbed: Q beside the attention's, which takes each head's [attn_k_b · Q_nope | Q_pe].
    let [q, x_h, y_h] = absorbed_parts(s, last, b.n_rows);
    q_and_compressed(s, lw, mw, xn, q, &mut l, rows, sc);
    // The one KV head: K [compressed | k_pe], V the compressed vector.
    let hdk = hp.head_dim_k;
    for t in 0..n {
        let k = &mut a.k[t * hdk..(t + 1) * hdk];
        k[..r].copy_from_slice(&l.cn[t * r..(t + 1) * r]);
        k[r..].copy_from_slice(&l.ckv[t * ckv_w + r..(t + 1) * ckv_w]);
        let v = &mut a.v[t * r..(t + 1) * r];
        v.copy_from_slice(&l.cn[t * r..(t + 1) * r]);
        blocks::store(hp, rows.pos(t), k, v, rows.write(t));
    }
    // One head's rows of the batch at a time through its attn_k_b.
    for (h, k_b) in ab.k_b.iter().enumerate() {
        for t in 0..n {
            let at = (t * nh + h) * q_head;
            x_h[t * nope..(t + 1) * nope].copy_from_slice(&q[at..at + nope]);
        }
        blocks::project(s, k_b, x_h, y_h, sc);
        for t in 0..n {
            let (at, src) = ((t * nh + h) * hdk, (t * nh + h) * q_head + nope);
            a.q[at..at + r].copy_from_slice(&y_h[t * r..(t + 1) * r]);
            a.q[at + r..at + hdk].copy_from_slice(&q[src..src + rot]);
        }
    }
}

/// The absorbed layout's views of [`Latent::last`] for `n_rows` rows ([`Buffers::absorbed_widths`]): Q as `attn_q_b`
/// writes it (later the heads' outputs through `attn_v_b`), one head's gathered input and its output.
fn absorbed_parts<'a>(s: &Step, last: &'a mut [f32], n_rows: usize) -> [&'a mut [f32]; 3] {
    let [wq, wx, _] = Buffers::absorbed_widths(s.hp);
    let (q, rest) = last.split_at_mut(n_rows * wq);
    let (x_h, y_h) = rest.split_at_mut(n_rows * wx);
    [q, x_h, y_h]
}

/// The low-rank intermediates [`q_and_compressed`] writes.
struct Parts<'a> {
    qa: &'a mut [f32],
    ckv: &'a mut [f32],
    cn: &'a mut [f32],
}

/// Q as `attn_q_b` (or `attn_q`) writes it, into `q` (`[n, n_head, n_nope + n_rot]`), every head's Q_pe rotated;
/// `attn_kv_a_mqa`'s rows into `l.ckv`, their RoPE key rotated (once: every head's copy is the same); the
/// normalised compressed vectors into `l.cn`.
#[allow(clippy::too_many_arguments)]
fn q_and_compressed(
    s: &Step,
    lw: &LayerWeights,
    mw: &MlaWeights,
    xn: &[f32],
    q: &mut [f32],
    l: &mut Parts,
    rows: &impl RowsKv,
    sc: &mut crate::backend::Scratch,
) {
    let hp = s.hp;
    let m = hp.mla.as_ref().expect("deepseek2 has MLA hparams");
    let (r, rot, nh) = (m.kv_lora_rank, hp.n_rot, hp.n_head);
    let (q_head, ckv_w) = (m.q_head(rot), r + rot);
    match &mw.q_a {
        Some((q_a, q_a_norm)) => {
            blocks::project(s, q_a, xn, l.qa, sc);
            blocks::norm_rows_inplace(s, l.qa, q_a_norm);
            blocks::project(s, &lw.wq, l.qa, q, sc);
        }
        None => blocks::project(s, &lw.wq, xn, q, sc),
    }
    blocks::project(s, &lw.wk, xn, l.ckv, sc);
    for t in 0..s.n_tok {
        let pos = rows.pos(t);
        let row = &mut l.ckv[t * ckv_w..(t + 1) * ckv_w];
        l.cn[t * r..(t + 1) * r].copy_from_slice(&row[..r]);
        s.be.rope(s.rope, &mut row[r..], rot, pos, false);
        for h in 0..nh {
            let at = (t * nh + h) * q_head + m.n_nope;
            s.be.rope(s.rope, &mut q[at..at + rot], rot, pos, false);
        }
    }
    blocks::norm_rows_inplace(s, l.cn, &mw.kv_a_norm);
}

/// The absorbed layout's attention output: each head's (compressed) output through its `attn_v_b`, then
/// `attn_output`, written to `b.xn`.
fn absorbed_output(s: &Step, lw: &LayerWeights, ab: &Absorbed, b: &mut Buffers) {
    let hp = s.hp;
    let m = hp.mla.as_ref().expect("deepseek2 has MLA hparams");
    let (n, r, nh, vh) = (s.n_tok, m.kv_lora_rank, hp.n_head, m.v_head);
    let Latent { a, last, .. } = Latent::split(s, &mut b.work, b.mla_len, b.qkv_len, b.n_rows);
    let [o, x_h, y_h] = absorbed_parts(s, last, b.n_rows);
    for (h, v_b) in ab.v_b.iter().enumerate() {
        for t in 0..n {
            let at = (t * nh + h) * r;
            x_h[t * r..(t + 1) * r].copy_from_slice(&a.att[at..at + r]);
        }
        blocks::project(s, v_b, x_h, y_h, &mut b.sc);
        for t in 0..n {
            let at = (t * nh + h) * vh;
            o[at..at + vh].copy_from_slice(&y_h[t * vh..(t + 1) * vh]);
        }
    }
    blocks::project(s, &lw.wo, o, &mut b.xn, &mut b.sc);
}
