//! A model's layers on the GPU: the weights of a layer range uploaded once and shared by every session of the
//! model ([`GpuWeights`]), and each session's f16 KV cache and working buffers on the device ([`GpuLayers`]).
//! `engine::Session` runs the first layers of its range here and the rest, if any, on the CPU (`--gpu-layers`).
//! The layer scripts are those of `model/llama.rs` (llama, qwen2, qwen3, phi3, and the mixtures of experts qwen3moe,
//! dots1 and glm4moe, whose feed-forward is `model/moe.rs`'s: `GpuLayers::moe_ffn`), `model/gemma3.rs` and
//! `model/deepseek2.rs` (its latent attention's projections: `GpuLayers::latent_qkv`; the rest is llama's).
//!
//! The host embeds the tokens (a row per token, uploaded), holds the residual stream where the range continues on
//! the CPU, and keeps a copy of every KV row the device writes, brought back in the same submission: snapshots,
//! a disaggregated prefill's KV stream and imports see one cache whichever backend ran the layers.

use super::attention::Queries;
use super::buffers::{GpuExperts, GpuMatrix, Halves, Tensor, U32s};
use super::matmul::Norm;
use super::moe::PickGroups;
use super::rope::{GpuRope, QkvExtras, Ready, fresh_halves};
use super::{Binds, Gpu, u32_of};
use crate::backend::{self, AttnShape, KvLayers};
use crate::kernels::Glu;
use crate::kernels::Matrix;
use crate::kernels::matrix::{Bytes, Layout};
use crate::model::rope::RopeTables;
use crate::model::{Arch, Hparams, Model, RopeType};
use anyhow::{Context, Result, ensure};
use half::f16;
use std::ops::Range;
use std::sync::Arc;

/// One block's weights on the device.
struct Layer {
    attn_norm: Tensor,
    qkv: Projections,
    wo: GpuMatrix,
    /// Biases added to Q, K and V (Qwen 2) and the RMSNorm of every Q and K head before RoPE (Gemma 3, Qwen 3).
    qkv_extras: QkvExtras,
    /// Gemma 3's norms of the attention's and the feed-forward's outputs.
    post_norms: Option<[Tensor; 2]>,
    ffn_norm: Tensor,
    ffn: Ffn,
}

/// How a block projects its input to a row of Q, K and V side by side (`AttnShape::qkv_width`).
enum Projections {
    /// The Q, K and V matrices, stacked where they are of one type: each matrix and where its outputs start in the
    /// row. One matmul reads all three where it can, two or three where the types differ (Q4_K_M keeps some V
    /// projections in Q6_K): a decode step pays per dispatch.
    Stacked(Vec<(GpuMatrix, usize)>),
    /// DeepSeek's latent attention.
    Latent(Box<Latent>),
}

/// DeepSeek's latent attention's matrices (`model::deepseek2`; `LayerWeights`' `wq`, `wk` and `wv` and its
/// `MlaWeights`).
struct Latent {
    /// The matrices that read the block's normalised input: Q's low-rank `attn_q_a` where the layer has one, and
    /// `attn_kv_a_mqa`, stacked as the Q, K and V are: a row of `LatentBuffers::lowrank` holds Q's low-rank
    /// values, then the compressed KV vector, then the RoPE key.
    lowrank: Vec<(GpuMatrix, usize)>,
    /// `attn_q_a_norm`, where Q has its low-rank pair.
    q_a_norm: Option<Tensor>,
    /// Q's projection: `attn_q_b` of the normalised low-rank values, or `attn_q` of the input.
    q: GpuMatrix,
    kv_a_norm: Tensor,
    /// Every head's K_nope and V from the normalised compressed vector.
    kv_b: GpuMatrix,
}

/// A block's feed-forward on the device, as the CPU's layer has it (`model::Ffn`).
enum Ffn {
    /// `down(act(gate · x) * (up · x))`.
    Dense {
        gate: GpuMatrix,
        up: GpuMatrix,
        down: GpuMatrix,
    },
    Moe(Box<Moe>),
}

/// A mixture of experts' tensors (`model::moe::MoeWeights`): the router, the 3-D expert tensors (picked from on the
/// device), the selection bias and the shared experts where the layer has them.
struct Moe {
    router: GpuMatrix,
    gate: GpuExperts,
    up: GpuExperts,
    down: GpuExperts,
    bias: Option<Tensor>,
    /// The shared experts' gate, up and down: one SwiGLU feed-forward every row runs.
    shared: Option<[GpuMatrix; 3]>,
}

/// The final norm and output head, on the device when its layers end the model.
struct Head {
    norm: Tensor,
    /// The embedding matrix itself where the model ties them.
    out: Arc<GpuMatrix>,
}

/// The weights of a model's layers `layers` on one GPU, uploaded once per process and shared by its sessions.
pub struct GpuWeights {
    gpu: Arc<Gpu>,
    hp: Hparams,
    layers: Range<usize>,
    w: Vec<Layer>,
    /// The token embeddings, on the device when its layers start the model: a batch's rows are looked up there.
    embd: Option<Arc<GpuMatrix>>,
    head: Option<Head>,
    bytes: u64,
}

impl GpuWeights {
    /// Why the GPU backend cannot run this model, where it cannot: refused before anything is uploaded, rather than
    /// run wrongly. `--backend auto` then runs the model on the CPU.
    pub fn unsupported(hp: &Hparams) -> Option<&'static str> {
        // DeepSeek's absorbed layout needs a per-head matmul and attention heads of kv_lora_rank + n_rot (576 for
        // V2/V3), wider than the attention shaders take.
        hp.mla.as_ref().filter(|m| m.absorbed).map(|_| {
            "this deepseek2 file is in llama.cpp's absorbed MLA layout (attn_k_b/attn_v_b, a one-head compressed KV \
             cache), which the GPU backend does not run yet"
        })
    }

    /// Uploads layers `layers` of `model` (within its range), and the output head when they end the model. The
    /// matrices are read from the file as stored (the CPU's copies may have been repacked for its kernels). A GPU
    /// that runs out of memory gives an error naming the sizes and a `--gpu-layers` that would fit.
    pub fn upload(gpu: Arc<Gpu>, model: &Model, layers: Range<usize>) -> Result<GpuWeights> {
        let hp = model.hp.clone();
        // The GPU layers run the blocks of every architecture the CPU's do, with the tensors the CPU's layer has
        // (checked at load); RoPE scaling is in the tables ([`RopeTables`]). The mixtures of experts are llama's
        // block with experts for the feed-forward; deepseek2 is too, with its latent attention's projections. An
        // architecture added to `Arch` stops the build here until its block is written for the GPU.
        match hp.arch {
            Arch::Llama
            | Arch::Gemma3
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Phi3
            | Arch::Qwen3Moe
            | Arch::Dots1
            | Arch::Glm4Moe
            | Arch::Deepseek2 => {}
        }
        if let Some(why) = Self::unsupported(&hp) {
            anyhow::bail!("{why}; use --backend cpu (or auto, which runs it on the CPU)");
        }
        ensure!(
            !layers.is_empty() && layers.start >= model.range.start && layers.end <= model.range.end,
            "GPU layers {layers:?} are not within the model's layers {:?}",
            model.range
        );
        let f = &model.file;
        let mapped = |name: &str| -> Result<Matrix> { Matrix::mapped(f, f.tensor_info(name)?) };
        let per_layer = layer_bytes(model, layers.start);
        let bytes = std::cell::Cell::new(0u64);
        let up = |m: &Matrix| -> Result<GpuMatrix> {
            bytes.set(bytes.get() + m.bytes().len() as u64);
            gpu.upload_matrix(m)
        };
        let experts = |m: Matrix, n_expert: usize| -> Result<GpuExperts> {
            bytes.set(bytes.get() + m.bytes().len() as u64);
            gpu.upload_experts(&m, n_expert)
        };
        let mut w = Vec::with_capacity(layers.len());
        let bar = crate::util::count_bar(layers.len() as u64, "uploading to the GPU", "layers");
        // The embedding and head tensors: the head is the embedding matrix where there is no `output.weight`.
        let (embd_name, out_name) = match (
            f.tensors.contains_key("token_embd.weight"),
            f.tensors.contains_key("output.weight"),
        ) {
            (true, true) => ("token_embd.weight", "output.weight"),
            (true, false) => ("token_embd.weight", "token_embd.weight"),
            _ => ("output.weight", "output.weight"),
        };
        let mut embd = None;
        let result = (|| -> Result<Option<Head>> {
            if layers.start == 0 {
                embd = Some(Arc::new(up(&mapped(embd_name)?)?));
            }
            for il in layers.clone() {
                bar.inc(1);
                let p = |t: &str| format!("blk.{il}.{t}.weight");
                let vector = |name: &str| -> Result<Tensor> { gpu.upload(&mapped(name)?.to_f32()) };
                // The optional vectors as the CPU's layer holds them, so both backends run the same block.
                let lw = &model.layers[il - model.range.start];
                let host = |v: &Option<Vec<f32>>| v.as_deref().map(|v| gpu.upload(v)).transpose();
                let pair = |a: &Option<Vec<f32>>, b: &Option<Vec<f32>>| -> Result<Option<[Tensor; 2]>> {
                    Ok(match (host(a)?, host(b)?) {
                        (Some(a), Some(b)) => Some([a, b]),
                        (None, None) => None,
                        _ => anyhow::bail!("layer {il} has one of a pair of norms"),
                    })
                };
                let qk_norm = match (&lw.q_norm, &lw.k_norm) {
                    (Some(q), Some(k)) => Some([&q[..], &k[..]]),
                    (None, None) => None,
                    _ => anyhow::bail!("layer {il} has one of a pair of norms"),
                };
                // The projections as the file stores them, split as the CPU's loader splits Phi-3's fused ones.
                let qkv = match &hp.mla {
                    None => Projections::Stacked(stack(&crate::model::attn_qkv(f, &hp, il)?, up)?),
                    Some(_) => {
                        let (mla, [q, kv_a, kv_b]) = crate::model::mla_attn(f, &hp, il)?;
                        let (lowrank, q_a_norm) = match &mla.q_a {
                            Some((q_a, norm)) => (stack(&[q_a, &kv_a], up)?, Some(gpu.upload(norm)?)),
                            None => (stack(&[&kv_a], up)?, None),
                        };
                        Projections::Latent(Box::new(Latent {
                            lowrank,
                            q_a_norm,
                            q: up(&q)?,
                            kv_a_norm: gpu.upload(&mla.kv_a_norm)?,
                            kv_b: up(&kv_b)?,
                        }))
                    }
                };
                let ffn = match &lw.ffn {
                    crate::model::Ffn::Dense(_) => {
                        let d = crate::model::dense_ffn(f, &hp, il)?;
                        Ffn::Dense {
                            gate: up(&d.gate)?,
                            up: up(&d.up)?,
                            down: up(&d.down)?,
                        }
                    }
                    crate::model::Ffn::Moe(m) => {
                        let moe = hp
                            .moe
                            .as_ref()
                            .context("a layer of experts without MoE hyperparameters")?;
                        let (e, ff, n_x) = (hp.n_embd, moe.n_ff_exp, moe.n_expert);
                        let exps = |t: &str, cols, rows| {
                            experts(crate::model::moe::experts_matrix(f, &p(t), cols, rows, n_x)?, n_x)
                        };
                        let shared = match &m.shared {
                            None => None,
                            Some(_) => Some([
                                up(&mapped(&p("ffn_gate_shexp"))?)?,
                                up(&mapped(&p("ffn_up_shexp"))?)?,
                                up(&mapped(&p("ffn_down_shexp"))?)?,
                            ]),
                        };
                        Ffn::Moe(Box::new(Moe {
                            router: up(&mapped(&p("ffn_gate_inp"))?)?,
                            gate: exps("ffn_gate_exps", e, ff)?,
                            up: exps("ffn_up_exps", e, ff)?,
                            down: exps("ffn_down_exps", ff, e)?,
                            bias: host(&m.bias)?,
                            shared,
                        }))
                    }
                };
                w.push(Layer {
                    attn_norm: vector(&p("attn_norm"))?,
                    qkv,
                    wo: up(&mapped(&p("attn_output"))?)?,
                    qkv_extras: gpu.upload_qkv_extras([&lw.bq, &lw.bk, &lw.bv].map(|b| b.as_deref()), qk_norm)?,
                    post_norms: pair(&lw.post_attn_norm, &lw.post_ffn_norm)?,
                    // glm4moe stores it as `post_attention_norm`; the CPU's loader knows which.
                    ffn_norm: gpu.upload(&lw.ffn_norm)?,
                    ffn,
                });
            }
            if layers.end < hp.n_layer || !model.is_last() {
                return Ok(None);
            }
            let out = match &embd {
                Some(m) if out_name == embd_name => m.clone(),
                _ => Arc::new(up(&mapped(out_name)?)?),
            };
            Ok(Some(Head {
                norm: gpu.upload(&mapped("output_norm.weight")?.to_f32())?,
                out,
            }))
        })();
        bar.finish_and_clear();
        let head = result.map_err(|e| {
            let fit = w.len().saturating_sub(1);
            anyhow::anyhow!(
                "putting layers {layers:?} of {} on GPU {} (about {} MiB of weights, {} MiB a layer): {e:#}. If the \
                 model does not fit the GPU's memory, put fewer layers there: --gpu-layers {fit} or less ({} of \
                 them were uploaded), the rest run on the CPU",
                model.file.path.display(),
                gpu.info().name,
                (per_layer * layers.len() as u64) >> 20,
                per_layer >> 20,
                w.len()
            )
        })?;
        Ok(GpuWeights {
            hp,
            layers,
            w,
            embd,
            head,
            bytes: bytes.get(),
            gpu,
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Global indices of the layers on the device.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Whether the final norm and output head are on the device too.
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// Whether the token embeddings are on the device too (the layers start the model).
    pub fn embeds(&self) -> bool {
        self.embd.is_some()
    }

    /// Bytes of the weight matrices uploaded.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Matrices over one input (a block's Q, K and V) stacked into as few as they can be (runs of one type and row
/// length, uploaded by `up` as one matrix), each with where its outputs start in a row of their outputs side by side.
fn stack<M: std::borrow::Borrow<Matrix>>(
    ms: &[M],
    up: impl Fn(&Matrix) -> Result<GpuMatrix>,
) -> Result<Vec<(GpuMatrix, usize)>> {
    let ms: Vec<&Matrix> = ms.iter().map(|m| m.borrow()).collect();
    let stacks_with =
        |a: &Matrix, b: &Matrix| (a.ty, a.cols, a.layout, b.layout) == (b.ty, b.cols, Layout::Rows, Layout::Rows);
    let (mut out, mut at, mut i) = (Vec::new(), 0, 0);
    while i < ms.len() {
        let mut j = i + 1;
        while j < ms.len() && stacks_with(ms[i], ms[j]) {
            j += 1;
        }
        let run = &ms[i..j];
        let rows: usize = run.iter().map(|m| m.rows).sum();
        let m = if let [one] = run {
            up(one)?
        } else {
            up(&Matrix {
                ty: run[0].ty,
                rows,
                cols: run[0].cols,
                data: Bytes::Owned(run.iter().flat_map(|m| m.bytes().iter().copied()).collect()),
                layout: Layout::Rows,
            })?
        };
        out.push((m, at));
        at += rows;
        i = j;
    }
    Ok(out)
}

/// Bytes of layer `il`'s tensors in the file (every expert of a mixture's).
fn layer_bytes(model: &Model, il: usize) -> u64 {
    let prefix = format!("blk.{il}.");
    let f = &model.file;
    f.tensors
        .values()
        .filter(|t| t.name.starts_with(&prefix))
        .map(|t| t.size as u64)
        .sum()
}

/// One layer's KV cache on the device.
struct LayerKv {
    k: Halves,
    v: Halves,
}

/// One session's part on the device: the KV cache of the GPU's layers for `n_ctx` positions and working buffers
/// for batches of up to `n_batch` rows.
pub struct GpuLayers {
    w: Arc<GpuWeights>,
    kv: Vec<LayerKv>,
    /// One table per RoPE base, and which one each layer uses.
    ropes: Vec<GpuRope>,
    rope_of: Vec<usize>,
    n_ctx: usize,
    n_batch: usize,
    x: Tensor,
    xn: Tensor,
    /// The rotated query heads, `[n, n_head, hdk]`.
    q: Tensor,
    /// Each row's Q, K and V projections side by side, `[n, AttnShape::qkv_width]`.
    qkv: Tensor,
    att: Tensor,
    h: Tensor,
    /// A mixture of experts' buffers, where the model has one.
    moe: Option<MoeBuffers>,
    /// Latent attention's buffers, where the model has it.
    latent: Option<LatentBuffers>,
    /// Logits of up to `head_rows` rows at a time (when the head is here).
    logits: Tensor,
    head_rows: usize,
    /// The batch's positions, rewritten at each forward.
    pos: U32s,
    /// The batch's token ids, where the device embeds them.
    tok: U32s,
    /// The KV rows a forward wrote, gathered for the host's copy: per layer, `n_batch` rows' worth.
    fresh: Halves,
    /// The ops' bind groups over these buffers and the weights, built at their first dispatch and reused; `None`
    /// only in a test that compares with building each dispatch's own.
    binds: Option<Binds>,
    /// Dispatches recorded in the last forward's submission (a test keeps a decode step's count from growing).
    dispatches: usize,
}

/// The working buffers of a layer of experts over a batch of `n` rows with `k` experts each.
struct MoeBuffers {
    /// Router logits, then probabilities, `[n, n_expert]`.
    logits: Tensor,
    /// Each row's experts and weights in its top-k order, `[n, k]`.
    ids: U32s,
    wts: Tensor,
    /// The picks grouped by expert for a batch's tiled matmuls.
    groups: PickGroups,
    /// The picks' hidden activations `[n·k, n_ff_exp]` and outputs `[n·k, n_embd]`.
    hx: Tensor,
    yx: Tensor,
    /// The shared experts' output, `[n, n_embd]`.
    shared: Tensor,
}

/// The working buffers of DeepSeek's latent attention over a batch of `n` rows.
struct LatentBuffers {
    /// `Latent::lowrank`'s products, `[n, q_lora_rank + kv_lora_rank + n_rot]`.
    lowrank: Tensor,
    /// Q's low-rank values normalised, `[n, q_lora_rank]`, and the compressed KV vector, `[n, kv_lora_rank]`.
    q_a: Tensor,
    ckv: Tensor,
    /// Every head's K_nope and V, `[n, n_head, n_nope + head_dim_v]`.
    kv_b: Tensor,
}

/// What [`GpuLayers::forward`] hands back.
pub enum Out<'a> {
    /// The residual stream leaving the device's last layer, into the batch's rows of `x`.
    Hidden,
    /// The logits of rows `rows` of the batch (the device holds the head), into `logits`
    /// (`[rows.len(), n_vocab]`).
    Logits { rows: Range<usize>, logits: &'a mut [f32] },
}

impl GpuLayers {
    /// A session's KV cache and buffers for the layers of `w`.
    pub fn new(w: Arc<GpuWeights>, n_ctx: usize, n_batch: usize) -> Result<GpuLayers> {
        ensure!(n_ctx > 0 && n_batch > 0, "a GPU session needs a context and a batch");
        let (gpu, hp) = (&w.gpu, &w.hp);
        let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
        let kv_bytes = backend::LayerKv::bytes_for(w.layers.len(), hp.n_head_kv, n_ctx, hdk, hdv);
        let tables = RopeTables::new(hp, w.layers.clone(), n_ctx);
        let alloc = || -> Result<GpuLayers> {
            let kv = w
                .layers
                .clone()
                .map(|_| {
                    Ok(LayerKv {
                        k: gpu.zero_halves(hp.n_head_kv * n_ctx * hdk)?,
                        v: gpu.zero_halves(hp.n_head_kv * n_ctx * hdv)?,
                    })
                })
                .collect::<Result<_>>()?;
            let ropes = tables
                .tables()
                .iter()
                .map(|t| gpu.upload_rope(t))
                .collect::<Result<_>>()?;
            // Rows of logits per head dispatch: up to 64, in at most 64 MiB.
            let head_rows = if w.head.is_some() {
                ((64usize << 20) / (4 * hp.n_vocab)).clamp(1, 64).min(n_batch)
            } else {
                0
            };
            let n = n_batch;
            // A batch's attention, for the sizes of the buffers it fills (any layer's: the window is no size).
            let batch = hp.attn_shape(0, n);
            let moe = match &hp.moe {
                None => None,
                Some(m) => {
                    let slots = n * m.n_expert_used;
                    Some(MoeBuffers {
                        logits: gpu.zeros(n * m.n_expert)?,
                        ids: gpu.upload_u32(&vec![0; slots])?,
                        wts: gpu.zeros(slots)?,
                        groups: PickGroups::new(gpu, slots, m.n_expert)?,
                        hx: gpu.zeros(slots * m.n_ff_exp)?,
                        yx: gpu.zeros(slots * hp.n_embd)?,
                        shared: gpu.zeros(if m.routing.n_shared > 0 { n * hp.n_embd } else { 1 })?,
                    })
                }
            };
            let latent = match &hp.mla {
                None => None,
                Some(m) => Some(LatentBuffers {
                    lowrank: gpu.zeros(n * (m.q_lora_rank + m.kv_lora_rank + hp.n_rot))?,
                    q_a: gpu.zeros(n * m.q_lora_rank.max(1))?,
                    ckv: gpu.zeros(n * m.kv_lora_rank)?,
                    kv_b: gpu.zeros(n * hp.n_head * (m.n_nope + hdv))?,
                }),
            };
            // The dense feed-forward's hidden activations, or the shared experts'.
            let n_ff = hp
                .n_ff
                .max(hp.moe.as_ref().map_or(0, |m| m.routing.n_shared * m.n_ff_exp));
            Ok(GpuLayers {
                kv,
                ropes,
                rope_of: w.layers.clone().map(|il| tables.index_of(il)).collect(),
                n_ctx,
                n_batch,
                x: gpu.zeros(n * hp.n_embd)?,
                xn: gpu.zeros(n * hp.n_embd)?,
                q: gpu.zeros(n * hp.n_head * hdk)?,
                qkv: gpu.zeros(n * batch.qkv_width())?,
                att: gpu.zeros(n * hp.n_head * hdv)?,
                h: gpu.zeros(n * n_ff)?,
                moe,
                latent,
                logits: gpu.zeros(head_rows.max(1) * hp.n_vocab)?,
                head_rows,
                pos: gpu.upload_u32(&vec![0; n])?,
                tok: gpu.upload_u32(&vec![0; n])?,
                fresh: gpu.zero_halves(w.layers.len().max(1) * fresh_halves(&batch))?,
                binds: Some(Binds::default()),
                dispatches: 0,
                w: w.clone(),
            })
        };
        alloc().with_context(|| {
            format!(
                "allocating a GPU session on {} ({} MiB of KV cache for {} layers of {n_ctx} positions, and batches of {n_batch} rows): use a \
                 smaller -c or -b, or fewer --gpu-layers",
                gpu.info().name,
                kv_bytes >> 20,
                w.layers.len()
            )
        })
    }

    /// Global indices of the layers on the device.
    pub fn layers(&self) -> Range<usize> {
        self.w.layers()
    }

    pub fn has_head(&self) -> bool {
        self.w.has_head()
    }

    pub fn embeds(&self) -> bool {
        self.w.embeds()
    }

    pub fn weights(&self) -> &Arc<GpuWeights> {
        &self.w
    }

    /// Dispatches in the last [`GpuLayers::forward`]'s submission (its later head chunks not counted).
    pub fn dispatches(&self) -> usize {
        self.dispatches
    }

    /// Runs layers `first..` of the device's range over the `n` rows of `x` (`[n, n_embd]`, the residual stream
    /// entering `first`) at positions `pos0..pos0 + n`, or over the embeddings of `tokens` (ids the caller checked
    /// against the vocabulary), looked up on the device, where they are given (the range starts the model). The KV
    /// rows they write are copied into `mirror` too; the output is the residual stream (back into `x`) or the
    /// logits of some rows ([`Out`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        x: &mut [f32],
        tokens: Option<&[u32]>,
        n: usize,
        pos0: usize,
        first: usize,
        mirror: &mut impl KvLayers,
        out: Out,
    ) -> Result<()> {
        let w = self.w.clone();
        let (gpu, hp) = (&w.gpu, &w.hp);
        let e = hp.n_embd;
        ensure!(
            n > 0 && n <= self.n_batch && x.len() >= n * e,
            "a GPU batch of {n} rows (at most {})",
            self.n_batch
        );
        ensure!(
            pos0 + n <= self.n_ctx,
            "context full: {pos0} + {n} positions exceed {}",
            self.n_ctx
        );
        ensure!(
            first >= w.layers.start && first <= w.layers.end,
            "layer {first} is outside the GPU's layers {:?}",
            w.layers
        );
        let embd = match tokens {
            Some(toks) => {
                ensure!(
                    toks.len() == n && first == w.layers.start,
                    "{} tokens for a GPU batch of {n} rows from layer {first}",
                    toks.len()
                );
                let embd = w
                    .embd
                    .as_ref()
                    .with_context(|| format!("GPU layers {:?} take the hidden state, not tokens", w.layers))?;
                gpu.write_u32(&mut self.tok, toks)?;
                Some(embd)
            }
            None => {
                gpu.write(&self.x, &x[..n * e])?;
                None
            }
        };
        let positions: Vec<u32> = (pos0..pos0 + n).map(|p| u32_of(p, "position")).collect::<Result<_>>()?;
        gpu.write_u32(&mut self.pos, &positions)?;
        let pos = &self.pos;
        let neox = hp.rope_type == RopeType::Neox;
        let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
        let glu = match hp.arch {
            Arch::Gemma3 => Glu::Gelu,
            _ => Glu::Silu,
        };

        // Where the head's first rows start at row 0 (a decode step, all rows' logits), the last layer's add is
        // fused with the head's norm too.
        let head_fused =
            first < w.layers.end && w.head.is_some() && matches!(&out, Out::Logits { rows, .. } if rows.start == 0);
        let mut pass = self.pass();
        let flush_every = flush_layers(gpu);
        if let Some(embd) = embd {
            pass.embed(embd, &self.tok, hp.embd_scale, &self.x)?;
        }
        // The first layer's attention norm; every later one is fused with the residual add that ends the layer
        // before it (`add_rms_norm`), as is the feed-forward's norm with the add after attention. A decode step
        // folds those adds into the mat-vecs before them and the norms into the mat-vecs after (`Pass::folds`):
        // the add's mat-vec writes the new residual times the next norm's weights into `xn` (`weighed`), and the
        // next mat-vec scales its products by the row's 1 / rms. Gemma's post-norms (of a block's whole output,
        // before the add) and a mixture's feed-forward (whose input the router reads too) keep the fused adds.
        let decode = pass.folds(n);
        let folded = Norm {
            res: &self.x,
            eps: hp.rms_eps,
        };
        let mut weighed = false;
        if first < w.layers.end {
            let attn_norm = &w.w[first - w.layers.start].attn_norm;
            pass.rms_norm(&self.x, attn_norm, hp.rms_eps, n, &self.xn)?;
        }
        // A decode step's last add leaves the head's norm to a dispatch of its own: folded, the head's mat-vec
        // would take the row's sum of squares in each of its (vocabulary-many) workgroups to save one.
        let mut head_norm = None;
        for il in first..w.layers.end {
            let i = il - w.layers.start;
            let (l, kv) = (&w.w[i], &self.kv[i]);
            let rope = &self.ropes[self.rope_of[i]];
            let shape = hp.attn_shape(il, n);
            let fold = std::mem::take(&mut weighed).then_some(folded);
            match &l.qkv {
                Projections::Stacked(ms) => {
                    let ms = ms.iter().map(|(m, at)| (m, *at));
                    self.project(&mut pass, ms, fold, n, &self.qkv, shape.qkv_width())?
                }
                Projections::Latent(m) => self.latent_qkv(&mut pass, m, fold, &shape)?,
            }
            // The rows' Q, K and V made ready (biases, head norms, RoPE), K and V stored into the cache, and the
            // attention: a decode step does all of it in the attention dispatch (`Queries::Fresh`).
            let ready = Ready {
                qkv: &self.qkv,
                extras: &l.qkv_extras,
                eps: hp.rms_eps,
                table: rope,
                neox,
                rot_at: hp.mla.as_ref().map_or(0, |m| m.n_nope),
                fresh: (&self.fresh, (il - first) * fresh_halves(&shape)),
            };
            let kv_cache = [&kv.k, &kv.v];
            if pass.attends_fresh(n) {
                pass.attend(&shape, Queries::Fresh(&ready), kv_cache, self.n_ctx, pos, &self.att)?;
            } else {
                pass.rope_store(&ready, &shape, &self.q, kv_cache, self.n_ctx, pos)?;
                pass.attend(&shape, Queries::Rotated(&self.q), kv_cache, self.n_ctx, pos, &self.att)?;
            }
            let [post_attn, post_ffn] = match &l.post_norms {
                Some([a, f]) => [Some(a), Some(f)],
                None => [None, None],
            };
            let dense = matches!(l.ffn, Ffn::Dense { .. });
            if decode && post_attn.is_none() && dense {
                pass.matvec_add(&l.wo, &self.att, &self.x, Some((&l.ffn_norm, &self.xn)))?;
                weighed = true;
            } else {
                pass.matmul(&l.wo, &self.att, n, &self.xn)?;
                pass.add_rms_norm(&self.x, &self.xn, post_attn, &l.ffn_norm, hp.rms_eps, n)?;
            }
            let next_norm = match (w.w.get(i + 1), &w.head) {
                (Some(next), _) => Some(&next.attn_norm),
                (None, Some(head)) if head_fused => Some(&head.norm),
                _ => None,
            };
            // The feed-forward into `xn`, or added into `x` by the down projection's mat-vec.
            let added = match &l.ffn {
                Ffn::Dense { gate, up, down } => {
                    match std::mem::take(&mut weighed) {
                        true => pass.matvec_glu_normed(gate, up, glu, &self.xn, folded, &self.h)?,
                        false => pass.matmul_glu(gate, up, glu, &self.xn, n, &self.h)?,
                    }
                    if decode && post_ffn.is_none() {
                        let next_attn = w.w.get(i + 1).map(|next| (&next.attn_norm, &self.xn));
                        pass.matvec_add(down, &self.h, &self.x, next_attn)?;
                        weighed = next_attn.is_some();
                        head_norm = next_norm.filter(|_| !weighed);
                        true
                    } else {
                        pass.matmul(down, &self.h, n, &self.xn)?;
                        false
                    }
                }
                Ffn::Moe(m) => {
                    self.moe_ffn(&mut pass, m, n)?;
                    false
                }
            };
            match next_norm {
                _ if added => {}
                Some(norm) => pass.add_rms_norm(&self.x, &self.xn, post_ffn, norm, hp.rms_eps, n)?,
                None => {
                    if let Some(post) = post_ffn {
                        pass.rms_norm_inplace(&self.xn, post, hp.rms_eps, n)?;
                    }
                    pass.add(&self.x, &self.xn, n * e)?;
                }
            }
            if flush_every > 0 && (il + 1 - first).is_multiple_of(flush_every) && il + 1 < w.layers.end {
                pass.flush()?;
            }
        }
        // The KV rows written, for the host's copy: `rope_store` wrote them into one run as well (per layer and
        // head, the rows of K then of V), read back in one copy.
        if first < w.layers.end {
            let per_layer = fresh_halves(&hp.attn_shape(first, n));
            pass.read_halves(&self.fresh, 0, per_layer * (w.layers.end - first))?;
        }
        let (rows, logits) = match out {
            Out::Hidden => {
                pass.read(&self.x, 0, n * e)?;
                (0..0, None)
            }
            Out::Logits { rows, logits } => {
                ensure!(
                    w.head.is_some() && rows.end <= n && !rows.is_empty(),
                    "logits of rows {rows:?} of a batch of {n} from GPU layers {:?}",
                    w.layers
                );
                ensure!(logits.len() >= rows.len() * hp.n_vocab, "logits buffer too small");
                (rows, Some(logits))
            }
        };
        if let Some(norm) = head_norm {
            pass.rms_norm(&self.x, norm, hp.rms_eps, n, &self.xn)?;
        }
        // The first rows of the head go in this submission, the rest (all-rows logits) in their own.
        let mut chunks = rows.clone().step_by(self.head_rows.max(1));
        if let Some(r0) = chunks.next() {
            self.head(&mut pass, r0..(r0 + self.head_rows).min(rows.end), head_fused)?;
        }
        let dispatches = pass.dispatches();
        tracing::trace!(
            "GPU forward of {n} rows, layers {first}..{}: {dispatches} dispatches",
            w.layers.end
        );
        let got = pass.finish_read()?;
        self.dispatches = dispatches;
        // The KV run, then the residual stream or the first rows' logits.
        let (tail, kv_run) = got.split_last().expect("a pass that reads");
        let mut kv_bytes = kv_run.first().map_or(&[][..], |b| &b[..]);
        let mut take = |halves: usize| {
            let (a, b) = kv_bytes.split_at(2 * halves);
            kv_bytes = b;
            a
        };
        for il in first..w.layers.end {
            let m = mirror.kv_layer_mut(il);
            ensure!(
                pos0 + n <= m.n_ctx,
                "KV positions {pos0}..{} past a host cache of {}",
                pos0 + n,
                m.n_ctx
            );
            for h in 0..hp.n_head_kv {
                let at = h * m.n_ctx + pos0;
                halves_into(take(n * hdk), &mut m.k[at * hdk..(at + n) * hdk]);
                halves_into(take(n * hdv), &mut m.v[at * hdv..(at + n) * hdv]);
            }
        }
        let Some(logits) = logits else {
            f32s_into(tail, &mut x[..n * e]);
            return Ok(());
        };
        let nv = hp.n_vocab;
        let first_rows = self.head_rows.min(rows.len());
        f32s_into(tail, &mut logits[..first_rows * nv]);
        for r0 in chunks {
            let r1 = (r0 + self.head_rows).min(rows.end);
            let mut pass = self.pass();
            self.head(&mut pass, r0..r1, false)?;
            let got = pass.finish_read()?;
            let at = (r0 - rows.start) * nv;
            f32s_into(&got[0], &mut logits[at..at + (r1 - r0) * nv]);
        }
        Ok(())
    }

    /// Matmuls of the stacked matrices `ms` over the block's input in `xn` into columns of `out` (rows of `width`):
    /// its `n` normalised rows, or with `fold` a decode step's row weighed by the norm, each mat-vec scaling its
    /// products by the row's 1 / rms (`Pass::folds`).
    fn project<'w>(
        &self,
        pass: &mut super::Pass,
        ms: impl IntoIterator<Item = (&'w GpuMatrix, usize)>,
        fold: Option<Norm>,
        n: usize,
        out: &Tensor,
        width: usize,
    ) -> Result<()> {
        match fold {
            None => pass.matmuls_at(ms, &self.xn, n, out, width),
            Some(norm) => pass.matvecs_normed_at(ms, &self.xn, norm, out, width),
        }
    }

    /// DeepSeek's latent attention's projections of the block's input (`fold` as [`GpuLayers::project`] takes it) into
    /// the rows of `qkv`, as `model::deepseek2::latent_qkv` computes them before its RoPE and stores: Q through
    /// its low-rank pair (or one matrix), the compressed KV vector normalised, every head's K_nope and V through
    /// `attn_kv_b`, and the RoPE key in every K head; RoPE then turns the last `n_rot` dimensions of each Q and K
    /// head where the other architectures' are turned (`Ready::rot_at`).
    fn latent_qkv(&self, pass: &mut super::Pass, m: &Latent, fold: Option<Norm>, a: &AttnShape) -> Result<()> {
        let hp = &self.w.hp;
        let mla = hp
            .mla
            .as_ref()
            .context("latent attention without its hyperparameters")?;
        let b = self
            .latent
            .as_ref()
            .context("a session without its latent attention's buffers")?;
        let (n, r, ql) = (a.n_tok, mla.kv_lora_rank, mla.q_lora_rank);
        let width = ql + r + hp.n_rot;
        let lowrank = m.lowrank.iter().map(|(m, at)| (m, *at));
        self.project(pass, lowrank, fold, n, &b.lowrank, width)?;
        match &m.q_a_norm {
            Some(norm) => {
                pass.rms_norm_cols(&b.lowrank, (width, 0), norm, hp.rms_eps, n, &b.q_a)?;
                pass.matmuls_at([(&m.q, 0)], &b.q_a, n, &self.qkv, a.qkv_width())?;
            }
            None => self.project(pass, [(&m.q, 0)], fold, n, &self.qkv, a.qkv_width())?,
        }
        pass.rms_norm_cols(&b.lowrank, (width, ql), &m.kv_a_norm, hp.rms_eps, n, &b.ckv)?;
        pass.matmul(&m.kv_b, &b.ckv, n, &b.kv_b)?;
        pass.latent_kv((&b.lowrank, width, ql + r), &b.kv_b, a, hp.n_rot, &self.qkv)
    }

    /// A mixture of experts' feed-forward of the `n` normalised rows of `xn`, written back to `xn`, as
    /// `model::moe::ffn` computes it: the shared experts; the router's logits; each row's top k experts and their
    /// weights, chosen on the device; the picked experts' SwiGLU feed-forwards, each pick reading its expert's rows
    /// (so a decode step reads k experts, not all; a batch's picks are grouped by expert on the device first, so a
    /// prefill reads each picked expert once per 64 picks of it); their outputs summed in each row's top-k order,
    /// plus the shared experts'.
    fn moe_ffn(&self, pass: &mut super::Pass, m: &Moe, n: usize) -> Result<()> {
        let hp = &self.w.hp;
        let moe = hp
            .moe
            .as_ref()
            .context("a layer of experts without MoE hyperparameters")?;
        let b = self
            .moe
            .as_ref()
            .context("a session without the buffers of its experts")?;
        let (e, k, n_x) = (hp.n_embd, moe.n_expert_used, moe.n_expert);
        if let Some([gate, up, down]) = &m.shared {
            pass.matmul_glu(gate, up, Glu::Silu, &self.xn, n, &self.h)?;
            pass.matmul(down, &self.h, n, &b.shared)?;
        }
        pass.matmul(&m.router, &self.xn, n, &b.logits)?;
        pass.route(&b.logits, m.bias.as_ref(), &moe.routing, n, n_x, k, &b.ids, &b.wts)?;
        let picks = pass.picks(&b.ids, n, k, n_x, &b.groups)?;
        pass.matmul_glu_ids(&m.gate, &m.up, Glu::Silu, &self.xn, k, &picks, &b.hx)?;
        pass.matmul_ids(&m.down, &b.hx, 1, &picks, &b.yx)?;
        let shared = m.shared.as_ref().map(|_| &b.shared);
        pass.moe_sum(&b.yx, &b.wts, shared, n, k, e, &self.xn)
    }

    /// A pass over this session's bind groups.
    fn pass(&self) -> super::Pass<'_> {
        match &self.binds {
            Some(b) => self.w.gpu.pass_cached(b),
            None => self.w.gpu.pass(),
        }
    }

    /// Records the final norm and head over rows `rows` of the residual stream on the device, and the read of
    /// their logits; `normed`: the last layer's add (or a decode step's norm) has left them normalised in `xn`.
    fn head(&self, pass: &mut super::Pass, rows: Range<usize>, normed: bool) -> Result<()> {
        let (hp, head) = (&self.w.hp, self.w.head.as_ref().expect("checked by the caller"));
        let (e, n) = (hp.n_embd, rows.len());
        if !normed {
            pass.copy(&self.x, rows.start * e, &self.xn, 0, n * e)?;
            pass.rms_norm_inplace(&self.xn, &head.norm, hp.rms_eps, n)?;
        }
        pass.matmul(&head.out, &self.xn, n, &self.logits)?;
        pass.read(&self.logits, 0, n * hp.n_vocab)
    }

    /// Uploads the rows of positions `pos` of every device layer from `kv` (after an import into the host's copy).
    pub fn upload_kv(&self, kv: &impl KvLayers, pos: Range<usize>) -> Result<()> {
        let hp = &self.w.hp;
        let (dk, dv) = (hp.head_dim_k, hp.head_dim_v);
        ensure!(
            pos.end <= self.n_ctx,
            "KV positions {pos:?} past a GPU cache of {}",
            self.n_ctx
        );
        for (i, il) in self.w.layers.clone().enumerate() {
            let (k, v, n_ctx) = kv.kv_layer(il);
            ensure!(pos.end <= n_ctx, "KV positions {pos:?} past a host cache of {n_ctx}");
            for h in 0..hp.n_head_kv {
                let (at, host) = (h * self.n_ctx + pos.start, h * n_ctx);
                let (h0, h1) = (host + pos.start, host + pos.end);
                self.w.gpu.write_halves(&self.kv[i].k, at * dk, &k[h0 * dk..h1 * dk])?;
                self.w.gpu.write_halves(&self.kv[i].v, at * dv, &v[h0 * dv..h1 * dv])?;
            }
        }
        Ok(())
    }
}

/// Layers a forward pass records before it starts them on the device (`Pass::flush`), so the GPU runs the first
/// layers while the host records the next: `BATON_GPU_FLUSH_LAYERS` (0: one submission for the whole pass), else
/// 2 (on an H200 the 1B's decode ran at 352, 454, 441 and 404 tokens/s with 0, 2, 4 and 8); never on a software
/// adapter, where recording is not what waits. Read once.
fn flush_layers(gpu: &Gpu) -> usize {
    static EVERY: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if gpu.is_software() {
        return 0;
    }
    *EVERY.get_or_init(|| super::env_number("BATON_GPU_FLUSH_LAYERS", |_| true, 2))
}

/// Little-endian f16 bytes into `out`.
fn halves_into(bytes: &[u8], out: &mut [f16]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// Little-endian f32 bytes into `out`.
fn f32s_into(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use crate::engine::kv_cache::KvBlock;
    use crate::engine::placement::Placement;
    use crate::engine::session::{Input, Session, Want};
    use crate::kernels::ThreadPool;
    use crate::model::{Arch, Model};
    use std::sync::Arc;

    /// Index of the largest logit, and its gap to the second largest.
    fn top(logits: &[f32]) -> (u32, f32) {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        (idx[0] as u32, logits[idx[0]] - logits[idx[1]])
    }

    /// Largest difference between `a` and `b`, and the largest magnitude of `a`.
    fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
        assert_eq!(a.len(), b.len());
        let d = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        (d, a.iter().fold(0.0f32, |m, v| m.max(v.abs())))
    }

    fn pool() -> Arc<ThreadPool> {
        Arc::new(ThreadPool::new(2))
    }

    /// Tiny random-weight F32 models of both architectures (Gemma 3's with a sliding window of 16), written into
    /// `dir`: there the CPU multiplies f32 activations too, so the backends differ only in summation order and `exp`.
    fn tiny_models(dir: &std::path::Path) -> Vec<(Arch, std::path::PathBuf)> {
        use crate::gguf::GgufFile;
        use crate::model::random::{RandomSpec, write_random_model};
        let base = crate::fetch::resolve("smollm2").unwrap_or_else(|e| panic!("model smollm2 unavailable: {e:#}"));
        [Arch::Llama, Arch::Gemma3]
            .into_iter()
            .map(|arch| {
                let p = dir.join(format!("{}.gguf", arch.name()));
                write_random_model(&GgufFile::open(&base).unwrap(), &RandomSpec::tiny(arch), &p).unwrap();
                (arch, p)
            })
            .collect()
    }

    /// Every `--gpu-layers` from 0 to all 4 layers, for both architectures: a 24-token prompt (past Gemma's window)
    /// and 6 greedy steps give logits within 1e-3 of their scale of the CPU session's, every step; the prompt's
    /// logits of every row (`AllLogits`, perplexity's path) too. The host's copy of the KV rows the GPU wrote
    /// equals the CPU's within f16 rounding.
    #[test]
    fn every_gpu_layer_split_matches_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let dir = tempfile::tempdir().unwrap();
        for (arch, path) in tiny_models(dir.path()) {
            let model = Arc::new(Model::load(&path).unwrap());
            let n_ctx = 48;
            let prompt: Vec<u32> = (0..24).map(|i| 100 + (i * 37) % 900).collect();
            let mut cpu = Session::placed(model.clone(), pool(), n_ctx, 32, &Placement::cpu()).unwrap();
            let all = cpu.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec();
            let mut c_steps = vec![all[all.len() - model.hp.n_vocab..].to_vec()];
            for _ in 0..6 {
                let (t, _) = top(c_steps.last().unwrap());
                c_steps.push(cpu.forward(Input::Tokens(&[t]), Want::LastLogits).unwrap().to_vec());
            }
            for n_gpu in 0..=4 {
                let placement = Placement::on_gpu(gpu.clone(), Some(n_gpu));
                let mut g = Session::placed(model.clone(), pool(), n_ctx, 32, &placement).unwrap();
                assert_eq!(g.gpu_layers(), 0..n_gpu);
                let g_all = g.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec();
                let (d, scale) = diff(&all, &g_all);
                assert!(
                    d <= 1e-3 * scale.max(1.0),
                    "{arch:?} gpu-layers {n_gpu}: prompt logits differ by {d}"
                );
                for (step, c) in c_steps.iter().enumerate().skip(1) {
                    let (t, _) = top(&c_steps[step - 1]);
                    let l = g.forward(Input::Tokens(&[t]), Want::LastLogits).unwrap().to_vec();
                    let (d, scale) = diff(c, &l);
                    eprintln!("{arch:?} gpu-layers {n_gpu} step {step}: max logit diff {d:.2e} of {scale:.2}");
                    assert!(
                        d <= 1e-3 * scale.max(1.0),
                        "{arch:?} gpu-layers {n_gpu} step {step}: {d}"
                    );
                }
                let n = cpu.n_past();
                assert_eq!(g.n_past(), n);
                let (kc, kg) = (
                    KvBlock::from_cache(cpu.kv(), model.range.clone(), 0..n),
                    KvBlock::from_cache(g.kv(), model.range.clone(), 0..n),
                );
                for (a, b) in kc.k.iter().chain(&kc.v).zip(kg.k.iter().chain(&kg.v)) {
                    let (d, scale) = diff(a, b);
                    assert!(
                        d <= 2e-3 * scale.max(1.0),
                        "{arch:?} gpu-layers {n_gpu}: KV rows differ by {d}"
                    );
                }
            }
        }
    }

    /// The generated family models of `tests/models` (their tensors as llama.cpp's writer lays them out): Llama 3's
    /// RoPE frequency factors (F32), Qwen 2's Q/K/V biases (Q8_0), Qwen 3's Q/K head norms, head size 32 and
    /// linear RoPE scaling (F16), Phi-3's fused QKV and gate/up (F32, NeoX RoPE) and a llama of every i-quant, with
    /// every `--gpu-layers` from 0 to all. Prompt logits of every row and 6 greedy steps are within `tol` of the
    /// logit scale of the CPU's: 1e-3 where the CPU multiplies f32 activations, more where it multiplies 8-bit
    /// activations and the GPU f32 ones: Q8_0 2e-2 (measured 1.2 %; without the biases 43 %), the i-quants 4e-2
    /// (measured 2.0 %; each type's matmul is checked tightly against the exact product in `matmul.rs`). And the
    /// mixtures of experts (F32): qwen3moe (softmax routing, 8 experts, 2 a token), dots1 (a leading dense layer,
    /// sigmoid gating with a selection bias, 4 groups of which 2 are kept, scale 2.5, shared experts) and glm4moe
    /// (Q/K/V biases, Q/K norms in some layers only, RoPE on 16 of a head's 32 dimensions, its pre-FFN norm stored
    /// as `post_attention_norm`, 32 experts, a shared one), whose experts are routed and picked on the device; and
    /// deepseek2 (latent attention: Q through its low-rank pair, K heads of 48 ending in 16 rotated dimensions, V
    /// heads of 24; V3's grouped sigmoid routing, 2 shared experts), and it again with Q one matrix (V2-Lite's).
    #[test]
    fn generated_families_match_cpu() {
        let Some(gpu) = test_gpu() else { return };
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models");
        let tmp = tempfile::tempdir().unwrap();
        let lite = deepseek2_without_q_lora(tmp.path());
        let files = [
            ("llama3", 1e-3),
            ("qwen2", 2e-2),
            ("qwen3", 1e-3),
            ("phi3", 1e-3),
            ("iquants", 4e-2),
            ("qwen3moe", 1e-3),
            ("dots1", 1e-3),
            ("glm4moe", 1e-3),
            ("deepseek2", 1e-3),
        ];
        let models = files
            .map(|(name, tol)| (name, dir.join(format!("{name}.gguf")), tol))
            .into_iter()
            .chain([("deepseek2 (attn_q)", lite, 1e-3)]);
        for (name, path, tol) in models {
            let model = Arc::new(Model::load(&path).unwrap());
            let prompt: Vec<u32> = (0..20).map(|i| 300 + (i * 53) % 3000).collect();
            let mut cpu = Session::placed(model.clone(), pool(), 64, 32, &Placement::cpu()).unwrap();
            let all = cpu.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec();
            let mut c_steps = vec![all[all.len() - model.hp.n_vocab..].to_vec()];
            for _ in 0..6 {
                let (t, _) = top(c_steps.last().unwrap());
                c_steps.push(cpu.forward(Input::Tokens(&[t]), Want::LastLogits).unwrap().to_vec());
            }
            for n_gpu in 0..=model.hp.n_layer {
                let mut g = Session::placed(
                    model.clone(),
                    pool(),
                    64,
                    32,
                    &Placement::on_gpu(gpu.clone(), Some(n_gpu)),
                )
                .unwrap();
                assert_eq!(g.gpu_layers(), 0..n_gpu);
                let g_all = g.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec();
                let (d, scale) = diff(&all, &g_all);
                eprintln!("{name} gpu-layers {n_gpu}: prompt logits differ by {d:.2e} of {scale:.2}");
                assert!(
                    d <= tol * scale.max(1.0),
                    "{name} gpu-layers {n_gpu}: prompt logits differ by {d}"
                );
                for (step, c) in c_steps.iter().enumerate().skip(1) {
                    let (t, _) = top(&c_steps[step - 1]);
                    let l = g.forward(Input::Tokens(&[t]), Want::LastLogits).unwrap().to_vec();
                    let (d, scale) = diff(c, &l);
                    eprintln!("{name} gpu-layers {n_gpu} step {step}: logits differ by {d:.2e} of {scale:.2}");
                    assert!(d <= tol * scale.max(1.0), "{name} gpu-layers {n_gpu} step {step}: {d}");
                }
            }
        }
    }

    /// The generated deepseek2 with Q one matrix, as DeepSeek-V2-Lite's (`attention.q_lora_rank` 0, a random
    /// `attn_q` for each layer's low-rank pair), written into `dir`.
    fn deepseek2_without_q_lora(dir: &std::path::Path) -> std::path::PathBuf {
        use crate::gguf::{GgmlType, GgufFile, GgufWriter, Value};
        use crate::kernels::testutil::Rng;
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/deepseek2.gguf");
        let f = GgufFile::open(&src).unwrap();
        let hp = crate::model::Hparams::from_gguf(&f).unwrap();
        let mut w = GgufWriter::from_file(&f).unwrap();
        let key = "deepseek2.attention.q_lora_rank";
        w.metadata.retain(|(k, _)| k != key);
        w.meta(key, Value::U32(0));
        w.tensors.retain(|(n, ..)| {
            !["attn_q_a.", "attn_q_a_norm.", "attn_q_b."]
                .iter()
                .any(|t| n.contains(t))
        });
        let (e, nq) = (hp.n_embd, hp.n_embd_q());
        let mut rng = Rng(2150);
        for il in 0..hp.n_layer {
            let q: Vec<u8> = (0..e * nq)
                .flat_map(|_| (rng.normal() / (e as f32).sqrt()).to_le_bytes())
                .collect();
            w.tensor(
                &format!("blk.{il}.attn_q.weight"),
                vec![e as u64, nq as u64],
                GgmlType::F32,
                q,
            );
        }
        let p = dir.join("deepseek2-lite.gguf");
        w.write(&p).unwrap();
        p
    }

    /// `--experts-on-disk` with the GPU: the experts of the GPU's layers are uploaded all the same (read from the
    /// mapped file once), those of its CPU layers stay in the map; either way the logits are the resident model's.
    #[test]
    fn experts_on_disk_still_upload_to_the_gpu() {
        let Some(gpu) = test_gpu() else { return };
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/qwen3moe.gguf");
        let resident = Arc::new(Model::load(&path).unwrap());
        let file = Arc::new(crate::gguf::GgufFile::open(&path).unwrap());
        let on_disk = Arc::new(Model::from_file_placed(file, None, true).unwrap());
        let prompt: Vec<u32> = (0..12).map(|i| 300 + (i * 71) % 3000).collect();
        let mut cpu = Session::placed(resident.clone(), pool(), 32, 16, &Placement::cpu()).unwrap();
        let want = cpu.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec();
        for n_gpu in [1, on_disk.hp.n_layer] {
            let placed = Placement::on_gpu(gpu.clone(), Some(n_gpu));
            let mut g = Session::placed(on_disk.clone(), pool(), 32, 16, &placed).unwrap();
            assert_eq!(g.gpu_layers(), 0..n_gpu);
            let got = g.forward(Input::Tokens(&prompt), Want::AllLogits).unwrap().to_vec();
            let (d, scale) = diff(&want, &got);
            assert!(d <= 1e-3 * scale.max(1.0), "gpu-layers {n_gpu}: logits differ by {d}");
        }
    }

    /// Disaggregation's moves between backends in one process: a GPU session's prompt KV (the host's copy) imported
    /// into a CPU session, and a CPU session's into a GPU session, each then decodes as the session that did
    /// everything itself; a layer range on the GPU hands its hidden state to the CPU's remaining range as a
    /// two-stage pipeline does. For the tiny llama and gemma3 and the generated phi3 (fused projections).
    #[test]
    fn kv_and_hidden_states_cross_backends() {
        let Some(gpu) = test_gpu() else { return };
        let dir = tempfile::tempdir().unwrap();
        let on_gpu = Placement::on_gpu(gpu.clone(), None);
        let phi3 = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/phi3.gguf");
        for (arch, path) in tiny_models(dir.path()).into_iter().chain([(Arch::Phi3, phi3)]) {
            let model = Arc::new(Model::load(&path).unwrap());
            let prompt: Vec<u32> = (0..20).map(|i| 50 + (i * 53) % 800).collect();
            let n = prompt.len();
            let mut reference = Session::placed(model.clone(), pool(), 40, 32, &Placement::cpu()).unwrap();
            reference.forward(Input::Tokens(&prompt), Want::LastLogits).unwrap();
            let want = reference
                .forward(Input::Tokens(&[7]), Want::LastLogits)
                .unwrap()
                .to_vec();
            for (from, to) in [(&on_gpu, &Placement::cpu()), (&Placement::cpu(), &on_gpu)] {
                let mut a = Session::placed(model.clone(), pool(), 40, 32, from).unwrap();
                a.forward(Input::Tokens(&prompt), Want::LastLogits).unwrap();
                let mut block = KvBlock::from_cache(a.kv(), model.range.clone(), 0..n);
                block.tokens = Some(prompt.clone());
                let mut b = Session::placed(model.clone(), pool(), 40, 32, to).unwrap();
                b.import_kv(&block).unwrap();
                b.hold_positions(n, &prompt).unwrap();
                let got = b.forward(Input::Tokens(&[7]), Want::LastLogits).unwrap();
                let (d, scale) = diff(&want, got);
                assert!(
                    d <= 1e-3 * scale.max(1.0),
                    "{arch:?}: decode after a handoff differs by {d}"
                );
            }
            // The first half of the layers on the GPU as one stage, the rest on the CPU as the next.
            let (half, n_layer) = (model.hp.n_layer / 2, model.hp.n_layer);
            let first = Arc::new(Model::load_range(&path, Some(0..half)).unwrap());
            let last = Arc::new(Model::load_range(&path, Some(half..n_layer)).unwrap());
            let mut s0 = Session::placed(first, pool(), 40, 32, &on_gpu).unwrap();
            let mut s1 = Session::placed(last, pool(), 40, 32, &Placement::cpu()).unwrap();
            assert_eq!(s0.gpu_layers(), 0..half);
            let h = s0.forward(Input::Tokens(&prompt), Want::Hidden).unwrap().to_vec();
            s1.forward(Input::Hidden(&h), Want::LastLogits).unwrap();
            let h = s0.forward(Input::Tokens(&[7]), Want::Hidden).unwrap().to_vec();
            let got = s1.forward(Input::Hidden(&h), Want::LastLogits).unwrap();
            let (d, scale) = diff(&want, got);
            assert!(d <= 1e-3 * scale.max(1.0), "{arch:?}: GPU→CPU pipeline differs by {d}");
        }
    }

    /// The bind groups a session builds once and reuses change nothing: with them, its logits (every row of a
    /// prompt, through the tiled matmul, then decode steps, through the per-row one) equal bit for bit those of a
    /// session that builds each dispatch's own; from the second decode step on, no bind group is built.
    #[test]
    fn cached_bind_groups_change_nothing() {
        use super::{GpuLayers, GpuWeights, Out};
        use crate::engine::KvCache;
        use crate::kernels::testutil::Rng;
        let Some(gpu) = test_gpu() else { return };
        let dir = tempfile::tempdir().unwrap();
        for (arch, path) in tiny_models(dir.path()) {
            let model = Arc::new(Model::load(&path).unwrap());
            let hp = &model.hp;
            let w = Arc::new(GpuWeights::upload(gpu.clone(), &model, model.range.clone()).unwrap());
            let mut rng = Rng(2104);
            let n = 21;
            let rows: Vec<Vec<f32>> = (0..n + 5)
                .map(|_| (0..hp.n_embd).map(|_| rng.normal()).collect())
                .collect();
            let mut outs = Vec::new();
            for cached in [true, false] {
                let mut g = GpuLayers::new(w.clone(), 48, 32).unwrap();
                if !cached {
                    g.binds = None;
                }
                let mut kv = KvCache::new(hp, model.range.clone(), 48);
                let mut x = rows[..n].concat();
                let mut logits = vec![0.0; n * hp.n_vocab];
                let out = Out::Logits {
                    rows: 0..n,
                    logits: &mut logits,
                };
                g.forward(&mut x, None, n, 0, 0, &mut kv, out).unwrap();
                let mut got = vec![logits];
                let mut built = Vec::new();
                for (step, row) in rows[n..].iter().enumerate() {
                    let mut x = row.clone();
                    let mut logits = vec![0.0; hp.n_vocab];
                    let out = Out::Logits {
                        rows: 0..1,
                        logits: &mut logits,
                    };
                    g.forward(&mut x, None, 1, n + step, 0, &mut kv, out).unwrap();
                    got.push(logits);
                    built.push(g.binds.as_ref().map_or(0, |b| b.len()));
                }
                if cached {
                    assert!(built[0] > 0);
                    assert!(
                        built.iter().all(|&b| b == built[0]),
                        "{arch:?}: bind groups built {built:?}"
                    );
                }
                outs.push(got);
            }
            for (step, (a, b)) in outs[0].iter().zip(&outs[1]).enumerate() {
                let same = a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "{arch:?} forward {step}: cached bind groups change the logits");
            }
        }
    }

    /// The dispatches of a forward: the first layer's norm, 8 a layer (Q, K and V stacked in one matrix; biases,
    /// head norms, RoPE and the KV stores, into the cache and into the run read back for the host, which replaced
    /// two copies a KV head and then a gather a layer; attention; output; add with the FFN norm; gate/up; down;
    /// add with the next norm) and the head's matmul,
    /// for the tiny llama and gemma3 (post-norms) and the generated qwen2 (biases; Q8_0, so a batch's 4 matmuls a
    /// layer each round their activations first, act8.rs) and qwen3 (head norms). A decode step's last add is
    /// fused with the head's norm; a prompt's last row, not at row 0, takes its own norm; a hidden-state forward
    /// ends on a plain add (after Gemma's post-norm). A decode step folds the norms and adds into its mat-vecs:
    /// the first norm, 6 a layer, the head's norm and matmul (Gemma as a batch). It was 14 a layer (16 with
    /// post-norms or head norms, 17 with biases) before the fusions and 11 before the stacking and the stores; this
    /// keeps the count from growing back silently.
    /// (Their logits are checked against the CPU's by the tests above.)
    #[test]
    fn forward_dispatches_per_layer() {
        use super::{GpuLayers, GpuWeights, Out};
        use crate::engine::KvCache;
        use crate::kernels::testutil::Rng;
        const PER_LAYER: usize = 8;
        let Some(gpu) = test_gpu() else { return };
        let dir = tempfile::tempdir().unwrap();
        let generated = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models");
        let models = tiny_models(dir.path())
            .into_iter()
            .map(|(a, p)| (format!("{a:?}"), p))
            .chain(["qwen2", "qwen3"].map(|m| (m.to_string(), generated.join(format!("{m}.gguf")))));
        for (name, path) in models {
            let rounds = if name == "qwen2" { 4 } else { 0 };
            let model = Arc::new(Model::load(&path).unwrap());
            let (hp, layers) = (&model.hp, model.hp.n_layer);
            let w = Arc::new(GpuWeights::upload(gpu.clone(), &model, model.range.clone()).unwrap());
            let mut g = GpuLayers::new(w, 32, 16).unwrap();
            let mut kv = KvCache::new(hp, model.range.clone(), 32);
            let mut rng = Rng(2150);
            let mut rows = |n: usize| (0..n * hp.n_embd).map(|_| rng.normal()).collect::<Vec<f32>>();
            let n = 8;
            let mut logits = vec![0.0; hp.n_vocab];
            let mut x = rows(n);
            g.forward(&mut x, None, n, 0, 0, &mut kv, Out::Hidden).unwrap();
            // Gemma's last post-norm is its own dispatch where the add after it is not fused with a norm.
            let post = usize::from(hp.arch == Arch::Gemma3);
            assert_eq!(
                g.dispatches(),
                1 + (PER_LAYER + rounds) * layers + post,
                "{name}: a forward to the hidden state"
            );
            let mut x = rows(n);
            let out = Out::Logits {
                rows: n - 1..n,
                logits: &mut logits,
            };
            g.forward(&mut x, None, n, n, 0, &mut kv, out).unwrap();
            assert_eq!(
                g.dispatches(),
                1 + (PER_LAYER + rounds) * layers + post + 2,
                "{name}: a prompt's last logits"
            );
            let mut x = rows(1);
            let out = Out::Logits {
                rows: 0..1,
                logits: &mut logits,
            };
            g.forward(&mut x, None, 1, 2 * n, 0, &mut kv, out).unwrap();
            eprintln!("{name}: {} dispatches a decode step of {layers} layers", g.dispatches());
            // A decode step folds the norms into the mat-vecs after them and the adds into those before (6 a
            // layer, after the first norm, then the head's norm and matmul), and the rotation into attention (5);
            // Gemma's post-norms keep the fused adds. `BATON_GPU_FOLD=0`: as a batch.
            let fresh = usize::from(g.pass().attends_fresh(1));
            let decode = if !g.pass().folds(1) || hp.arch == Arch::Gemma3 {
                1 + (PER_LAYER - fresh) * layers + 1
            } else {
                1 + (PER_LAYER - 2 - fresh) * layers + 2
            };
            assert_eq!(g.dispatches(), decode, "{name}: a decode step");
        }
    }

    /// Sessions of one model share its weights on the GPU: uploaded once.
    #[test]
    fn sessions_share_uploaded_weights() {
        let Some(gpu) = test_gpu() else { return };
        let dir = tempfile::tempdir().unwrap();
        let (_, path) = &tiny_models(dir.path())[0];
        let model = Arc::new(Model::load(path).unwrap());
        let p = Placement::on_gpu(gpu, Some(3));
        let a = p.gpu_weights(&model).unwrap().unwrap();
        let b = p.gpu_weights(&model).unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.layers(), 0..3);
        assert!(!a.has_head(), "the head goes with the last layer");
        let other = Arc::new(Model::load(path).unwrap());
        assert!(!Arc::ptr_eq(&a, &p.gpu_weights(&other).unwrap().unwrap()));
    }

    /// A model the GPU backend does not run (deepseek2's absorbed MLA layout) is an error naming it under `--backend
    /// gpu`, and runs on the CPU under `auto` (the CPU's logits, bit for bit).
    #[test]
    fn unsupported_models_fall_back_to_the_cpu_under_auto() {
        let Some(gpu) = test_gpu() else { return };
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/deepseek2-mla.gguf");
        let model = Arc::new(Model::load(&path).unwrap());
        let gpu_only = Placement::on_gpu(gpu.clone(), None);
        let e = format!("{:#}", gpu_only.gpu_weights(&model).err().unwrap());
        assert!(e.contains("absorbed MLA layout"), "{e}");
        let auto = Placement::on_gpu(gpu, None).with_cpu_fallback();
        assert!(auto.gpu_weights(&model).unwrap().is_none());
        let prompt = [1u32, 2, 3, 4];
        let mut s = Session::placed(model.clone(), pool(), 16, 8, &auto).unwrap();
        let mut c = Session::placed(model, pool(), 16, 8, &Placement::cpu()).unwrap();
        assert_eq!(s.eval(&prompt).unwrap(), c.eval(&prompt).unwrap());
    }

    /// Greedy decoding of `n_new` tokens after `prompt` on a GPU session and a CPU one: the same tokens, or a first
    /// difference where the CPU's top two logits are within 0.1 (a near-tie, which the two backends' roundings may
    /// break differently: a decode step's activations are rounded to 8 bits on the CPU only). Logits stay close all
    /// along.
    fn greedy_matches(file: &str, prompt: &[u32], n_new: usize) {
        let Some(gpu) = test_gpu() else { return };
        // A default model is fetched (or the test fails), as every test that needs one.
        let path = crate::fetch::resolve(file).unwrap_or_else(|e| panic!("model {file} unavailable: {e:#}"));
        let model = Arc::new(Model::load(&path).unwrap());
        let n_ctx = 64;
        let mut cpu = Session::placed(model.clone(), pool(), n_ctx, 32, &Placement::cpu()).unwrap();
        let t = std::time::Instant::now();
        let mut g = Session::placed(model.clone(), pool(), n_ctx, 32, &Placement::on_gpu(gpu, None)).unwrap();
        eprintln!("{file}: uploaded in {:.2} s", t.elapsed().as_secs_f32());

        let mut c_logits = cpu.forward(Input::Tokens(prompt), Want::LastLogits).unwrap().to_vec();
        let t = std::time::Instant::now();
        let mut g_logits = g.forward(Input::Tokens(prompt), Want::LastLogits).unwrap().to_vec();
        eprintln!(
            "{file}: GPU prompt of {} in {:.2} s",
            prompt.len(),
            t.elapsed().as_secs_f32()
        );
        let t = std::time::Instant::now();
        for step in 0..n_new {
            let (ct, gap) = top(&c_logits);
            let (gt, _) = top(&g_logits);
            let (d, scale) = diff(&c_logits, &g_logits);
            eprintln!("{file} step {step}: CPU {ct} GPU {gt}, top-2 gap {gap:.3}, max logit diff {d:.4} of {scale:.1}");
            // The CPU rounds a decode step's activations to 8 bits before each matmul and the GPU does not (a batch's
            // it rounds as the CPU's, act8.rs): through the layers of these small quantized models that moves the
            // logits by up to a unit (the CPU's own ISAs differ by 0.3, docs/correctness.md). This bound only catches
            // gross faults; the tiny-model tests are the tight check.
            assert!(d <= 0.1 * scale.max(1.0), "{file} step {step}: logits differ by {d}");
            if ct != gt {
                assert!(
                    gap < 0.1,
                    "{file} step {step}: CPU picks {ct}, GPU {gt}, with a gap of {gap}"
                );
                eprintln!("{file}: parted at a near-tie at step {step} (gap {gap:.3})");
                return;
            }
            c_logits = cpu.forward(Input::Tokens(&[ct]), Want::LastLogits).unwrap().to_vec();
            g_logits = g.forward(Input::Tokens(&[gt]), Want::LastLogits).unwrap().to_vec();
        }
        eprintln!(
            "{file}: {n_new} steps in {:.2} s, both backends",
            t.elapsed().as_secs_f32()
        );
    }

    /// SmolLM2 (llama): a batched prompt, then decode steps.
    #[test]
    fn smollm2_greedy_matches_cpu() {
        greedy_matches(
            "smollm2",
            &[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198],
            12,
        );
    }

    /// Gemma 3 (Q/K norms, post-norms, GeGLU, sliding-window layers with their own RoPE base, scaled embeddings).
    #[test]
    fn gemma3_greedy_matches_cpu() {
        greedy_matches(
            "gemma3",
            &[
                2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107,
            ],
            12,
        );
    }
}
