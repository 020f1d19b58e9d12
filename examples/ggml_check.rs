//! Op-by-op check of the `ggml` numerics against llama.cpp's own intermediate tensors.
//!
//! `tools/llama-ref/target/release/llama-ref dump -m MODEL --tokens ids.txt -o DIR` writes them; then
//! `cargo run --release --example ggml_check -- MODEL DIR [LAYERS]` feeds each op llama.cpp's input and counts the
//! outputs that are not bit-identical to llama.cpp's.
use baton::kernels::ThreadPool;
use baton::kernels::ggml;
use baton::kernels::ops::RopeTable;
use baton::model::{Model, RopeType};
use std::collections::HashMap;
use std::path::Path;

/// ggml's op number of GGML_OP_FLASH_ATTN_EXT in this ggml version (the dump's index records op numbers).
const FLASH_ATTN_EXT: u32 = 74;

#[allow(clippy::needless_range_loop)]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = Model::load(Path::new(&args[1])).unwrap();
    if model.hp.moe.is_some() {
        eprintln!("ggml_check compares dense feed-forwards only; this model has experts");
        std::process::exit(2);
    }
    let dir = Path::new(&args[2]);
    let n_layers: usize = args.get(3).map_or(2, |s| s.parse().unwrap());
    let mut shapes = HashMap::new();
    for l in std::fs::read_to_string(dir.join("index.txt")).unwrap().lines() {
        let f: Vec<&str> = l.rsplitn(6, ' ').collect();
        shapes.insert(
            f[5].to_string(),
            [f[4], f[3], f[2], f[1]].map(|v| v.parse::<usize>().unwrap()),
        );
    }
    let load = |name: &str| -> Vec<f32> {
        std::fs::read(dir.join(format!("{name}.f32")))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let cmp = |what: &str, got: &[f32], want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{what}");
        let bad = got.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let maxd = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        let mag = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        println!(
            "{what:>24}: {bad:>8} of {:>8} differ, max |diff| {maxd:.3e} (max |x| {mag:.3e})",
            got.len()
        );
    };
    let fa_names: Vec<String> = std::fs::read_to_string(dir.join("index.txt"))
        .unwrap()
        .lines()
        .filter(|l| l.ends_with(&format!(" {}", FLASH_ATTN_EXT)))
        .map(|l| l.rsplitn(6, ' ').last().unwrap().to_string())
        .collect();
    let hp = &model.hp;
    let pool = ThreadPool::new(2);
    let n_tok = shapes["attn_norm-0"][1];
    let e = hp.n_embd;
    let mm = |w: &baton::kernels::Matrix, x: &[f32]| -> Vec<f32> {
        let mut y = vec![0.0; n_tok * w.rows];
        if ggml::matmul::supports(w.ty) {
            ggml::matmul::matmul(&pool, w, x, n_tok, &mut y);
        } else {
            println!("  ({} matmul not reproduced: Baton's kernel)", w.ty);
            baton::kernels::matmul(&pool, w, x, n_tok, &mut y, &mut Default::default());
        }
        y
    };
    let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
    for il in 0..n_layers {
        let lw = model.layer(il);
        let dense = lw.dense_ffn().expect("checked above: no experts");
        let gemma = hp.arch == baton::model::Arch::Gemma3;
        let inp = if il == 0 && gemma {
            load("inp_scaled")
        } else if il == 0 {
            load("embd")
        } else {
            load(&format!("l_out-{}", il - 1))
        };
        let mut xn = vec![0.0; inp.len()];
        for t in 0..n_tok {
            ggml::ops::rms_norm(
                &inp[t * e..(t + 1) * e],
                &lw.attn_norm,
                hp.rms_eps,
                &mut xn[t * e..(t + 1) * e],
            );
        }
        cmp(&format!("attn_norm-{il}"), &xn, &load(&format!("attn_norm-{il}")));
        let xn = load(&format!("attn_norm-{il}"));
        for (w, name) in [(&lw.wq, "Qcur"), (&lw.wk, "Kcur"), (&lw.wv, "Vcur")] {
            cmp(&format!("{name}-{il}"), &mm(w, &xn), &load(&format!("{name}-{il}")));
        }
        let norm_heads = |x: &mut [f32], w: &[f32]| {
            for hd in x.chunks_mut(w.len()) {
                ggml::ops::rms_norm_inplace(hd, w, hp.rms_eps);
            }
        };
        if gemma {
            let mut q = load(&format!("Qcur-{il}#1"));
            norm_heads(&mut q, lw.q_norm.as_deref().unwrap());
            cmp(&format!("Qcur_normed-{il}"), &q, &load(&format!("Qcur_normed-{il}")));
            let mut k = load(&format!("Kcur-{il}#1"));
            norm_heads(&mut k, lw.k_norm.as_deref().unwrap());
            cmp(&format!("Kcur_normed-{il}"), &k, &load(&format!("Kcur_normed-{il}")));
        }
        // RoPE on llama.cpp's Q and K (the last dump of each name before attention is the rotated one).
        let rope = RopeTable::new(hp.rope_base_of(il), hp.n_rot, 1024);
        let neox = hp.rope_type == RopeType::Neox;
        for (name, nh) in [("Qcur", hp.n_head), ("Kcur", hp.n_head_kv)] {
            let (src, dst) = if gemma {
                (format!("{name}_normed-{il}"), format!("{name}-{il}#2"))
            } else {
                (format!("{name}-{il}#1"), format!("{name}-{il}#2"))
            };
            let mut x = load(&src);
            for t in 0..n_tok {
                let (c, s) = rope.cos_sin(t);
                for h in 0..nh {
                    ggml::ops::rope(&mut x[(t * nh + h) * hdk..(t * nh + h + 1) * hdk], c, s, neox);
                }
            }
            cmp(&format!("rope {name}-{il}"), &x, &load(&dst));
        }
        // Flash attention on llama.cpp's rotated Q and K and its V, K/V rounded to f16 as its cache holds them.
        // (Gemma's Q is then scaled by 1/16 before attention, here by the attention scale: a power of two, exact.)
        let q = load(&format!("Qcur-{il}#2"));
        let k = load(&format!("Kcur-{il}#2"));
        let v = load(&format!("Vcur-{il}#1"));
        let (nh, nkv) = (hp.n_head, hp.n_head_kv);
        let mut kc = vec![half::f16::ZERO; nkv * n_tok * hdk];
        let mut vc = vec![half::f16::ZERO; nkv * n_tok * hdv];
        for t in 0..n_tok {
            for h in 0..nkv {
                for d in 0..hdk {
                    kc[(h * n_tok + t) * hdk + d] = half::f16::from_f32(k[(t * nkv + h) * hdk + d]);
                }
                for d in 0..hdv {
                    vc[(h * n_tok + t) * hdv + d] = half::f16::from_f32(v[(t * nkv + h) * hdv + d]);
                }
            }
        }
        let mut att = vec![0.0; n_tok * nh * hdv];
        let mut sc = ggml::attention::Scratch::new(hdk);
        let window = hp.window(il);
        for t in 0..n_tok {
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                ggml::attention::attend_row(
                    &q[(t * nh + h) * hdk..],
                    &kc[kvh * n_tok * hdk..(kvh + 1) * n_tok * hdk],
                    &vc[kvh * n_tok * hdv..(kvh + 1) * n_tok * hdv],
                    hdk,
                    hdv,
                    window.map_or(0, |w| (t + 1).saturating_sub(w)),
                    t + 1,
                    hp.attn_scale,
                    &mut sc,
                    &mut att[(t * nh + h) * hdv..(t * nh + h + 1) * hdv],
                );
            }
        }
        cmp(&format!("flash_attn-{il}"), &att, &load(&fa_names[il]));
        let kqv = load(&format!("kqv_out-{il}"));
        let ffn_in = if gemma {
            let mut o = mm(&lw.wo, &kqv);
            for row in o.chunks_mut(e) {
                ggml::ops::rms_norm_inplace(row, lw.post_attn_norm.as_deref().unwrap(), hp.rms_eps);
            }
            cmp(
                &format!("attn_post_norm-{il}"),
                &o,
                &load(&format!("attn_post_norm-{il}")),
            );
            load(&format!("sa_out-{il}"))
        } else {
            cmp(
                &format!("attn_out-{il}"),
                &mm(&lw.wo, &kqv),
                &load(&format!("attn_out-{il}")),
            );
            load(&format!("ffn_inp-{il}"))
        };
        let mut xn = vec![0.0; ffn_in.len()];
        for t in 0..n_tok {
            ggml::ops::rms_norm(
                &ffn_in[t * e..(t + 1) * e],
                &lw.ffn_norm,
                hp.rms_eps,
                &mut xn[t * e..(t + 1) * e],
            );
        }
        cmp(&format!("ffn_norm-{il}"), &xn, &load(&format!("ffn_norm-{il}")));
        let xn = load(&format!("ffn_norm-{il}"));
        let g = mm(&dense.gate, &xn);
        cmp(&format!("ffn_gate-{il}"), &g, &load(&format!("ffn_gate-{il}")));
        let u = mm(&dense.up, &xn);
        cmp(&format!("ffn_up-{il}"), &u, &load(&format!("ffn_up-{il}")));
        let mut g = load(&format!("ffn_gate-{il}"));
        let u = load(&format!("ffn_up-{il}"));
        if hp.arch == baton::model::Arch::Gemma3 {
            ggml::ops::geglu(&mut g, &u);
            cmp(&format!("ffn_geglu-{il}"), &g, &load(&format!("ffn_geglu-{il}")));
        } else {
            ggml::ops::swiglu(&mut g, &u);
            cmp(&format!("ffn_swiglu-{il}"), &g, &load(&format!("ffn_swiglu-{il}")));
        }
        let act = if hp.arch == baton::model::Arch::Gemma3 {
            "ffn_geglu"
        } else {
            "ffn_swiglu"
        };
        cmp(
            &format!("ffn_out-{il}"),
            &mm(&dense.down, &load(&format!("{act}-{il}"))),
            &load(&format!("ffn_out-{il}")),
        );
    }
}
