//! What a model is: hyperparameters, the weights of one contiguous layer range, and the per-architecture math.
//!
//! A [`Model`] holds only the tensors of its layer range, plus the token embedding when the range starts at layer 0
//! and the output norm and head when it ends at the last layer. Weights stay in the memory map: pages of layers outside
//! the range are never touched. Global layer indices are kept everywhere.

pub mod blocks;
pub mod cache;
pub mod deepseek2;
pub mod gemma3;
pub mod hparams;
pub mod llama;
pub mod moe;
pub mod quantize;
pub mod random;
pub mod rope;

pub use cache::ModelCache;
pub use hparams::{Arch, Gating, Hparams, Mla, Moe, RopeScaling, RopeType, Routing, Yarn};

use crate::gguf::GgufFile;
use crate::kernels::Matrix;
use anyhow::{Context, Result, bail};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The weights of one transformer block. Tensors of some architectures only are `None` for the others.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Q's projection (`attn_q`; DeepSeek's `attn_q_b` after its low-rank `attn_q_a`).
    pub wq: Matrix,
    /// K's projection (DeepSeek: `attn_kv_a_mqa`, the compressed KV vector and the shared RoPE key).
    pub wk: Matrix,
    /// V's projection (DeepSeek: `attn_kv_b`, every head's K_nope and V from the compressed vector; in the absorbed
    /// layout `attn_v_b`, every head's V out of the compressed space, which the CPU reads through
    /// [`Absorbed::v_b`]'s per-head views).
    pub wv: Matrix,
    pub wo: Matrix,
    /// Biases added to Q, K and V (Qwen 2; optional in llama, as in llama.cpp).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    pub post_ffn_norm: Option<Vec<f32>>,
    /// DeepSeek's latent attention's own tensors (`deepseek2`).
    pub mla: Option<MlaWeights>,
}

/// What DeepSeek's multi-head latent attention has besides `wq`, `wk` (= `attn_kv_a_mqa`) and `wv` (= `attn_kv_b`).
pub struct MlaWeights {
    /// Q's low-rank first half and its norm (`attn_q_a`, `attn_q_a_norm`), where `q_lora_rank` > 0.
    pub q_a: Option<(Matrix, Vec<f32>)>,
    /// RMSNorm of the compressed KV vector (`attn_kv_a_norm`).
    pub kv_a_norm: Vec<f32>,
    /// The absorbed layout's per-head decompression (`None` in files with `attn_kv_b`).
    pub absorbed: Option<Absorbed>,
}

/// The absorbed MLA layout's `attn_k_b` and `attn_v_b`, one matrix view per head.
pub struct Absorbed {
    /// `[kv_lora_rank, n_nope]` each: takes the head's Q_nope into the compressed space.
    pub k_b: Vec<Matrix>,
    /// `[v_head, kv_lora_rank]` each: takes the head's attention output (compressed) out to its V width.
    pub v_b: Vec<Matrix>,
}

/// A layer's feed-forward: one gated MLP, or a mixture of experts.
pub enum Ffn {
    Dense(DenseFfn),
    Moe(moe::MoeWeights),
}

/// The gated feed-forward `down(act(gate · x) * (up · x))`.
pub struct DenseFfn {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

impl LayerWeights {
    /// The matrices the layer multiplies by that loading may repack or copy out of the map: all of them, the experts
    /// only with `experts` (otherwise they stay mapped, and a token reads only its own experts' pages).
    pub fn matrices_mut(&mut self, experts: bool) -> Vec<&mut Matrix> {
        let mut v = vec![&mut self.wq, &mut self.wk, &mut self.wo];
        match &mut self.mla {
            Some(m) => {
                if let Some((q_a, _)) = &mut m.q_a {
                    v.push(q_a);
                }
                match &mut m.absorbed {
                    // The absorbed layout's `wv` is read through its per-head views only.
                    Some(a) => v.extend(a.k_b.iter_mut().chain(&mut a.v_b)),
                    None => v.push(&mut self.wv),
                }
            }
            None => v.push(&mut self.wv),
        }
        match &mut self.ffn {
            Ffn::Dense(d) => v.extend([&mut d.gate, &mut d.up, &mut d.down]),
            Ffn::Moe(m) => {
                v.push(&mut m.router);
                if let Some(d) = &mut m.shared {
                    v.extend([&mut d.gate, &mut d.up, &mut d.down]);
                }
                if experts {
                    v.extend(m.gate.mats.iter_mut().chain(&mut m.up.mats).chain(&mut m.down.mats));
                }
            }
        }
        v
    }

    /// The dense feed-forward, where the layer has one.
    pub fn dense_ffn(&self) -> Option<&DenseFfn> {
        match &self.ffn {
            Ffn::Dense(d) => Some(d),
            Ffn::Moe(_) => None,
        }
    }
}

pub struct Model {
    pub file: Arc<GgufFile>,
    pub hp: Hparams,
    /// Global indices of the layers this model holds.
    pub range: Range<usize>,
    /// `layers[i]` is global layer `range.start + i`.
    pub layers: Vec<LayerWeights>,
    /// Present when the range starts at layer 0, unless the output head is the same tensor and this range holds
    /// it too: then [`Model::embeddings`] reads the head's (repacked) rows, and the table is in memory once.
    tok_embd: Option<Matrix>,
    /// Present when the range ends at the last layer.
    pub output_norm: Option<Vec<f32>>,
    pub output: Option<Matrix>,
    /// Content hash of the file, computed (or read from the cache) on first use.
    fingerprint: std::sync::OnceLock<String>,
}

/// Fails, naming it, on a tensor the architecture does not use: a tensor Baton does not know changes the math (a
/// bias, RoPE factors, an extra norm), so ignoring it would give wrong output.
fn check_tensor_names(f: &GgufFile, hp: &Hparams) -> Result<()> {
    let global = |n: &str| match n {
        "token_embd.weight" | "output_norm.weight" | "output.weight" => true,
        "rope_freqs.weight" => hp.arch == Arch::Llama,
        _ => false,
    };
    let qkv_bias: &[&str] = &["attn_q.bias", "attn_k.bias", "attn_v.bias"];
    let qk_norm: &[&str] = &["attn_q_norm.weight", "attn_k_norm.weight"];
    let dense: &[&str] = &["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"];
    let experts: &[&str] = &[
        "ffn_gate_inp.weight",
        "ffn_gate_exps.weight",
        "ffn_up_exps.weight",
        "ffn_down_exps.weight",
    ];
    let shared: &[&str] = &[
        "ffn_gate_shexp.weight",
        "ffn_up_shexp.weight",
        "ffn_down_shexp.weight",
        "exp_probs_b.bias",
    ];
    let has_experts = |il: usize| hp.moe.as_ref().is_some_and(|m| m.has_experts(il));
    // GLM-4.5's NextN/MTP layers, stored after the trunk: a MoE layer's tensors plus their own, which llama.cpp
    // loads (or skips) but its decoder graph never reads; nor does Baton.
    let nextn: &[&str] = &[
        "nextn.eh_proj.weight",
        "nextn.embed_tokens.weight",
        "nextn.enorm.weight",
        "nextn.hnorm.weight",
        "nextn.shared_head_head.weight",
        "nextn.shared_head_norm.weight",
    ];
    // DeepSeek's latent attention: Q one matrix or a low-rank pair with a norm between; K and V through the
    // compressed vector.
    let mla: &[&str] = &[
        "attn_q_a.weight",
        "attn_q_a_norm.weight",
        "attn_q_b.weight",
        "attn_kv_a_mqa.weight",
        "attn_kv_a_norm.weight",
    ];
    // ... then each head's K_nope and V through `attn_kv_b`, or (absorbed) `attn_k_b` and `attn_v_b`.
    let kv_b: &[&str] = if hp.mla.as_ref().is_some_and(|m| m.absorbed) {
        &["attn_k_b.weight", "attn_v_b.weight"]
    } else {
        &["attn_kv_b.weight"]
    };
    let layer = |il: usize, t: &str| -> bool {
        // GLM-4.5's norm before the feed-forward is stored as `post_attention_norm`.
        let ffn_norm = if hp.arch == Arch::Glm4Moe {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        let common = [
            "attn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            ffn_norm,
        ];
        let extra: &[&[&str]] = match hp.arch {
            // Phi-3: the fused `attn_qkv` (or Q, K and V apart, as llama.cpp takes either) and the fused gate/up
            // stored as `ffn_up` (no `ffn_gate`).
            Arch::Phi3 => &[&["attn_qkv.weight", "ffn_up.weight", "ffn_down.weight"]],
            Arch::Llama | Arch::Qwen2 => &[qkv_bias, dense],
            Arch::Qwen3 => &[qk_norm, dense],
            Arch::Qwen3Moe => &[qk_norm, experts],
            // Leading dense layers, then experts with a shared expert and the selection bias.
            Arch::Dots1 if has_experts(il) => &[qk_norm, experts, shared],
            Arch::Dots1 => &[qk_norm, dense],
            Arch::Glm4Moe if il >= hp.n_layer => &[qkv_bias, qk_norm, experts, shared, nextn],
            Arch::Glm4Moe if has_experts(il) => &[qkv_bias, qk_norm, experts, shared],
            Arch::Glm4Moe => &[qkv_bias, qk_norm, dense],
            Arch::Gemma3 => &[qk_norm, dense, &["post_attention_norm.weight", "post_ffw_norm.weight"]],
            Arch::Deepseek2 if has_experts(il) => &[mla, kv_b, experts, shared],
            Arch::Deepseek2 => &[mla, kv_b, dense],
        };
        // DeepSeek has none of attn_k/attn_v: its K and V come through the compressed vector.
        if hp.arch == Arch::Deepseek2 && matches!(t, "attn_k.weight" | "attn_v.weight") {
            return false;
        }
        common.contains(&t) || extra.iter().any(|names| names.contains(&t))
    };
    for name in f.tensors.keys() {
        let known = match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((il, t)) => il
                .parse::<usize>()
                .is_ok_and(|il| il < hp.n_layer + hp.n_layer_nextn && layer(il, t)),
            None => global(name),
        };
        if !known {
            bail!(
                "tensor {name:?} is not part of Baton's {} architecture; computing without it would give wrong output",
                hp.arch.name()
            );
        }
    }
    Ok(())
}

/// Tensor `name` of `f`, mapped, checked to be `cols`×`rows` of a type Baton computes with.
fn mapped_matrix(f: &Arc<GgufFile>, name: &str, cols: usize, rows: usize) -> Result<Matrix> {
    let m = Matrix::mapped(f, f.tensor_info(name)?)?;
    if m.cols != cols || m.rows != rows {
        bail!("tensor {name:?} is {}x{}, expected {cols}x{rows}", m.cols, m.rows);
    }
    if !crate::kernels::matrix::supports(m.ty) {
        bail!("tensor {name:?} has type {} which Baton cannot compute with", m.ty);
    }
    Ok(m)
}

/// Layer `il`'s Q, K and V projections as `f` stores them (mapped, not repacked): three tensors, or row views of
/// Phi-3's fused `attn_qkv` (Q's rows, then K's, then V's). The CPU's layers and the GPU's upload both take them
/// from here, so the two split a fused tensor one way.
pub(crate) fn attn_qkv(f: &Arc<GgufFile>, hp: &Hparams, il: usize) -> Result<[Matrix; 3]> {
    let p = |t: &str| format!("blk.{il}.{t}.weight");
    let (e, nq, nk, nv) = (hp.n_embd, hp.n_embd_q(), hp.n_embd_k(), hp.n_embd_v());
    let fused_qkv = f.tensors.contains_key(&p("attn_qkv"));
    if fused_qkv
        && ["attn_q", "attn_k", "attn_v"]
            .iter()
            .any(|t| f.tensors.contains_key(&p(t)))
    {
        bail!("layer {il} has both attn_qkv and separate attn_q/attn_k/attn_v: which one is meant?");
    }
    if fused_qkv {
        let fused = mapped_matrix(f, &p("attn_qkv"), e, nq + nk + nv)?;
        return Ok([
            fused.row_range(0..nq)?,
            fused.row_range(nq..nq + nk)?,
            fused.row_range(nq + nk..nq + nk + nv)?,
        ]);
    }
    Ok([
        mapped_matrix(f, &p("attn_q"), e, nq)?,
        mapped_matrix(f, &p("attn_k"), e, nk)?,
        mapped_matrix(f, &p("attn_v"), e, nv)?,
    ])
}

/// Layer `il`'s latent attention (`deepseek2`, either layout: [`Mla`]) as `f` stores it (mapped, not repacked): its
/// own tensors, and the matrices that stand as `wq` (`attn_q_b` after the low-rank `attn_q_a`, or `attn_q`), `wk`
/// (`attn_kv_a_mqa`) and `wv` (`attn_kv_b`, or the absorbed layout's `attn_v_b` whole). The CPU's layers and the
/// GPU's upload both take them from here.
pub(crate) fn mla_attn(f: &Arc<GgufFile>, hp: &Hparams, il: usize) -> Result<(MlaWeights, [Matrix; 3])> {
    let p = |t: &str| format!("blk.{il}.{t}.weight");
    let m = hp
        .mla
        .as_ref()
        .context("latent attention without its hyperparameters")?;
    let (e, r, nh) = (hp.n_embd, m.kv_lora_rank, hp.n_head);
    let nq = nh * m.q_head(hp.n_rot);
    let has_q_a = m.q_lora_rank > 0;
    for (t, want) in [
        ("attn_q_a", has_q_a),
        ("attn_q_a_norm", has_q_a),
        ("attn_q_b", has_q_a),
        ("attn_q", !has_q_a),
    ] {
        if f.tensors.contains_key(&p(t)) != want {
            let why = if want { "lacks" } else { "has" };
            bail!(
                "deepseek2 layer {il} {why} {t:?} with attention.q_lora_rank {}",
                m.q_lora_rank
            );
        }
    }
    let vector = |name: &str, n: usize| -> Result<Vec<f32>> {
        let v = mapped_matrix(f, name, n, 1)?;
        Ok(v.to_f32())
    };
    let (q_a, wq) = if has_q_a {
        let q_a = (
            mapped_matrix(f, &p("attn_q_a"), e, m.q_lora_rank)?,
            vector(&p("attn_q_a_norm"), m.q_lora_rank)?,
        );
        (Some(q_a), mapped_matrix(f, &p("attn_q_b"), m.q_lora_rank, nq)?)
    } else {
        (None, mapped_matrix(f, &p("attn_q"), e, nq)?)
    };
    let wk = mapped_matrix(f, &p("attn_kv_a_mqa"), e, r + hp.n_rot)?;
    let (wv, absorbed) = if m.absorbed {
        // {n_nope, kv_lora_rank, n_head} and {kv_lora_rank, v_head, n_head}: one view per head.
        let k_b = moe::Experts::mapped(f, f.tensor_info(&p("attn_k_b"))?, m.n_nope, r, nh)?.mats;
        let v_b = moe::Experts::mapped(f, f.tensor_info(&p("attn_v_b"))?, r, m.v_head, nh)?.mats;
        let wv = moe::experts_matrix(f, &p("attn_v_b"), r, m.v_head, nh)?;
        (wv, Some(Absorbed { k_b, v_b }))
    } else {
        (mapped_matrix(f, &p("attn_kv_b"), r, nh * (m.n_nope + m.v_head))?, None)
    };
    let mla = MlaWeights {
        q_a,
        kv_a_norm: vector(&p("attn_kv_a_norm"), r)?,
        absorbed,
    };
    Ok((mla, [wq, wk, wv]))
}

/// Layer `il`'s dense feed-forward as `f` stores it (mapped, not repacked); Phi-3's `ffn_up` holds the gate's rows,
/// then the up projection's (ggml's swiglu of one tensor), split here into row views for the CPU and the GPU alike.
pub(crate) fn dense_ffn(f: &Arc<GgufFile>, hp: &Hparams, il: usize) -> Result<DenseFfn> {
    let p = |t: &str| format!("blk.{il}.{t}.weight");
    let (e, ff) = (hp.n_embd, hp.n_ff);
    if hp.arch == Arch::Phi3 {
        let fused = mapped_matrix(f, &p("ffn_up"), e, 2 * ff)?;
        return Ok(DenseFfn {
            gate: fused.row_range(0..ff)?,
            up: fused.row_range(ff..2 * ff)?,
            down: mapped_matrix(f, &p("ffn_down"), ff, e)?,
        });
    }
    Ok(DenseFfn {
        gate: mapped_matrix(f, &p("ffn_gate"), e, ff)?,
        up: mapped_matrix(f, &p("ffn_up"), e, ff)?,
        down: mapped_matrix(f, &p("ffn_down"), ff, e)?,
    })
}

/// Parses `"A:B"` (B exclusive, `end` allowed) into a layer range checked against `n_layer`.
pub fn parse_layer_range(s: &str, n_layer: usize) -> Result<Range<usize>> {
    let (a, b) = s
        .split_once(':')
        .with_context(|| format!("layer range {s:?} must look like A:B"))?;
    let a: usize = a.trim().parse().with_context(|| format!("bad layer index {a:?}"))?;
    let b: usize = match b.trim() {
        "end" | "" => n_layer,
        v => v.parse().with_context(|| format!("bad layer index {v:?}"))?,
    };
    if a >= b || b > n_layer {
        bail!("layer range {a}:{b} is empty or beyond the model's {n_layer} layers");
    }
    Ok(a..b)
}

impl Model {
    /// Loads the whole model.
    pub fn load(path: &Path) -> Result<Model> {
        Self::load_range(path, None)
    }

    /// Loads the layers `range` (global indices; `None` = all).
    pub fn load_range(path: &Path, range: Option<Range<usize>>) -> Result<Model> {
        let file = Arc::new(GgufFile::open(path)?);
        Self::from_file(file, range)
    }

    /// The model in `file`; a mixture of experts' experts repacked into memory, or left mapped where the process
    /// chose so ([`moe::experts_on_disk`]).
    pub fn from_file(file: Arc<GgufFile>, range: Option<Range<usize>>) -> Result<Model> {
        Self::from_file_placed(file, range, moe::experts_on_disk())
    }

    /// [`Model::from_file`] with the experts' place given: in the mapped file (`experts_on_disk`) or in memory.
    pub fn from_file_placed(file: Arc<GgufFile>, range: Option<Range<usize>>, experts_on_disk: bool) -> Result<Model> {
        let hp = Hparams::from_gguf(&file)?;
        check_tensor_names(&file, &hp)?;
        let range = range.unwrap_or(0..hp.n_layer);
        if range.start >= range.end || range.end > hp.n_layer {
            bail!(
                "layer range {}..{} is outside the model's {} layers",
                range.start,
                range.end,
                hp.n_layer
            );
        }
        let f = &file;
        let matrix = |name: &str, cols: usize, rows: usize| mapped_matrix(f, name, cols, rows);
        let vector = |name: &str, n: usize| -> Result<Vec<f32>> {
            let info = f.tensor_info(name)?;
            let m = Matrix::mapped(f, info)?;
            if m.rows * m.cols != n {
                bail!("tensor {name:?} has {} elements, expected {n}", m.rows * m.cols);
            }
            Ok(m.to_f32())
        };
        let opt_vector = |name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if f.tensors.contains_key(name) {
                vector(name, n).map(Some)
            } else {
                Ok(None)
            }
        };

        let e = hp.n_embd;
        let mut layers = Vec::with_capacity(range.len());
        for il in range.clone() {
            let p = |t: &str| format!("blk.{il}.{t}.weight");
            let moe = hp.moe.as_ref().filter(|m| m.has_experts(il));
            let ffn = match moe {
                None => Ffn::Dense(dense_ffn(f, &hp, il)?),
                Some(m) => {
                    let (n_x, ff) = (m.n_expert, m.n_ff_exp);
                    let experts = |t: &str, cols: usize, rows: usize| {
                        moe::Experts::mapped(f, f.tensor_info(&p(t))?, cols, rows, n_x)
                    };
                    // The shared experts, as one feed-forward `n_shared * n_ff_exp` wide; all three or none.
                    let sw = m.routing.n_shared * ff;
                    let shared = if m.routing.n_shared > 0 {
                        Some(DenseFfn {
                            gate: matrix(&p("ffn_gate_shexp"), e, sw)?,
                            up: matrix(&p("ffn_up_shexp"), e, sw)?,
                            down: matrix(&p("ffn_down_shexp"), sw, e)?,
                        })
                    } else {
                        None
                    };
                    let bias_name = format!("blk.{il}.exp_probs_b.bias");
                    if hp.arch == Arch::Glm4Moe && !f.tensors.contains_key(&bias_name) {
                        bail!("glm4moe layer {il} lacks its selection bias {bias_name:?} (llama.cpp requires it)");
                    }
                    let bias = opt_vector(&bias_name, n_x)?;
                    if let Some(b) = bias.as_ref().and_then(|b| b.iter().find(|v| !v.is_finite())) {
                        bail!("blk.{il}.exp_probs_b.bias holds {b}, not a finite number");
                    }
                    Ffn::Moe(moe::MoeWeights {
                        router: matrix(&p("ffn_gate_inp"), e, n_x)?,
                        gate: experts("ffn_gate_exps", e, ff)?,
                        up: experts("ffn_up_exps", e, ff)?,
                        down: experts("ffn_down_exps", ff, e)?,
                        bias,
                        shared,
                    })
                }
            };
            let (mla, [wq, wk, wv]) = match &hp.mla {
                Some(_) => {
                    let (mla, qkv) = mla_attn(f, &hp, il)?;
                    (Some(mla), qkv)
                }
                None => (None, attn_qkv(f, &hp, il)?),
            };
            let lw = LayerWeights {
                attn_norm: vector(&p("attn_norm"), e)?,
                wq,
                wk,
                wv,
                wo: matrix(&p("attn_output"), hp.n_embd_attn_out(), e)?,
                bq: opt_vector(&format!("blk.{il}.attn_q.bias"), hp.n_embd_q())?,
                bk: opt_vector(&format!("blk.{il}.attn_k.bias"), hp.n_embd_k())?,
                bv: opt_vector(&format!("blk.{il}.attn_v.bias"), hp.n_embd_v())?,
                q_norm: opt_vector(&p("attn_q_norm"), hp.head_dim_k)?,
                k_norm: opt_vector(&p("attn_k_norm"), hp.head_dim_k)?,
                // glm4moe's `post_attention_norm` is the pre-FFN norm (llama.cpp's `attn_post_norm`), not Gemma's
                // norm of the attention output.
                post_attn_norm: if hp.arch == Arch::Glm4Moe {
                    None
                } else {
                    opt_vector(&p("post_attention_norm"), e)?
                },
                ffn_norm: if hp.arch == Arch::Glm4Moe {
                    vector(&p("post_attention_norm"), e)?
                } else {
                    vector(&p("ffn_norm"), e)?
                },
                ffn,
                post_ffn_norm: opt_vector(&p("post_ffw_norm"), e)?,
                mla,
            };
            if hp.arch == Arch::Gemma3
                && (lw.q_norm.is_none()
                    || lw.k_norm.is_none()
                    || lw.post_attn_norm.is_none()
                    || lw.post_ffn_norm.is_none())
            {
                bail!("gemma3 layer {il} lacks one of its q/k/post-attention/post-ffn norms");
            }
            if matches!(hp.arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Dots1)
                && (lw.q_norm.is_none() || lw.k_norm.is_none())
            {
                bail!("{} layer {il} lacks its attn_q_norm/attn_k_norm", hp.arch.name());
            }
            // GLM-4.5 has Q/K norms and GLM-4.5-Air not (llama.cpp applies each where present); Baton normalises
            // both or neither.
            if hp.arch == Arch::Glm4Moe && lw.q_norm.is_some() != lw.k_norm.is_some() {
                bail!("glm4moe layer {il} has one of attn_q_norm/attn_k_norm without the other");
            }
            if hp.arch == Arch::Qwen2 && (lw.bq.is_none() || lw.bk.is_none() || lw.bv.is_none()) {
                bail!("qwen2 layer {il} lacks one of its attn_q/attn_k/attn_v biases");
            }
            layers.push(lw);
        }

        let first = range.start == 0;
        let last = range.end == hp.n_layer;
        let tied = !f.tensors.contains_key("output.weight");
        let tok_embd = if first && !(tied && last) {
            Some(matrix("token_embd.weight", e, hp.n_vocab)?)
        } else {
            None
        };
        let (output_norm, mut output) = if last {
            let head = if tied { "token_embd.weight" } else { "output.weight" };
            (
                Some(vector("output_norm.weight", e)?),
                Some(matrix(head, e, hp.n_vocab)?),
            )
        } else {
            (None, None)
        };
        // Matrices that are only multiplied may be rearranged for the kernels (embedding lookups need rows). Where
        // some are, the others are copied out of the map as well ([`Matrix::copy_out_of_map`] says why).
        let mut multiplied: Vec<&mut Matrix> = layers
            .iter_mut()
            .flat_map(|l| l.matrices_mut(!experts_on_disk))
            .chain(output.as_mut())
            .collect();
        if multiplied.iter().any(|m| m.repacks()) {
            let bar = crate::util::count_bar(multiplied.len() as u64, "repacking weights", "matrices");
            Matrix::own_together(&mut multiplied, || bar.inc(1))?;
            bar.finish_and_clear();
        }
        // Loading read norms into vectors and repacked matrices into owned memory; the file pages that did (and,
        // with transparent huge pages, their 2 MiB neighbourhoods) stay resident unless dropped. Matrices used in
        // place fault their pages back in on first use.
        file.release(0, file.bytes().len());
        Ok(Model {
            file,
            hp,
            range,
            layers,
            tok_embd,
            output_norm,
            output,
            fingerprint: Default::default(),
        })
    }

    /// The model file's fingerprint (see [`crate::fingerprint`]), the same for every layer range of one file.
    pub fn fingerprint(&self) -> Result<&str> {
        if let Some(f) = self.fingerprint.get() {
            return Ok(f);
        }
        let f = crate::fingerprint::fingerprint(&self.file.path)?;
        Ok(self.fingerprint.get_or_init(|| f))
    }

    pub fn is_first(&self) -> bool {
        self.range.start == 0
    }

    /// The token embedding table when this range starts at layer 0: `token_embd`, or the tied output head.
    pub fn embeddings(&self) -> Option<&Matrix> {
        match &self.tok_embd {
            Some(m) => Some(m),
            None if self.range.start == 0 => self.output.as_ref(),
            None => None,
        }
    }

    pub fn is_last(&self) -> bool {
        self.range.end == self.hp.n_layer
    }

    pub fn layer(&self, il: usize) -> &LayerWeights {
        &self.layers[il - self.range.start]
    }

    /// Bytes of weights one decoded token reads through this range (layers + head), for bandwidth figures: of a
    /// mixture of experts, the router and the `expert_used_count` experts a token runs (its active parameters).
    pub fn weight_bytes_per_token(&self) -> usize {
        let k = self.hp.moe.as_ref().map_or(0, |m| m.n_expert_used);
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let ffn = match &l.ffn {
                    Ffn::Dense(d) => d.gate.size_bytes() + d.up.size_bytes() + d.down.size_bytes(),
                    Ffn::Moe(m) => m.active_bytes(k),
                };
                let mla = l.mla.as_ref().map_or(0, |m| {
                    let q_a = m.q_a.as_ref().map_or(0, |(w, _)| w.size_bytes());
                    let k_b = m
                        .absorbed
                        .as_ref()
                        .map_or(0, |a| a.k_b.iter().map(Matrix::size_bytes).sum());
                    q_a + k_b
                });
                l.wq.size_bytes() + l.wk.size_bytes() + l.wv.size_bytes() + l.wo.size_bytes() + mla + ffn
            })
            .sum();
        per_layer + self.output.as_ref().map_or(0, |m| m.size_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgmlType, GgufWriter, Value};

    /// A copy of the generated test model `name` (tests/models/) with metadata `set` (a `None` value removes the
    /// key) and tensors `add` added, loaded; `drop` names tensors left out.
    fn load_edited(
        name: &str,
        set: &[(&str, Option<Value>)],
        add: &[(&str, Vec<f32>)],
        drop: &[&str],
    ) -> Result<Model> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/{name}.gguf"));
        let mut w = GgufWriter::from_file(&GgufFile::open(&src).unwrap()).unwrap();
        w.metadata.retain(|(k, _)| !set.iter().any(|(s, _)| s == k));
        for (k, v) in set {
            if let Some(v) = v {
                w.meta(k, v.clone());
            }
        }
        w.tensors.retain(|(n, ..)| !drop.contains(&n.as_str()));
        for (n, v) in add {
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.tensor(n, vec![v.len() as u64], GgmlType::F32, bytes);
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("edited.gguf");
        w.write(&p).unwrap();
        Model::load(&p)
    }

    fn load_error(name: &str, set: &[(&str, Option<Value>)], add: &[(&str, Vec<f32>)], drop: &[&str]) -> String {
        match load_edited(name, set, add, drop) {
            Ok(_) => panic!("{name} with {set:?}, {add:?} added and {drop:?} dropped loaded"),
            Err(e) => format!("{e:#}"),
        }
    }

    /// Each `(key, value, wanted)`: the generated model `name` with its `name.key` set to `value` (or removed, for
    /// `None`) fails to load with an error that contains `wanted`.
    fn assert_key_refusals(name: &str, cases: &[(&str, Option<Value>, &str)]) {
        // A generated variant is named `<arch>-<what>`: its keys are the architecture's.
        let arch = name.split('-').next().unwrap();
        for (key, v, want) in cases {
            let key = format!("{arch}.{key}");
            let e = load_error(name, &[(key.as_str(), v.clone())], &[], &[]);
            assert!(e.contains(want), "{key} = {v:?}: {e}");
        }
    }

    #[test]
    fn generated_models_load_with_their_architecture() {
        for (name, arch) in [("llama3", Arch::Llama), ("qwen2", Arch::Qwen2), ("qwen3", Arch::Qwen3)] {
            let m = load_edited(name, &[], &[], &[]).unwrap();
            assert_eq!(m.hp.arch, arch);
            assert_eq!(m.hp.rope_freqs.is_some(), arch == Arch::Llama, "{name}");
            assert_eq!(m.layers[0].bq.is_some(), arch == Arch::Qwen2, "{name}");
            assert_eq!(m.layers[0].q_norm.is_some(), arch == Arch::Qwen3, "{name}");
            let neox = if arch == Arch::Llama {
                RopeType::Norm
            } else {
                RopeType::Neox
            };
            assert_eq!(m.hp.rope_type, neox, "{name}");
        }
    }

    /// Phi-3's fused projections load as row views of their tensors (Q, K, V; gate, up), NeoX RoPE; LongRoPE's
    /// factors, a second copy of Q/K/V and a fused tensor on another architecture are refused by name.
    #[test]
    fn phi3_fused_projections_split_and_what_it_lacks_is_refused() {
        let m = load_edited("phi3", &[], &[], &[]).unwrap();
        assert_eq!((m.hp.arch, m.hp.rope_type), (Arch::Phi3, RopeType::Neox));
        let l = &m.layers[0];
        assert_eq!((l.wq.rows, l.wk.rows, l.wv.rows), (64, 32, 32));
        let f = &m.file;
        let fused = f.tensor_data(&f.tensors["blk.0.attn_qkv.weight"]);
        let rb = l.wq.row_bytes();
        assert_eq!(l.wk.row(0), &fused[64 * rb..65 * rb], "K starts after Q's rows");
        let Ffn::Dense(d) = &l.ffn else { panic!("dense") };
        let up = f.tensor_data(&f.tensors["blk.0.ffn_up.weight"]);
        assert_eq!((d.gate.rows, d.up.rows), (128, 128));
        assert_eq!(d.up.row(0), &up[128 * rb..129 * rb], "up follows the gate's rows");
        let e = load_error("phi3", &[], &[("blk.0.rope_factors_long.weight", vec![1.0; 8])], &[]);
        assert!(
            e.contains("rope_factors_long.weight\" is not part of Baton's phi3"),
            "{e}"
        );
        let e = load_error("phi3", &[], &[("blk.1.attn_q.weight", vec![0.0; 64])], &[]);
        assert!(e.contains("both attn_qkv and separate"), "{e}");
        let e = load_error("llama3", &[], &[("blk.0.attn_qkv.weight", vec![0.0; 64])], &[]);
        assert!(e.contains("attn_qkv.weight\" is not part of Baton's llama"), "{e}");
    }

    #[test]
    fn rope_scaling_linear_and_yarn_are_read_and_others_are_refused() {
        let linear = [
            ("llama.rope.scaling.type", Some(Value::Str("linear".into()))),
            ("llama.rope.scaling.factor", Some(Value::F32(4.0))),
        ];
        let m = load_edited("llama3", &linear, &[], &[]).unwrap();
        assert_eq!((m.hp.rope_scaling.freq_scale, m.hp.rope_scaling.yarn), (0.25, None));
        assert!(m.hp.rope_scaling_label().contains("linear, factor 4"));
        // Type none ignores the factor, as llama.cpp.
        let none = [
            ("llama.rope.scaling.type", Some(Value::Str("none".into()))),
            ("llama.rope.scaling.factor", Some(Value::F32(4.0))),
        ];
        assert_eq!(
            load_edited("llama3", &none, &[], &[]).unwrap().hp.rope_scaling,
            RopeScaling::NONE
        );
        // YaRN: the original context from its key (else the training context); ggml's RoPE multiplies the cosines
        // and sines by 1 + 0.1 ln 4, which llama.cpp's attention factor leaves in place; an attention factor scales
        // them further.
        let yarn = [
            ("llama.rope.scaling.type", Some(Value::Str("yarn".into()))),
            ("llama.rope.scaling.factor", Some(Value::F32(4.0))),
            ("llama.rope.scaling.original_context_length", Some(Value::U32(1024))),
            ("llama.rope.scaling.attn_factor", Some(Value::F32(0.5))),
        ];
        let r = load_edited("llama3", &yarn, &[], &[]).unwrap().hp.rope_scaling;
        assert_eq!(
            r.yarn.map(|y| (y.orig_ctx, y.beta_fast, y.beta_slow)),
            Some((1024, 32.0, 1.0))
        );
        assert!(
            (r.mscale() - 0.5 * (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6,
            "{}",
            r.mscale()
        );
        let r = load_edited("llama3", &yarn[..2], &[], &[]).unwrap().hp.rope_scaling;
        assert_eq!(r.yarn.unwrap().orig_ctx, 4096);
        for (k, v, want) in [
            (
                "rope.scaling.type",
                Value::Str("longrope".into()),
                "none, linear and yarn",
            ),
            ("rope.scaling.factor", Value::F32(-2.0), "not a non-negative number"),
            ("rope.scaling.attn_factor", Value::F32(0.0), "not a positive number"),
            (
                "rope.scaling.original_context_length",
                Value::U32(0),
                "expected a context length",
            ),
        ] {
            let k = format!("llama.{k}");
            let e = load_error("llama3", &[yarn[0].clone(), (&k, Some(v))], &[], &[]);
            assert!(e.contains(&k) && e.contains(want), "{e}");
        }
    }

    /// ggml's YaRN ramp for the generated qwen3-yarn (32 rotated dimensions, base 10^6, original context 1024):
    /// pairs 0 and 1 keep their unscaled angle, pairs from 6 on are interpolated, those between mix the two.
    #[test]
    fn yarn_mixes_angles_by_pair() {
        let m = load_edited("qwen3-yarn", &[], &[], &[]).unwrap();
        let (hp, r) = (&m.hp, &m.hp.rope_scaling);
        let y = r.yarn.unwrap();
        assert_eq!(y.corr_dims(hp.n_rot, hp.rope_base), [1.0, 6.0]);
        let tables = rope::RopeTables::new(hp, 0..hp.n_layer, 64);
        let t = &tables.tables()[0];
        let plain = crate::kernels::ops::RopeTable::new(hp.rope_base, hp.n_rot, 64);
        let (c, s) = t.cos_sin(40);
        let (c0, s0) = plain.cos_sin(40);
        let theta = |i: usize| 40.0 * hp.rope_base.powf(-2.0 * i as f32 / hp.n_rot as f32);
        let ms = r.mscale();
        for i in 0..hp.n_rot / 2 {
            let mix = 1.0 - ((i as f32 - 1.0) / 5.0).clamp(0.0, 1.0);
            let angle = theta(i) * (0.25 * (1.0 - mix) + mix);
            assert!(
                (c[i] - ms * angle.cos()).abs() < 1e-4,
                "pair {i}: {} vs {}",
                c[i],
                ms * angle.cos()
            );
            assert!((s[i] - ms * angle.sin()).abs() < 1e-4, "pair {i}");
            if i <= 1 {
                assert!(
                    (c[i] - ms * c0[i]).abs() < 1e-5 && (s[i] - ms * s0[i]).abs() < 1e-5,
                    "pair {i}"
                );
            }
        }
    }

    #[test]
    fn bad_rope_freqs_are_refused() {
        let e = load_error(
            "llama3",
            &[],
            &[("rope_freqs.weight", vec![1.0; 3])],
            &["rope_freqs.weight"],
        );
        assert!(e.contains("rope_freqs.weight has 3 factors"), "{e}");
        let e = load_error(
            "llama3",
            &[],
            &[("rope_freqs.weight", vec![0.0; 8])],
            &["rope_freqs.weight"],
        );
        assert!(e.contains("not a positive frequency factor"), "{e}");
        // llama.cpp's qwen2 has no frequency factors either: a qwen2 file with them is refused, not run without.
        let e = load_error("qwen2", &[], &[("rope_freqs.weight", vec![1.0; 8])], &[]);
        assert!(e.contains("\"rope_freqs.weight\" is not part of Baton's qwen2"), "{e}");
    }

    /// The generated qwen3moe: its experts are per-expert views of the mapped 3-D tensors, and a token reads the
    /// router and two experts of each layer.
    #[test]
    fn generated_qwen3moe_loads_its_experts() {
        let m = load_edited("qwen3moe", &[], &[], &[]).unwrap();
        assert_eq!(m.hp.arch, Arch::Qwen3Moe);
        assert_eq!(m.hp.rope_type, RopeType::Neox);
        let moe = m.hp.moe.clone().unwrap();
        assert_eq!((moe.n_expert, moe.n_expert_used, moe.n_ff_exp), (8, 2, 32));
        assert_eq!(moe.routing.gating, Gating::Softmax);
        assert!(moe.routing.normalise);
        let Ffn::Moe(x) = &m.layers[1].ffn else {
            panic!("qwen3moe layer 1 has a dense feed-forward");
        };
        assert_eq!(x.gate.mats.len(), 8);
        let (g0, g1) = (&x.gate.mats[0], &x.gate.mats[1]);
        assert_eq!((g0.rows, g0.cols, g1.rows, g1.cols), (32, 64, 32, 64));
        let info = m.file.tensor_info("blk.1.ffn_gate_exps.weight").unwrap();
        let whole = m.file.tensor_data(info);
        assert_eq!(g1.bytes(), &whole[g0.size_bytes()..2 * g0.size_bytes()]);
        let down = m
            .file
            .tensor_data(m.file.tensor_info("blk.1.ffn_down_exps.weight").unwrap());
        assert_eq!(x.down.mats[7].bytes(), &down[7 * 64 * 32 * 4..]);
        let attn = 64 * 4 * (128 + 64 + 64 + 128);
        let experts = 2 * 3 * 32 * 64 * 4;
        let router = 8 * 64 * 4;
        let head = 4096 * 64 * 2;
        assert_eq!(m.weight_bytes_per_token(), 2 * (attn + experts + router) + head);
    }

    #[test]
    fn bad_expert_metadata_and_tensors_are_refused() {
        let k = |s: &str| format!("qwen3moe.{s}");
        let cases = [
            ("expert_used_count", Some(Value::U32(9)), "expert_used_count is 9"),
            ("expert_used_count", Some(Value::U32(0)), "expert_used_count is 0"),
            ("expert_count", Some(Value::U32(0)), "expert_count is 0"),
            ("expert_count", None, "expert_count"),
            (
                "expert_feed_forward_length",
                Some(Value::U32(0)),
                "expert_feed_forward_length is 0",
            ),
            ("expert_gating_func", Some(Value::U32(2)), "Sigmoid"),
            ("expert_gating_func", Some(Value::U32(7)), "expert_gating_func"),
            (
                "expert_weights_scale",
                Some(Value::F32(2.5)),
                "expert_weights_scale is 2.5",
            ),
            ("expert_shared_count", Some(Value::U32(1)), "expert_shared_count is 1"),
            (
                "leading_dense_block_count",
                Some(Value::U32(1)),
                "every qwen3moe layer has experts",
            ),
            (
                "expert_weights_norm",
                Some(Value::Bool(false)),
                "expert_weights_norm is false",
            ),
            // Groups are read (llama.cpp applies them to any architecture), and checked.
            (
                "expert_group_count",
                Some(Value::U32(4)),
                "expert_group_used_count is 0",
            ),
            ("expert_group_count", Some(Value::U32(8)), "expert_group_count is 8"),
            // The expert width does not match the tensors'.
            (
                "expert_feed_forward_length",
                Some(Value::U32(16)),
                "ffn_gate_exps.weight\" has dimensions",
            ),
        ];
        assert_key_refusals("qwen3moe", &cases);
        // Scale 1, norm true, one group, no shared expert and softmax spelled out are what qwen3moe computes.
        let fine = [
            (k("expert_weights_scale"), Some(Value::F32(1.0))),
            (k("expert_weights_norm"), Some(Value::Bool(true))),
            (k("expert_shared_count"), Some(Value::U32(0))),
            (k("expert_gating_func"), Some(Value::U32(1))),
        ];
        let fine: Vec<(&str, Option<Value>)> = fine.iter().map(|(a, b)| (a.as_str(), b.clone())).collect();
        load_edited("qwen3moe", &fine, &[], &[]).unwrap();

        let e = load_error("qwen3moe", &[], &[("blk.0.ffn_gate_shexp.weight", vec![0.0; 64])], &[]);
        assert!(
            e.contains("\"blk.0.ffn_gate_shexp.weight\" is not part of Baton's qwen3moe"),
            "{e}"
        );
        let e = load_error("qwen3moe", &[], &[], &["blk.1.ffn_up_exps.weight"]);
        assert!(e.contains("blk.1.ffn_up_exps.weight"), "{e}");
        let down = "blk.0.ffn_down_exps.weight";
        let e = load_error("qwen3moe", &[], &[(down, vec![0.0; 8 * 32 * 64])], &[down]);
        assert!(e.contains("has dimensions [16384]"), "{e}");
        let e = load_error("qwen3moe", &[], &[("blk.0.ffn_gate.weight", vec![0.0; 64])], &[]);
        assert!(
            e.contains("\"blk.0.ffn_gate.weight\" is not part of Baton's qwen3moe"),
            "{e}"
        );
        // A dense architecture with experts is refused, not run without them.
        let e = load_error("qwen3", &[("qwen3.expert_count", Some(Value::U32(8)))], &[], &[]);
        assert!(e.contains("qwen3.expert_count is set") && e.contains("dense"), "{e}");
    }

    /// The generated dots1: a leading dense layer, then experts with the selection bias and two shared experts (one
    /// feed-forward 64 wide); sigmoid routing in 2 of 4 groups, renormalised, scaled by 2.5. A token reads the
    /// router, four experts and the shared ones of each MoE layer.
    #[test]
    fn generated_dots1_loads_its_routing_and_shared_experts() {
        let m = load_edited("dots1", &[], &[], &[]).unwrap();
        assert_eq!((m.hp.arch, m.hp.rope_type), (Arch::Dots1, RopeType::Neox));
        let moe = m.hp.moe.clone().unwrap();
        assert_eq!(
            (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, moe.n_dense_lead),
            (16, 4, 32, 1)
        );
        let want = Routing {
            gating: Gating::Sigmoid,
            normalise: true,
            scale: 2.5,
            n_shared: 2,
            n_group: 4,
            n_group_used: 2,
        };
        assert_eq!(moe.routing, want);
        let Ffn::Dense(d) = &m.layers[0].ffn else {
            panic!("dots1 layer 0 is a leading dense layer")
        };
        assert_eq!(d.gate.rows, 128);
        for il in [1, 2] {
            let Ffn::Moe(x) = &m.layers[il].ffn else {
                panic!("dots1 layer {il} has experts")
            };
            assert_eq!(x.bias.as_ref().map(Vec::len), Some(16));
            let sh = x.shared.as_ref().expect("shared experts");
            assert_eq!((sh.gate.rows, sh.up.rows, sh.down.cols), (64, 64, 64));
        }
        let attn = 64 * 4 * (4 * 64);
        let dense = 3 * 64 * 128 * 4;
        let moe_layer = 16 * 64 * 4 + 4 * 3 * 32 * 64 * 4 + 3 * 64 * 64 * 4;
        let head = 4096 * 64 * 2;
        assert_eq!(m.weight_bytes_per_token(), 3 * attn + dense + 2 * moe_layer + head);
    }

    /// What dots1's routing does not allow, or Baton does not compute, is refused by name.
    #[test]
    fn bad_dots1_routing_is_refused() {
        let k = |s: &str| format!("dots1.{s}");
        let cases = [
            ("expert_gating_func", None, "missing dots1.expert_gating_func"),
            ("expert_gating_func", Some(Value::U32(3)), "expert_gating_func is"),
            ("expert_shared_count", None, "missing dots1.expert_shared_count"),
            ("expert_shared_count", Some(Value::U32(0)), "expert_shared_count is 0"),
            // 16 experts do not split into 3 groups; 4 groups of which 4 are used is no selection.
            ("expert_group_count", Some(Value::U32(3)), "expert_group_count is 3"),
            (
                "expert_group_used_count",
                Some(Value::U32(4)),
                "expert_group_used_count is 4",
            ),
            (
                "expert_weights_scale",
                Some(Value::F32(f32::NAN)),
                "expert_weights_scale is NaN",
            ),
            (
                "leading_dense_block_count",
                Some(Value::U32(4)),
                "more than the 3 layers",
            ),
            ("attention.head_count_kv", Some(Value::U32(2)), "as many KV heads"),
            // The shared experts' width follows the count: 3 × 32 is not the tensors' 64.
            (
                "expert_shared_count",
                Some(Value::U32(3)),
                "ffn_gate_shexp.weight\" is 64x64, expected 64x96",
            ),
        ];
        assert_key_refusals("dots1", &cases);
        // A leading dense block count of 0 makes layer 0 a MoE layer without experts; 2 makes layer 1 dense with
        // experts' tensors: both name the tensor.
        let lead = k("leading_dense_block_count");
        let e = load_error("dots1", &[(lead.as_str(), Some(Value::U32(0)))], &[], &[]);
        assert!(
            e.contains("\"blk.0.ffn_") && e.contains("is not part of Baton's dots1"),
            "{e}"
        );
        let e = load_error("dots1", &[(lead.as_str(), Some(Value::U32(2)))], &[], &[]);
        assert!(
            e.contains("blk.1.") && e.contains("is not part of Baton's dots1"),
            "{e}"
        );
        // Tensors: a missing shared expert, a bias on the dense layer, a shared expert's own router (Qwen 2 MoE's,
        // which dots1 does not have), a bias of the wrong length or not finite.
        let e = load_error("dots1", &[], &[], &["blk.2.ffn_down_shexp.weight"]);
        assert!(e.contains("blk.2.ffn_down_shexp.weight"), "{e}");
        let e = load_error("dots1", &[], &[("blk.0.exp_probs_b.bias", vec![0.0; 16])], &[]);
        assert!(
            e.contains("\"blk.0.exp_probs_b.bias\" is not part of Baton's dots1"),
            "{e}"
        );
        let e = load_error("dots1", &[], &[("blk.1.ffn_gate_inp_shexp.weight", vec![0.0; 64])], &[]);
        assert!(
            e.contains("ffn_gate_inp_shexp.weight\" is not part of Baton's dots1"),
            "{e}"
        );
        let b = "blk.1.exp_probs_b.bias";
        let e = load_error("dots1", &[], &[(b, vec![0.0; 8])], &[b]);
        assert!(e.contains("exp_probs_b.bias\" has 8 elements, expected 16"), "{e}");
        let e = load_error("dots1", &[], &[(b, vec![f32::INFINITY; 16])], &[b]);
        assert!(e.contains("not a finite number"), "{e}");
        // Without the bias (llama.cpp's dots1 does not require it) the model loads and chooses on probabilities.
        let m = load_edited("dots1", &[], &[], &[b]).unwrap();
        let Ffn::Moe(x) = &m.layers[1].ffn else {
            panic!("experts")
        };
        assert!(x.bias.is_none());
    }

    /// The generated glm4moe: 3 trunk layers (one dense) and a NextN/MTP layer that is not loaded; Q/K/V biases
    /// everywhere, Q/K norms on layers 0 and 2; 16 of 32 head dimensions rotated; `post_attention_norm` as the pre-FFN
    /// norm; sigmoid routing (the default without `expert_gating_func`), renormalised, scaled by 2.5, one shared
    /// expert. A token reads the router, four experts and the shared one of each MoE layer.
    #[test]
    fn generated_glm4moe_loads_without_its_nextn_layer() {
        let m = load_edited("glm4moe", &[], &[], &[]).unwrap();
        let hp = &m.hp;
        assert_eq!((hp.arch, hp.rope_type), (Arch::Glm4Moe, RopeType::Neox));
        assert_eq!((hp.n_layer, hp.n_layer_nextn, m.layers.len()), (3, 1, 3));
        assert_eq!((hp.head_dim_k, hp.n_rot), (32, 16));
        let moe = hp.moe.clone().unwrap();
        assert_eq!(
            (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, moe.n_dense_lead),
            (32, 4, 16, 1)
        );
        let want = Routing {
            gating: Gating::Sigmoid,
            normalise: true,
            scale: 2.5,
            n_shared: 1,
            n_group: 0,
            n_group_used: 0,
        };
        assert_eq!(moe.routing, want);
        let norms: Vec<bool> = m.layers.iter().map(|l| l.q_norm.is_some()).collect();
        assert_eq!(norms, [true, false, true]);
        for (il, l) in m.layers.iter().enumerate() {
            assert!(l.bq.is_some() && l.bk.is_some() && l.bv.is_some(), "layer {il} biases");
            assert!(l.post_attn_norm.is_none(), "layer {il}");
            let info = m
                .file
                .tensor_info(&format!("blk.{il}.post_attention_norm.weight"))
                .unwrap();
            assert_eq!(
                Matrix::mapped(&m.file, info).unwrap().to_f32(),
                l.ffn_norm,
                "layer {il}"
            );
            assert_eq!(matches!(l.ffn, Ffn::Moe(_)), il > 0, "layer {il}");
        }
        let Ffn::Moe(x) = &m.layers[2].ffn else {
            panic!("experts")
        };
        assert_eq!(x.bias.as_ref().map(Vec::len), Some(32));
        assert_eq!(x.shared.as_ref().map(|d| d.gate.rows), Some(16));
        let attn = 64 * 4 * (128 + 64 + 64 + 128);
        let dense = 3 * 64 * 128 * 4;
        let moe_layer = 32 * 64 * 4 + 5 * 3 * 16 * 64 * 4;
        let head = 4096 * 64 * 2;
        assert_eq!(m.weight_bytes_per_token(), 3 * attn + dense + 2 * moe_layer + head);
        // Without the key, llama.cpp's glm4moe gates by sigmoid too.
        let m = load_edited("glm4moe", &[("glm4moe.expert_gating_func", None)], &[], &[]).unwrap();
        assert_eq!(m.hp.moe.unwrap().routing.gating, Gating::Sigmoid);
    }

    /// The generated deepseek2: MLA with Q's low-rank pair, 48-wide K heads (32 unrotated, 16 turned in adjacent
    /// pairs) and 24-wide V heads; one dense layer, then V3's routing. A token reads Q's pair, `attn_kv_a_mqa`,
    /// `attn_kv_b`, the output, and the router, four experts and the shared ones of each MoE layer.
    #[test]
    fn generated_deepseek2_loads() {
        let m = load_edited("deepseek2", &[], &[], &[]).unwrap();
        let hp = &m.hp;
        assert_eq!((hp.arch, hp.rope_type), (Arch::Deepseek2, RopeType::Norm));
        assert_eq!((hp.head_dim_k, hp.head_dim_v, hp.n_rot, hp.n_head_kv), (48, 24, 16, 4));
        let want = Mla {
            q_lora_rank: 32,
            kv_lora_rank: 32,
            n_nope: 32,
            v_head: 24,
            absorbed: false,
        };
        assert_eq!(hp.mla.as_ref(), Some(&want));
        assert!((hp.attn_scale - 1.0 / 48f32.sqrt()).abs() < 1e-7);
        let moe = hp.moe.clone().unwrap();
        let routing = Routing {
            gating: Gating::Sigmoid,
            normalise: true,
            scale: 2.5,
            n_shared: 2,
            n_group: 4,
            n_group_used: 2,
        };
        assert_eq!((moe.routing, moe.n_dense_lead), (routing, 1));
        for (il, l) in m.layers.iter().enumerate() {
            let mla = l.mla.as_ref().unwrap();
            assert_eq!(
                mla.q_a.as_ref().map(|(w, n)| (w.rows, w.cols, n.len())),
                Some((32, 64, 32))
            );
            assert_eq!((l.wq.rows, l.wq.cols), (4 * 48, 32), "layer {il} attn_q_b");
            assert_eq!((l.wk.rows, l.wk.cols), (32 + 16, 64), "layer {il} attn_kv_a_mqa");
            assert_eq!((l.wv.rows, l.wv.cols), (4 * (32 + 24), 32), "layer {il} attn_kv_b");
            assert_eq!(mla.kv_a_norm.len(), 32);
            assert_eq!(matches!(l.ffn, Ffn::Moe(_)), il > 0, "layer {il}");
        }
        let attn = 4 * (32 * 64 + 192 * 32 + 48 * 64 + 224 * 32 + 64 * 96);
        let dense = 3 * 64 * 128 * 4;
        let moe_layer = 16 * 64 * 4 + (4 * 3 * 32 * 64 + 3 * 64 * 64) * 4;
        let head = 4096 * 64 * 2;
        assert_eq!(m.weight_bytes_per_token(), 3 * attn + dense + 2 * moe_layer + head);
        // Without the key, llama.cpp's deepseek2 gates by softmax (DeepSeek V2's files lack it).
        let m = load_edited("deepseek2", &[("deepseek2.expert_gating_func", None)], &[], &[]).unwrap();
        assert_eq!(m.hp.moe.unwrap().routing.gating, Gating::Softmax);
    }

    /// The generated deepseek2-mla: the absorbed layout (one KV head of K 56 = 40 + 16 and V 40, heads of 48 and 24
    /// through per-head attn_k_b/attn_v_b) with YaRN: the attention scale is 1/√48 times DeepSeek's mscale squared.
    #[test]
    fn generated_deepseek2_mla_loads() {
        let m = load_edited("deepseek2-mla", &[], &[], &[]).unwrap();
        let hp = &m.hp;
        assert_eq!((hp.head_dim_k, hp.head_dim_v, hp.n_rot, hp.n_head_kv), (56, 40, 16, 1));
        let want = Mla {
            q_lora_rank: 32,
            kv_lora_rank: 40,
            n_nope: 32,
            v_head: 24,
            absorbed: true,
        };
        assert_eq!(hp.mla.as_ref(), Some(&want));
        assert_eq!(hp.n_embd_attn_out(), 4 * 24);
        let mscale = 1.0 + 0.1 * 0.707 * 4f32.ln();
        assert!(
            (hp.attn_scale - mscale * mscale / 48f32.sqrt()).abs() < 1e-6,
            "{}",
            hp.attn_scale
        );
        // DeepSeek's mscale equals its mscale_all_dim: the cosines and sines keep their length.
        assert!((hp.rope_scaling.mscale() - 1.0).abs() < 1e-6);
        for (il, l) in m.layers.iter().enumerate() {
            let a = l.mla.as_ref().unwrap().absorbed.as_ref().unwrap();
            assert_eq!((a.k_b.len(), a.v_b.len()), (4, 4), "layer {il}");
            assert!(
                a.k_b.iter().all(|w| (w.rows, w.cols) == (40, 32)),
                "layer {il} attn_k_b"
            );
            assert!(
                a.v_b.iter().all(|w| (w.rows, w.cols) == (24, 40)),
                "layer {il} attn_v_b"
            );
            assert_eq!((l.wq.rows, l.wq.cols), (4 * 48, 32), "layer {il} attn_q_b");
            assert_eq!((l.wk.rows, l.wk.cols), (40 + 16, 64), "layer {il} attn_kv_a_mqa");
            assert_eq!((l.wv.rows, l.wv.cols), (4 * 24, 40), "layer {il} attn_v_b");
            assert_eq!((l.wo.rows, l.wo.cols), (64, 4 * 24), "layer {il} attn_output");
        }
        // A token reads both decompressions (as F32), and not attn_kv_b's bytes.
        let kv = 4 * (4 * 40 * 32 + 4 * 24 * 40);
        let attn = 4 * (32 * 64 + 192 * 32 + 56 * 64 + 64 * 96) + kv;
        let dense = 3 * 64 * 128 * 4;
        let moe_layer = 16 * 64 * 4 + (4 * 3 * 32 * 64 + 3 * 64 * 64) * 4;
        assert_eq!(
            m.weight_bytes_per_token(),
            3 * attn + dense + 2 * moe_layer + 4096 * 64 * 2
        );
    }

    /// What llama.cpp's deepseek2 graph does not allow, or Baton does not compute, is refused by name.
    #[test]
    fn bad_deepseek2_is_refused() {
        let cases = [
            (
                "attention.key_length_mla",
                Some(Value::U32(48)),
                "the absorbed MLA layout needs both",
            ),
            (
                "attention.temperature_scale",
                Some(Value::F32(0.5)),
                "temperature tuning",
            ),
            (
                "attention.head_count_kv",
                Some(Value::U32(1)),
                "one KV head per query head",
            ),
            ("attention.q_lora_rank", None, "missing deepseek2.attention.q_lora_rank"),
            ("attention.q_lora_rank", Some(Value::U32(0)), "has \"attn_q_a\""),
            (
                "attention.kv_lora_rank",
                None,
                "missing deepseek2.attention.kv_lora_rank",
            ),
            (
                "attention.kv_lora_rank",
                Some(Value::U32(0)),
                "kv_lora_rank is 0: expected 1 to 2^24",
            ),
            ("rope.dimension_count", Some(Value::U32(48)), "leaves no unrotated part"),
            (
                "expert_shared_count",
                Some(Value::U32(0)),
                "deepseek2 has a shared expert",
            ),
        ];
        assert_key_refusals("deepseek2", &cases);
        let e = load_error("deepseek2", &[], &[], &["blk.1.attn_q_b.weight"]);
        assert!(e.contains("deepseek2 layer 1 lacks \"attn_q_b\""), "{e}");
        let e = load_error("deepseek2", &[], &[], &["blk.2.attn_kv_a_norm.weight"]);
        assert!(e.contains("blk.2.attn_kv_a_norm.weight"), "{e}");
        // The absorbed layout's split K/V decompression, and a plain attn_k, are not this layout's.
        for t in ["blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.attn_k.weight"] {
            let e = load_error("deepseek2", &[], &[(t, vec![0.0; 32])], &[]);
            assert!(e.contains(&format!("{t:?} is not part of Baton's deepseek2")), "{e}");
        }
        // The absorbed layout: one KV head of the compressed width (+ the RoPE key), and its own tensors only.
        let cases = [
            (
                "attention.head_count_kv",
                Some(Value::U32(4)),
                "caches one KV head of K 56",
            ),
            (
                "attention.key_length",
                Some(Value::U32(48)),
                "caches one KV head of K 56",
            ),
            ("attention.value_length", Some(Value::U32(24)), "and V 40"),
            ("attention.value_length_mla", Some(Value::U32(0)), "needs both"),
            (
                "attention.key_length_mla",
                Some(Value::U32(16)),
                "leaves no unrotated part",
            ),
        ];
        assert_key_refusals("deepseek2-mla", &cases);
        let e = load_error("deepseek2-mla", &[], &[], &["blk.2.attn_v_b.weight"]);
        assert!(e.contains("blk.2.attn_v_b.weight"), "{e}");
        let e = load_error("deepseek2-mla", &[], &[("blk.0.attn_kv_b.weight", vec![0.0; 32])], &[]);
        assert!(
            e.contains("\"blk.0.attn_kv_b.weight\" is not part of Baton's deepseek2"),
            "{e}"
        );
    }

    /// What glm4moe's graph does not allow, or Baton does not compute, is refused by name.
    #[test]
    fn bad_glm4moe_is_refused() {
        let sections = Value::Array(vec![Value::U32(8), Value::U32(8), Value::U32(0), Value::U32(0)]);
        let cases = [
            ("expert_shared_count", None, "missing glm4moe.expert_shared_count"),
            (
                "expert_shared_count",
                Some(Value::U32(0)),
                "glm4moe has a shared expert",
            ),
            ("expert_gating_func", Some(Value::U32(4)), "expert_gating_func is"),
            ("attention.value_length", Some(Value::U32(16)), "one head size"),
            ("rope.dimension_sections", Some(sections), "M-RoPE"),
            (
                "nextn_predict_layers",
                Some(Value::U32(4)),
                "leaving none of the 4 blocks",
            ),
            // Without the NextN count, block 3 is a trunk layer, whose nextn.* tensors are not Baton's.
            ("nextn_predict_layers", None, "\"blk.3.nextn."),
        ];
        assert_key_refusals("glm4moe", &cases);
        let e = load_error("glm4moe", &[], &[], &["blk.1.exp_probs_b.bias"]);
        assert!(e.contains("lacks its selection bias \"blk.1.exp_probs_b.bias\""), "{e}");
        let e = load_error("glm4moe", &[], &[], &["blk.2.attn_k_norm.weight"]);
        assert!(e.contains("glm4moe layer 2 has one of attn_q_norm/attn_k_norm"), "{e}");
        let e = load_error("glm4moe", &[], &[], &["blk.0.post_attention_norm.weight"]);
        assert!(e.contains("blk.0.post_attention_norm.weight"), "{e}");
        // glm4moe has no ffn_norm (llama.cpp would not read it), and nothing past the NextN layers.
        let e = load_error("glm4moe", &[], &[("blk.1.ffn_norm.weight", vec![1.0; 64])], &[]);
        assert!(
            e.contains("\"blk.1.ffn_norm.weight\" is not part of Baton's glm4moe"),
            "{e}"
        );
        let e = load_error("glm4moe", &[], &[("blk.4.attn_norm.weight", vec![1.0; 64])], &[]);
        assert!(e.contains("\"blk.4.attn_norm.weight\" is not part of"), "{e}");
        // Another architecture's NextN layers would be run as ordinary ones: refused.
        let e = load_error(
            "dots1",
            &[("dots1.nextn_predict_layers", Some(Value::U32(1)))],
            &[],
            &[],
        );
        assert!(
            e.contains("dots1.nextn_predict_layers is 1") && e.contains("no NextN"),
            "{e}"
        );
        // A trunk without Q/K norms at all is GLM-4.5-Air's, and loads.
        let drop = ["blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"];
        let m = load_edited("glm4moe", &[], &[], &drop).unwrap();
        assert!(m.layers[0].q_norm.is_none());
    }

    #[test]
    fn unknown_and_missing_tensors_are_named() {
        let e = load_error("llama3", &[], &[("blk.0.attn_output.bias", vec![0.0; 64])], &[]);
        assert!(e.contains("blk.0.attn_output.bias"), "{e}");
        let e = load_error("qwen3", &[], &[("blk.5.attn_norm.weight", vec![1.0; 64])], &[]);
        assert!(e.contains("blk.5.attn_norm.weight"), "{e}");
        let e = load_error("qwen2", &[], &[], &["blk.1.attn_k.bias"]);
        assert!(e.contains("qwen2 layer 1 lacks"), "{e}");
        let e = load_error("qwen3", &[], &[], &["blk.0.attn_q_norm.weight"]);
        assert!(e.contains("qwen3 layer 0 lacks"), "{e}");
        let e = load_error(
            "qwen3",
            &[("qwen3.attention.layer_norm_rms_epsilon", Some(Value::F32(-1.0)))],
            &[],
            &[],
        );
        assert!(e.contains("layer_norm_rms_epsilon"), "{e}");
    }
}
