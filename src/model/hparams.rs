//! Hyperparameters read from GGUF metadata, with the per-architecture defaults llama.cpp applies.

use crate::gguf::GgufFile;
use anyhow::{Context, Result, bail};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Gemma3,
    /// Qwen 2 / 2.5: llama's math with biases on Q, K and V, and NeoX RoPE.
    Qwen2,
    /// Qwen 3 (dense): llama's math with per-head RMSNorm of Q and K before RoPE, and NeoX RoPE.
    Qwen3,
    /// Qwen 3 MoE: Qwen 3's attention, and a mixture of experts in place of the feed-forward ([`Moe`]).
    Qwen3Moe,
    /// dots.llm1: Qwen 3's attention (no GQA), leading dense layers, then a mixture of experts with DeepSeek V3's
    /// routing (sigmoid gating, a selection bias, a weights scale) and a shared expert.
    Dots1,
    /// Phi-3 / Phi-4 mini: llama's math with NeoX RoPE, Q/K/V and gate/up each stored as one fused matrix.
    Phi3,
    /// GLM-4.5 / GLM-4.5-Air: llama's block with Q/K/V biases, optional per-head Q/K norms, partial NeoX RoPE, the
    /// pre-FFN norm stored as `post_attention_norm`, leading dense layers, then dots1's kind of mixture (sigmoid
    /// gating by default, a required selection bias, a scale, shared experts); its NextN/MTP layers are not run.
    Glm4Moe,
    /// DeepSeek V2/V3, Kimi K2: multi-head latent attention ([`Mla`]: Q through an optional low-rank pair, K and V
    /// from one compressed vector per token plus a RoPE key shared by all heads, RoPE on the last `n_rot` dimensions of
    /// each head, adjacent pairs), leading dense layers, then dots1's kind of mixture (softmax gating by default).
    Deepseek2,
}

impl Arch {
    /// Whether the architecture's feed-forward is a mixture of experts (on all layers, or after dense ones).
    pub fn is_moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe | Arch::Dots1 | Arch::Glm4Moe | Arch::Deepseek2)
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Dots1 => "dots1",
            Arch::Phi3 => "phi3",
            Arch::Glm4Moe => "glm4moe",
            Arch::Deepseek2 => "deepseek2",
        }
    }
}

/// How RoPE pairs dimensions: adjacent pairs (llama.cpp's NORM, used by `llama` whose converter permutes Q/K) or
/// the two halves of the head (NEOX, used by Gemma).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeType {
    Norm,
    Neox,
}

#[derive(Clone, Debug)]
pub struct Hparams {
    pub arch: Arch,
    /// Layers the forward runs: `block_count` less the NextN/MTP layers stored after them.
    pub n_layer: usize,
    /// NextN/MTP layers (`nextn_predict_layers`, GLM-4.5): stored as blocks `n_layer..n_layer + n_layer_nextn`, for
    /// speculative decoding; llama.cpp's decoder graph does not run them, and neither does Baton.
    pub n_layer_nextn: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub rope_type: RopeType,
    /// Number of rotated dimensions per head.
    pub n_rot: usize,
    pub rope_base: f32,
    /// RoPE base of sliding-window layers (Gemma 3: 10 000 while global layers use 1 000 000).
    pub rope_base_swa: f32,
    /// Sliding window of local-attention layers, in positions (a query at p sees keys p-window+1 ..= p).
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window?
    pub swa_layers: Vec<bool>,
    /// Scale applied to q·k (before softmax).
    pub attn_scale: f32,
    /// Scale applied to the token embedding (Gemma: √n_embd).
    pub embd_scale: f32,
    /// How RoPE angles are scaled (linear, YaRN), as llama.cpp reads `rope.scaling.*`.
    pub rope_scaling: RopeScaling,
    /// Llama 3's RoPE frequency factors (`rope_freqs.weight`, one per rotated pair): pair i's angle is divided by
    /// factor i, on every layer.
    pub rope_freqs: Option<Vec<f32>>,
    /// The mixture of experts that replaces the feed-forward (`qwen3moe`); `None` for dense models.
    pub moe: Option<Moe>,
    /// DeepSeek's multi-head latent attention (`deepseek2` only).
    pub mla: Option<Mla>,
}

/// How RoPE angles are scaled, from `<arch>.rope.scaling.*` as llama.cpp reads and combines them: a linear position
/// scale (`freq_scale` = 1 / `rope.scaling.factor`), and with YaRN a per-pair mix of the scaled and the unscaled
/// angle. Every cosine and sine is multiplied by [`RopeScaling::mscale`].
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    /// Angles are multiplied by this (1 / `rope.scaling.factor`; 1 without scaling or with type `none`).
    pub freq_scale: f32,
    /// YaRN's ramp (`rope.scaling.type` `yarn`); `None` for linear scaling.
    pub yarn: Option<Yarn>,
    /// The factor llama.cpp passes to ggml's RoPE as `attn_factor`: `rope.scaling.attn_factor` (1 by default), and
    /// under YaRN its mscale over the `1 + 0.1 ln(factor)` ggml's RoPE multiplies back in.
    pub attn_factor: f32,
    /// DeepSeek's `rope.scaling.yarn_log_multiplier` over 0.1 (llama.cpp's `rope_yarn_log_mul`, its
    /// `mscale_all_dim`); 0 without, and for the architectures whose llama.cpp graph does not read it.
    pub yarn_log_mul: f32,
}

/// YaRN's extrapolation ramp: pairs that turn fewer than `beta_slow` times over the original context are
/// interpolated (the scaled angle), those that turn more than `beta_fast` times keep the unscaled angle, those
/// between are mixed linearly by pair index (ggml's `rope_yarn_corr_dims`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.original_context_length` (the training context without it).
    pub orig_ctx: usize,
    /// llama.cpp's defaults for every architecture Baton runs (32 and 1; only its grok and mistral3 read keys).
    pub beta_fast: f32,
    pub beta_slow: f32,
}

impl RopeScaling {
    /// No scaling: the plain angles, bit for bit.
    pub const NONE: RopeScaling = RopeScaling {
        freq_scale: 1.0,
        yarn: None,
        attn_factor: 1.0,
        yarn_log_mul: 0.0,
    };

    /// The factor on every cosine and sine: `attn_factor`, times `1 + 0.1 ln(1 / freq_scale)` under YaRN (ggml's
    /// `rope_yarn` with an extrapolation factor of 1, llama.cpp's for YaRN).
    pub fn mscale(&self) -> f32 {
        match self.yarn {
            Some(_) => self.attn_factor * (1.0 + 0.1 * (1.0 / self.freq_scale).ln()),
            None => self.attn_factor,
        }
    }
}

impl Yarn {
    /// The first and last pair index of the ramp for `n_rot` rotated dimensions at base `base` (ggml's
    /// `ggml_rope_yarn_corr_dims`, in its f32 arithmetic).
    pub fn corr_dims(&self, n_rot: usize, base: f32) -> [f32; 2] {
        let dim = |beta: f32| {
            n_rot as f32 * (self.orig_ctx as f32 / (beta * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
        };
        [
            dim(self.beta_fast).floor().max(0.0),
            dim(self.beta_slow).ceil().min(n_rot as f32 - 1.0),
        ]
    }
}

/// The shape of DeepSeek's multi-head latent attention (MLA), in either of llama.cpp's layouts:
/// - without the absorption (legacy `attn_kv_b` files): each head's K is `[K_nope (n_nope) | k_pe (n_rot)]`
///   (`head_dim_k`), its V `head_dim_v` wide; K_nope and V come from the normalised compressed vector through
///   `attn_kv_b`, `k_pe` (rotated, one for all heads) from the same `attn_kv_a_mqa` row. The cache holds every head's
///   K and V.
/// - absorbed (`attn_k_b`/`attn_v_b`, what llama.cpp's converters write now): the cache holds one KV head, K the
///   normalised compressed vector then the rotated `k_pe` (`head_dim_k` = `kv_lora_rank + n_rot`), V the compressed
///   vector (`head_dim_v` = `kv_lora_rank`). Each head's Q_nope is taken into the compressed space by its
///   `attn_k_b`, and its attention output out of it by its `attn_v_b`: the same attention, far less cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Mla {
    /// Width of Q's low-rank intermediate (`attention.q_lora_rank`; 0: Q is one matrix, `attn_q`).
    pub q_lora_rank: usize,
    /// Width of the compressed KV vector (`attention.kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Dimensions of each head's Q and K that RoPE does not turn, first in the head (`key_length_mla - n_rot` when
    /// absorbed, `head_dim_k - n_rot` otherwise).
    pub n_nope: usize,
    /// Each head's V width as `attn_output` reads it (`value_length_mla` when absorbed, `head_dim_v` otherwise).
    pub v_head: usize,
    /// llama.cpp's absorbed layout (above).
    pub absorbed: bool,
}

impl Mla {
    /// Width of each head's Q as `attn_q_b` (or `attn_q`) writes it: `n_nope` then the `n_rot` RoPE turns.
    pub fn q_head(&self, n_rot: usize) -> usize {
        self.n_nope + n_rot
    }
}

/// A mixture-of-experts feed-forward's shape and how it routes.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    pub n_expert: usize,
    /// Experts each token runs (top-k).
    pub n_expert_used: usize,
    /// Width of one expert's feed-forward (and of each shared expert's).
    pub n_ff_exp: usize,
    /// The first layers have a dense feed-forward of width `n_ff` instead (dots1's `leading_dense_block_count`).
    pub n_dense_lead: usize,
    pub routing: Routing,
}

impl Moe {
    /// Whether layer `il` has the mixture (rather than one of the leading dense feed-forwards).
    pub fn has_experts(&self, il: usize) -> bool {
        il >= self.n_dense_lead
    }
}

/// How a token's experts and their weights follow from the router's logits, as data, so that another
/// architecture's routing (DeepSeek V3's sigmoid, groups, scale and shared experts) is a different value rather than
/// a copy of the layer. As llama.cpp's `build_moe_ffn`: probabilities from the gating function; the selection bias
/// (`exp_probs_b`, a per-layer tensor) added for choosing only; the best groups kept; the top k chosen; their
/// unbiased probabilities renormalised and scaled; the shared experts added to the routed sum.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub gating: Gating,
    /// Renormalise the selected experts' probabilities to sum to 1.
    pub normalise: bool,
    /// Factor on the weights after normalising.
    pub scale: f32,
    /// Experts every token runs besides the routed ones, stored as one feed-forward `n_shared * n_ff_exp` wide.
    pub n_shared: usize,
    /// Expert groups (`expert_group_count`; 0 or 1: none): the experts are split into this many groups of
    /// consecutive indices, each scored by the sum of its best two selection scores, and a token chooses its experts
    /// among the `n_group_used` best groups only.
    pub n_group: usize,
    pub n_group_used: usize,
}

impl Routing {
    /// Whether the experts are chosen within groups.
    pub fn grouped(&self) -> bool {
        self.n_group > 1
    }
}

/// The function from router logits to expert probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

impl Hparams {
    pub fn from_gguf(g: &GgufFile) -> Result<Hparams> {
        let arch_name = g.architecture()?;
        let arch = match arch_name {
            "llama" => Arch::Llama,
            "gemma3" => Arch::Gemma3,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "dots1" => Arch::Dots1,
            "phi3" => Arch::Phi3,
            "glm4moe" => Arch::Glm4Moe,
            "deepseek2" => Arch::Deepseek2,
            other => {
                bail!(
                    "unsupported architecture {other:?} (supported: llama, gemma3, qwen2, qwen3, qwen3moe, dots1, phi3, \
                     glm4moe, deepseek2)"
                )
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let u = |k: &str| -> Result<usize> { Ok(g.require_u64(&key(k))? as usize) };

        let n_layer_all = u("block_count")?;
        // As llama.cpp, which reads the key for every architecture; only glm4moe's graph knows to leave them out.
        let n_layer_nextn = g.get_u64(&key("nextn_predict_layers")).unwrap_or(0) as usize;
        if n_layer_nextn > 0 && arch != Arch::Glm4Moe {
            bail!(
                "{} is {n_layer_nextn}, but Baton's {arch_name} has no NextN/MTP layers",
                key("nextn_predict_layers")
            );
        }
        if n_layer_nextn >= n_layer_all {
            bail!(
                "{} is {n_layer_nextn}, leaving none of the {n_layer_all} blocks to run",
                key("nextn_predict_layers")
            );
        }
        let n_layer = n_layer_all - n_layer_nextn;
        let n_embd = u("embedding_length")?;
        // A mixture of experts has its own width (`expert_feed_forward_length`); llama.cpp does not need this one
        // (dots1's leading dense layers do: checked in `moe_hparams`).
        let n_ff = if arch.is_moe() {
            g.get_u64(&key("feed_forward_length")).unwrap_or(0) as usize
        } else {
            u("feed_forward_length")?
        };
        let n_head = u("attention.head_count")?;
        let n_head_kv = g
            .get_u64(&key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            bail!("invalid head counts: {n_head} query heads, {n_head_kv} KV heads");
        }
        let head_dim_k = g
            .get_u64(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(n_embd / n_head);
        let head_dim_v = g
            .get_u64(&key("attention.value_length"))
            .map(|v| v as usize)
            .unwrap_or(n_embd / n_head);
        let n_ctx_train = u("context_length")?;
        let rms_eps = g
            .get_f32(&key("attention.layer_norm_rms_epsilon"))
            .context("missing attention.layer_norm_rms_epsilon")?;
        let rope_base = g.get_f32(&key("rope.freq_base")).unwrap_or(10000.0);
        let n_rot = g
            .get_u64(&key("rope.dimension_count"))
            .map(|v| v as usize)
            .unwrap_or(head_dim_k);
        let token_embd = g.tensor_info("token_embd.weight")?;
        let n_vocab = token_embd.n_rows();
        if token_embd.ne0() != n_embd {
            bail!(
                "token_embd.weight has rows of {} but embedding_length is {n_embd}",
                token_embd.ne0()
            );
        }
        if n_rot > head_dim_k || !n_rot.is_multiple_of(2) {
            bail!("rope dimension count {n_rot} does not fit head size {head_dim_k}");
        }
        if !(rope_base.is_finite() && rope_base > 0.0) {
            bail!("{} is {rope_base}, not a positive number", key("rope.freq_base"));
        }
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            bail!(
                "{} is {rms_eps}, not a positive number",
                key("attention.layer_norm_rms_epsilon")
            );
        }
        if n_layer == 0
            || n_embd == 0
            || (n_ff == 0 && !arch.is_moe())
            || head_dim_k == 0
            || head_dim_v == 0
            || n_ctx_train == 0
        {
            bail!(
                "a size in the metadata is zero (layers {n_layer}, embedding {n_embd}, feed-forward {n_ff}, head sizes \
                 {head_dim_k}/{head_dim_v}, context {n_ctx_train})"
            );
        }
        // No real model has a width, head count or head size near 2^24; bounding them keeps every product of two
        // (`n_head * head_dim`, ...) far from overflow.
        const MAX_SIZE: usize = 1 << 24;
        if [n_embd, n_ff, n_head, n_head_kv, head_dim_k, head_dim_v, n_rot]
            .iter()
            .any(|&v| v > MAX_SIZE)
        {
            bail!(
                "a size in the metadata is larger than {MAX_SIZE} (embedding {n_embd}, feed-forward {n_ff}, heads \
                 {n_head}/{n_head_kv}, head sizes {head_dim_k}/{head_dim_v}, rope dimensions {n_rot})"
            );
        }
        // Every layer has tensors of its own, so a count above the file's tensors is corrupt metadata; refused here,
        // before anything is reserved per layer.
        if n_layer_all > g.tensors.len() {
            bail!(
                "{} is {n_layer_all}, but the file holds only {} tensors",
                key("block_count"),
                g.tensors.len()
            );
        }
        let rope_scaling = rope_scaling(g, arch, n_ctx_train, &key)?;
        let rope_freqs = rope_freqs(g, n_rot)?;

        // The llama shape; Gemma 3 differs in RoPE pairing, local layers and scales.
        let mut hp = Hparams {
            arch,
            n_layer,
            n_layer_nextn,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_vocab,
            n_ctx_train,
            rms_eps,
            rope_type: RopeType::Norm,
            n_rot,
            rope_base,
            rope_base_swa: rope_base,
            sliding_window: None,
            swa_layers: vec![false; n_layer],
            attn_scale: 1.0 / (head_dim_k as f32).sqrt(),
            embd_scale: 1.0,
            rope_scaling,
            rope_freqs,
            moe: None,
            mla: None,
        };
        if arch.is_moe() {
            hp.moe = Some(moe_hparams(g, arch, n_layer, n_ff, &key)?);
        } else if let Some(k) = ["expert_count", "expert_used_count"]
            .map(&key)
            .into_iter()
            .find(|k| g.get(k).is_some() && g.get_u64(k) != Some(0))
        {
            // Mixtral, say, is `llama` with experts: refused rather than run as a dense model. A count of 0 is dense.
            bail!("{k} is set, but Baton's {arch_name} is a dense architecture; its experts would be ignored");
        }
        if arch == Arch::Dots1 {
            // llama.cpp's dots1 sizes K and V for every query head and asserts that RoPE turns the whole head.
            if n_head_kv != n_head {
                bail!("dots1 has as many KV heads as query heads, but this file says {n_head_kv} and {n_head}");
            }
            if n_rot != head_dim_k || head_dim_v != head_dim_k {
                bail!(
                    "dots1 rotates whole heads of one size: rope dimensions {n_rot}, head sizes {head_dim_k}/{head_dim_v}"
                );
            }
        }
        if arch == Arch::Glm4Moe {
            // llama.cpp asserts one head size; its rope type is NeoX unless `rope.dimension_sections` asks for
            // M-RoPE (sections 0 and 1 both set), which Baton does not implement.
            if head_dim_v != head_dim_k {
                bail!("glm4moe has one head size, but this file says {head_dim_k} for K and {head_dim_v} for V");
            }
            let k = key("rope.dimension_sections");
            let sections = g.num_array(&k, crate::gguf::Value::as_u64)?.unwrap_or_default();
            if sections.len() >= 2 && sections[0] > 0 && sections[1] > 0 {
                bail!("{k} is {sections:?}: multimodal RoPE (M-RoPE) is not implemented");
            }
        }
        if arch == Arch::Deepseek2 {
            hp.mla = Some(mla_hparams(g, &mut hp, &key)?);
        }
        if matches!(
            arch,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Dots1 | Arch::Phi3 | Arch::Glm4Moe
        ) {
            hp.rope_type = RopeType::Neox;
        }
        if arch == Arch::Phi3 && g.get_u64(&key("attention.sliding_window")).is_some_and(|w| w > 0) {
            // llama.cpp (the reference these models are checked against) runs Phi-3 with full attention whatever
            // this says, as the converters fill it in wrongly (its PR 13676); Baton does the same, and says so.
            tracing::warn!("phi3: attention.sliding_window is ignored, as llama.cpp ignores it (full attention)");
        }
        if arch == Arch::Gemma3 {
            hp.rope_type = RopeType::Neox;
            hp.rope_base_swa = 10000.0;
            hp.sliding_window = Some(u("attention.sliding_window")?);
            // Five local layers, then one global (llama.cpp's swa pattern 6).
            hp.swa_layers = (0..n_layer).map(|il| il % 6 < 5).collect();
            // query_pre_attn_scalar is head_dim for every size but 27B (the one with 62 layers).
            if n_layer == 62 {
                hp.attn_scale = 1.0 / ((n_embd / n_head) as f32).sqrt();
            }
            hp.embd_scale = (n_embd as f32).sqrt();
        }
        Ok(hp)
    }

    /// How RoPE positions are scaled, for `baton info`.
    pub fn rope_scaling_label(&self) -> String {
        let mut parts = Vec::new();
        let r = &self.rope_scaling;
        match &r.yarn {
            Some(y) => parts.push(format!(
                "YaRN, factor {}, original context {}, mscale {}",
                1.0 / r.freq_scale,
                y.orig_ctx,
                r.mscale()
            )),
            None if r.freq_scale != 1.0 => parts.push(format!("linear, factor {}", 1.0 / r.freq_scale)),
            None => {}
        }
        if r.yarn.is_none() && r.attn_factor != 1.0 {
            parts.push(format!("attention factor {}", r.attn_factor));
        }
        if let Some(f) = &self.rope_freqs {
            let (lo, hi) = f.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            parts.push(format!("frequency factors rope_freqs ({} pairs, {lo}..{hi})", f.len()));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(" + ")
        }
    }

    /// Width of K (or V) rows per position across KV heads.
    pub fn n_embd_k(&self) -> usize {
        self.n_head_kv * self.head_dim_k
    }
    pub fn n_embd_v(&self) -> usize {
        self.n_head_kv * self.head_dim_v
    }
    pub fn n_embd_q(&self) -> usize {
        self.n_head * self.head_dim_k
    }
    /// Width of the attention's output as `attn_output` reads it: every head's V (DeepSeek's absorbed layout: each
    /// head's V after `attn_v_b`, not the compressed width the cache holds).
    pub fn n_embd_attn_out(&self) -> usize {
        self.n_head * self.mla.as_ref().map_or(self.head_dim_v, |m| m.v_head)
    }

    /// The sliding window of layer `il`, if it has one.
    pub fn window(&self, il: usize) -> Option<usize> {
        if self.swa_layers[il] { self.sliding_window } else { None }
    }

    /// The attention of layer `il` over a batch of `n_tok` rows.
    pub fn attn_shape(&self, il: usize, n_tok: usize) -> crate::backend::AttnShape {
        crate::backend::AttnShape {
            n_tok,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            hdk: self.head_dim_k,
            hdv: self.head_dim_v,
            window: self.window(il),
            scale: self.attn_scale,
        }
    }

    pub fn rope_base_of(&self, il: usize) -> f32 {
        if self.swa_layers[il] {
            self.rope_base_swa
        } else {
            self.rope_base
        }
    }

    /// KV bytes per token at f32, over `n_layers` layers.
    pub fn kv_bytes_per_token(&self, n_layers: usize) -> usize {
        n_layers * (self.n_embd_k() + self.n_embd_v()) * 4
    }
}

impl fmt::Display for Hparams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "architecture:     {}", self.arch.name())?;
        writeln!(f, "layers:           {}", self.n_layer)?;
        if self.n_layer_nextn > 0 {
            writeln!(
                f,
                "NextN/MTP layers: {} (stored after the others; not run, as in llama.cpp's decoder)",
                self.n_layer_nextn
            )?;
        }
        writeln!(f, "embedding:        {}", self.n_embd)?;
        match &self.moe {
            None => writeln!(f, "feed-forward:     {}", self.n_ff)?,
            Some(m) => {
                let r = &m.routing;
                let mut how = format!("{:?} routing", r.gating);
                if r.normalise {
                    how += ", weights renormalised";
                }
                if r.scale != 1.0 {
                    how += &format!(", scaled by {}", r.scale);
                }
                if r.grouped() {
                    how += &format!(", {} of {} groups", r.n_group_used, r.n_group);
                }
                if r.n_shared > 0 {
                    how += &format!(", {} shared", r.n_shared);
                }
                writeln!(
                    f,
                    "experts:          {} of {}, feed-forward {} each, {how}",
                    m.n_expert_used, m.n_expert, m.n_ff_exp
                )?;
                if m.n_dense_lead > 0 {
                    writeln!(f, "dense layers:     0..{}, feed-forward {}", m.n_dense_lead, self.n_ff)?;
                }
            }
        }
        writeln!(f, "heads (q/kv):     {}/{}", self.n_head, self.n_head_kv)?;
        writeln!(f, "head size (k/v):  {}/{}", self.head_dim_k, self.head_dim_v)?;
        if let Some(m) = &self.mla {
            writeln!(
                f,
                "latent attention: {} layout, kv_lora_rank {}, q_lora_rank {}, heads of {}/{} ({} unrotated){}",
                if m.absorbed { "absorbed" } else { "attn_kv_b" },
                m.kv_lora_rank,
                m.q_lora_rank,
                m.q_head(self.n_rot),
                m.v_head,
                m.n_nope,
                if m.absorbed {
                    " through a one-head cache of the compressed vector"
                } else {
                    ""
                }
            )?;
        }
        writeln!(f, "vocabulary:       {}", self.n_vocab)?;
        writeln!(f, "training context: {}", self.n_ctx_train)?;
        writeln!(f, "rms epsilon:      {:e}", self.rms_eps)?;
        writeln!(
            f,
            "rope:             {:?}, {} dims, base {}{}",
            self.rope_type,
            self.n_rot,
            self.rope_base,
            if self.sliding_window.is_some() {
                format!(" (local layers {})", self.rope_base_swa)
            } else {
                String::new()
            }
        )?;
        writeln!(f, "rope scaling:     {}", self.rope_scaling_label())?;
        if let Some(w) = self.sliding_window {
            let n_local = self.swa_layers.iter().filter(|&&s| s).count();
            writeln!(
                f,
                "sliding window:   {w} ({n_local} local layers, {} global)",
                self.n_layer - n_local
            )?;
        }
        write!(f, "attention scale:  {}", self.attn_scale)
    }
}

/// The mixture of experts, checked, as llama.cpp reads it for the architecture:
/// - `qwen3moe` routes with a softmax over all experts and renormalises the top-k weights, with no scale, bias or
///   shared expert, whatever the keys say (llama.cpp's graph fixes them): a key saying otherwise is refused.
/// - `dots1` reads the gating function (required: llama.cpp aborts without one), renormalisation (default off), the
///   weights scale (0, the default, means none), the shared expert count and the leading dense layers; the selection
///   bias is an optional per-layer tensor.
/// - `glm4moe` reads the same keys as dots1, but its gating function defaults to sigmoid (as llama.cpp's); its
///   selection bias is a required tensor (checked at load).
/// - `deepseek2` reads the same keys as dots1, but its gating function defaults to softmax (sigmoid for GLM 4.7
///   Lite, as llama.cpp's); the selection bias is optional.
/// - Expert groups are read for all, as llama.cpp's `build_moe_ffn` applies them for any architecture.
///
/// What Baton does not compute (another gating function, a group layout llama.cpp asserts against) is a load error
/// naming the key, not ignored.
fn moe_hparams(g: &GgufFile, arch: Arch, n_layer: usize, n_ff: usize, key: &dyn Fn(&str) -> String) -> Result<Moe> {
    let opt = |k: &str| -> Result<Option<usize>> {
        let k = key(k);
        let Some(v) = g.get(&k) else { return Ok(None) };
        let n = g.get_u64(&k).with_context(|| format!("{k} is {v:?}, not an integer"))?;
        Ok(Some(
            usize::try_from(n).with_context(|| format!("{k} = {n} is too large"))?,
        ))
    };
    let req = |k: &str| -> Result<usize> { opt(k)?.with_context(|| format!("missing {}", key(k))) };
    let n_expert = req("expert_count")?;
    let n_expert_used = req("expert_used_count")?;
    let n_ff_exp = req("expert_feed_forward_length")?;
    if n_expert == 0 || n_expert > 4096 {
        bail!("{} is {n_expert}; expected 1 to 4096", key("expert_count"));
    }
    if n_expert_used == 0 || n_expert_used > n_expert {
        bail!(
            "{} is {n_expert_used}; expected 1 to expert_count ({n_expert})",
            key("expert_used_count")
        );
    }
    if n_ff_exp == 0 {
        bail!("{} is 0", key("expert_feed_forward_length"));
    }

    // llama.cpp's enum: 1 softmax, 2 sigmoid (3 softmax of the chosen weights, 4 sqrt-softplus: not implemented).
    let k = key("expert_gating_func");
    let gating = match (g.get(&k), g.get_u64(&k)) {
        (None, _) => None,
        (_, Some(1)) => Some(Gating::Softmax),
        (_, Some(2)) => Some(Gating::Sigmoid),
        (Some(v), _) => bail!("{k} is {v:?}, not a gating function Baton implements (1 softmax, 2 sigmoid)"),
    };
    let k = key("expert_weights_norm");
    let normalise = match g.get(&k) {
        None => None,
        Some(v) => Some(g.get_bool(&k).with_context(|| format!("{k} is {v:?}, not a bool"))?),
    };
    let k = key("expert_weights_scale");
    let scale = match g.get(&k) {
        None => None,
        Some(v) => {
            let s = g.get_f32(&k).with_context(|| format!("{k} is {v:?}, not a number"))?;
            if !s.is_finite() {
                bail!("{k} is {s}, not a finite number");
            }
            Some(s)
        }
    };
    let n_shared = opt("expert_shared_count")?;
    let n_group = opt("expert_group_count")?.unwrap_or(0);
    let n_group_used = opt("expert_group_used_count")?.unwrap_or(0);
    let n_dense_lead = opt("leading_dense_block_count")?.unwrap_or(0);

    let routing = match arch {
        Arch::Qwen3Moe => {
            // llama.cpp's qwen3moe graph ignores these keys; a file whose keys say otherwise is ambiguous.
            if let Some(gf) = gating.filter(|&gf| gf != Gating::Softmax) {
                bail!(
                    "{} is {gf:?}, but qwen3moe routes with a softmax (as llama.cpp does regardless)",
                    key("expert_gating_func")
                );
            }
            if normalise == Some(false) {
                bail!(
                    "{} is false, but qwen3moe renormalises its experts' weights (as llama.cpp does regardless)",
                    key("expert_weights_norm")
                );
            }
            if let Some(s) = scale.filter(|&s| s != 1.0 && s != 0.0) {
                bail!(
                    "{} is {s}, but llama.cpp's qwen3moe applies no scale to its experts' weights",
                    key("expert_weights_scale")
                );
            }
            if let Some(n) = n_shared.filter(|&n| n != 0) {
                bail!(
                    "{} is {n}, but qwen3moe has no shared experts (llama.cpp's qwen3moe would ignore them)",
                    key("expert_shared_count")
                );
            }
            if n_dense_lead != 0 {
                bail!(
                    "{} is {n_dense_lead}, but every qwen3moe layer has experts",
                    key("leading_dense_block_count")
                );
            }
            Routing {
                gating: Gating::Softmax,
                normalise: true,
                scale: 1.0,
                n_shared: 0,
                n_group,
                n_group_used,
            }
        }
        Arch::Dots1 | Arch::Glm4Moe | Arch::Deepseek2 => {
            let name = arch.name();
            let gating = match (gating, arch) {
                (Some(gf), _) => gf,
                // llama.cpp's glm4moe defaults to sigmoid; its dots1 aborts without the key.
                (None, Arch::Glm4Moe) => Gating::Sigmoid,
                // llama.cpp's deepseek2: softmax for the DeepSeek V2/V2.5 files that lack the key, sigmoid for GLM
                // 4.7 Lite (47 or 48 layers and a vocabulary of 154880).
                (None, Arch::Deepseek2) => {
                    let n_vocab = g.tensor_info("token_embd.weight")?.n_rows();
                    if matches!(n_layer, 47 | 48) && n_vocab == 154880 {
                        Gating::Sigmoid
                    } else {
                        Gating::Softmax
                    }
                }
                (None, _) => bail!("missing {}: dots1 names its gating function", key("expert_gating_func")),
            };
            let n_shared = n_shared.with_context(|| format!("missing {}", key("expert_shared_count")))?;
            if n_shared == 0 {
                bail!("{} is 0, but {name} has a shared expert", key("expert_shared_count"));
            }
            if n_dense_lead > n_layer {
                bail!(
                    "{} is {n_dense_lead}, more than the {n_layer} layers",
                    key("leading_dense_block_count")
                );
            }
            if n_dense_lead > 0 && n_ff == 0 {
                bail!(
                    "{} is {n_dense_lead}, but {} is missing or 0",
                    key("leading_dense_block_count"),
                    key("feed_forward_length")
                );
            }
            Routing {
                gating,
                normalise: normalise.unwrap_or(false),
                // As llama.cpp: 0 (the default) and 1 both mean no scale.
                scale: scale.filter(|&s| s != 0.0).unwrap_or(1.0),
                n_shared,
                n_group,
                n_group_used,
            }
        }
        other => bail!("{} has no mixture of experts", other.name()),
    };
    let n_shared = routing.n_shared;
    if n_shared > 0 && n_ff_exp.checked_mul(n_shared).is_none_or(|w| w > 1 << 24) {
        bail!("{n_shared} shared experts of width {n_ff_exp} are implausibly wide");
    }
    if routing.grouped() {
        // llama.cpp asserts these; each group's score is the sum of its best two experts, and the top k must be
        // found among the kept groups.
        let (ng, nu) = (n_group, n_group_used);
        let per = n_expert / ng;
        if ng >= n_expert || !n_expert.is_multiple_of(ng) || per < 2 || ng > 64 {
            bail!(
                "{} is {ng}: expected a divisor of expert_count ({n_expert}) of at most 64 leaving at least two \
                 experts per group",
                key("expert_group_count")
            );
        }
        if nu == 0 || nu >= ng || nu * per < n_expert_used {
            bail!(
                "{} is {nu}: expected 1 to {} groups holding at least expert_used_count ({n_expert_used}) experts",
                key("expert_group_used_count"),
                ng - 1
            );
        }
    }
    Ok(Moe {
        n_expert,
        n_expert_used,
        n_ff_exp,
        n_dense_lead,
        routing,
    })
}

/// DeepSeek's MLA shape (`deepseek2`), in either layout ([`Mla`]), checked against what llama.cpp's graph computes;
/// sets the attention scale (llama.cpp's kq_scale, with YaRN's mscale). What Baton does not compute (temperature
/// tuning, grouped KV heads without the absorption) is a load error naming the key.
fn mla_hparams(g: &GgufFile, hp: &mut Hparams, key: &dyn Fn(&str) -> String) -> Result<Mla> {
    let opt = |k: &str| g.get_u64(&key(k)).map(|v| v as usize);
    if let Some(v) = g.get(&key("attention.temperature_scale"))
        && g.get_f32(&key("attention.temperature_scale")) != Some(0.0)
    {
        bail!(
            "{} is {v:?}: attention temperature tuning is not implemented",
            key("attention.temperature_scale")
        );
    }
    // As llama.cpp: its DeepSeek-V2-Lite-like files (27 or 26 layers, or 48 with a vocabulary of 128256) have no
    // `q_lora_rank`; the others must.
    let n_vocab = hp.n_vocab;
    let lite = matches!(hp.n_layer, 26 | 27) || (hp.n_layer == 48 && n_vocab == 128256);
    let q_lora_rank = match opt("attention.q_lora_rank") {
        Some(r) => r,
        None if lite => 0,
        None => bail!("missing {}", key("attention.q_lora_rank")),
    };
    let kv_lora_rank =
        opt("attention.kv_lora_rank").with_context(|| format!("missing {}", key("attention.kv_lora_rank")))?;
    if kv_lora_rank == 0 || kv_lora_rank > 1 << 24 {
        bail!(
            "{} is {kv_lora_rank}: expected 1 to 2^24",
            key("attention.kv_lora_rank")
        );
    }
    if q_lora_rank > 1 << 24 {
        bail!(
            "{} is {q_lora_rank}: expected at most 2^24",
            key("attention.q_lora_rank")
        );
    }
    // The absorbed layout names each head's sizes in the *_mla keys (llama.cpp's is_mla: both set and non-zero).
    let (k_mla, v_mla) = (opt("attention.key_length_mla"), opt("attention.value_length_mla"));
    let absorbed = match (k_mla, v_mla) {
        (None | Some(0), None | Some(0)) => None,
        (Some(k), Some(v)) if k > 0 && v > 0 && k <= 1 << 16 && v <= 1 << 16 => Some((k, v)),
        _ => bail!(
            "{} is {k_mla:?} and {} is {v_mla:?}: the absorbed MLA layout needs both, each 1 to 65536",
            key("attention.key_length_mla"),
            key("attention.value_length_mla")
        ),
    };
    let (q_head, v_head) = match absorbed {
        Some((k, v)) => {
            // One KV head: [compressed vector | RoPE key] as K, the compressed vector as V.
            let want = (1, kv_lora_rank + hp.n_rot, kv_lora_rank);
            if (hp.n_head_kv, hp.head_dim_k, hp.head_dim_v) != want {
                bail!(
                    "deepseek2 in the absorbed MLA layout caches one KV head of K {} (kv_lora_rank + rope dims) and V \
                     {kv_lora_rank}, but this file says {} KV heads of K {} and V {}",
                    want.1,
                    hp.n_head_kv,
                    hp.head_dim_k,
                    hp.head_dim_v
                );
            }
            (k, v)
        }
        None => {
            if hp.n_head_kv != hp.n_head {
                bail!(
                    "deepseek2 without the absorbed MLA layout has one KV head per query head, but this file says {} \
                     and {}",
                    hp.n_head_kv,
                    hp.n_head
                );
            }
            (hp.head_dim_k, hp.head_dim_v)
        }
    };
    if hp.n_rot >= q_head {
        bail!(
            "rope dimension count {} leaves no unrotated part of the {q_head}-wide K head (llama.cpp asserts one)",
            hp.n_rot,
        );
    }
    // llama.cpp's kq_scale: 1/sqrt of each head's K width, times the square of YaRN's mscale (DeepSeek's
    // mscale_all_dim), from the attention factor before ggml's RoPE correction (it is applied whatever the scaling
    // type, as there).
    let r = &hp.rope_scaling;
    let ln_f = (1.0 / r.freq_scale).ln();
    let attn_factor_org = r.attn_factor * (1.0 + 0.1 * ln_f);
    let mscale = attn_factor_org * (1.0 + 0.1 * r.yarn_log_mul * ln_f);
    hp.attn_scale = mscale * mscale / (q_head as f32).sqrt();
    Ok(Mla {
        q_lora_rank,
        kv_lora_rank,
        n_nope: q_head - hp.n_rot,
        v_head,
        absorbed: absorbed.is_some(),
    })
}

/// RoPE's scaling from `<arch>.rope.scaling.*`, as llama.cpp reads and combines it (its `llama_context`):
/// - `rope.scaling.factor` (or the older `rope.scale_linear`) f scales angles by 1/f, for type `linear` (the default)
///   or `yarn`; type `none` ignores it. 0 means none.
/// - `rope.scaling.attn_factor` multiplies every cosine and sine.
/// - YaRN adds its ramp over `rope.scaling.original_context_length` (the training context without it) and its
///   magnitude correction; DeepSeek's `rope.scaling.yarn_log_multiplier` (its `mscale_all_dim` / 10) changes that
///   correction and its attention scale ([`mla_hparams`]).
///
/// LongRoPE and other types change the math in ways Baton does not implement: a load error. YaRN's beta keys, which
/// llama.cpp reads for other architectures only, are ignored as it ignores them, with a warning.
fn rope_scaling(g: &GgufFile, arch: Arch, n_ctx_train: usize, key: &dyn Fn(&str) -> String) -> Result<RopeScaling> {
    #[derive(PartialEq)]
    enum Ty {
        None,
        Linear,
        Yarn,
    }
    let ty_key = key("rope.scaling.type");
    let ty = match g.get(&ty_key) {
        None => Ty::Linear,
        Some(_) => match g.get_str(&ty_key) {
            Some("none") => Ty::None,
            Some("linear") => Ty::Linear,
            Some("yarn") => Ty::Yarn,
            Some(other) => bail!(
                "{ty_key} is {other:?}: Baton implements RoPE scaling types none, linear and yarn, so this model \
                 would give wrong output"
            ),
            None => bail!("{ty_key} is not a string"),
        },
    };
    let num = |k: &str| -> Result<Option<f32>> {
        let Some(v) = g.get(k) else { return Ok(None) };
        let x = g.get_f32(k).with_context(|| format!("{k} is {v:?}, not a number"))?;
        if !x.is_finite() {
            bail!("{k} is {x}, not a finite number");
        }
        Ok(Some(x))
    };
    let mut factor = None;
    for k in [key("rope.scaling.factor"), key("rope.scale_linear")] {
        if let Some(f) = num(&k)? {
            if f < 0.0 {
                bail!("{k} is {f}, not a non-negative number");
            }
            factor = Some(f);
            break;
        }
    }
    // As llama.cpp: a factor of 0 means none, and type none never scales.
    let freq_scale = match factor {
        Some(f) if f != 0.0 && ty != Ty::None => 1.0 / f,
        _ => 1.0,
    };
    let attn_key = key("rope.scaling.attn_factor");
    let rope_attn_factor = num(&attn_key)?.unwrap_or(1.0);
    if rope_attn_factor <= 0.0 {
        bail!("{attn_key} is {rope_attn_factor}, not a positive number");
    }
    let log_key = key("rope.scaling.yarn_log_multiplier");
    let yarn_log_mul = match num(&log_key)? {
        // llama.cpp's deepseek2 cancels the converter's factor of 0.1; its other graphs Baton runs do not read it.
        Some(m) if arch == Arch::Deepseek2 => m / 0.1,
        Some(m) => {
            tracing::warn!(
                "{log_key} = {m} is ignored for {}, as llama.cpp ignores it",
                arch.name()
            );
            0.0
        }
        None => 0.0,
    };
    for k in [
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_ext_factor",
        "yarn_attn_factor",
    ] {
        let k = key(&format!("rope.scaling.{k}"));
        if g.get(&k).is_some() {
            tracing::warn!("{k} is ignored for {}, as llama.cpp ignores it", arch.name());
        }
    }
    if ty != Ty::Yarn {
        return Ok(RopeScaling {
            freq_scale,
            yarn: None,
            attn_factor: rope_attn_factor,
            yarn_log_mul,
        });
    }
    let orig_key = key("rope.scaling.original_context_length");
    let orig_ctx = match g.get(&orig_key) {
        None => n_ctx_train,
        Some(v) => match g.get_u64(&orig_key) {
            Some(n) if n > 0 && n <= 1 << 32 => n as usize,
            _ => bail!("{orig_key} is {v:?}: expected a context length of 1 to 2^32"),
        },
    };
    // llama.cpp's yarn_attn_factor: YaRN's mscale for the factor (DeepSeek's with its own mscale and mscale_all_dim,
    // taken equal where mscale_all_dim is not 1, as llama.cpp does), over the correction ggml's RoPE multiplies in.
    let f = 1.0 / freq_scale;
    let get_mscale = |scale: f32, m: f32| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let mut yarn_factor = if yarn_log_mul != 0.0 {
        let m = if arch == Arch::Deepseek2 && yarn_log_mul != 1.0 {
            yarn_log_mul
        } else {
            1.0
        };
        get_mscale(f, m) / get_mscale(f, yarn_log_mul)
    } else {
        get_mscale(f, 1.0)
    };
    yarn_factor *= 1.0 / (1.0 + 0.1 * f.ln());
    Ok(RopeScaling {
        freq_scale,
        yarn: Some(Yarn {
            orig_ctx,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        attn_factor: yarn_factor * rope_attn_factor,
        yarn_log_mul,
    })
}

/// The `rope_freqs.weight` tensor (Llama 3.1+), checked: one positive finite factor per rotated pair.
fn rope_freqs(g: &GgufFile, n_rot: usize) -> Result<Option<Vec<f32>>> {
    let name = "rope_freqs.weight";
    if !g.tensors.contains_key(name) {
        return Ok(None);
    }
    let info = g.tensor_info(name)?;
    if info.ty != crate::gguf::GgmlType::F32 {
        bail!("{name} is {}, expected F32 (as llama.cpp writes it)", info.ty);
    }
    let f: Vec<f32> = g
        .tensor_data(info)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if f.len() != n_rot / 2 {
        bail!(
            "{name} has {} factors, expected one per rotated pair ({})",
            f.len(),
            n_rot / 2
        );
    }
    if let Some(bad) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        bail!("{name} holds {bad}, not a positive frequency factor");
    }
    Ok(Some(f))
}
