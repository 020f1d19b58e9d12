//! Random-weight GGUF models of the real architectures, for tests and for scale benchmarks of shapes the two small
//! models don't have. The vocabulary (and chat template) is copied from a real model so the tokenizer is real.

use super::Arch;
use crate::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::Path;

#[derive(Clone, Debug)]
pub struct RandomSpec {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Storage type of the block matrices (F32 or F16; norms are always F32).
    pub ty: GgmlType,
    /// Experts, experts used per token and their width (`qwen3moe`; ignored by dense architectures).
    pub experts: (usize, usize, usize),
    pub seed: u64,
}

impl RandomSpec {
    pub fn tiny(arch: Arch) -> RandomSpec {
        RandomSpec {
            arch,
            n_layer: 4,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            ty: GgmlType::F32,
            experts: (8, 2, 32),
            seed: 1,
        }
    }
}

fn encode(values: &[f32], ty: GgmlType) -> Result<Vec<u8>> {
    Ok(match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        other => bail!("random models are written as F32 or F16, not {other}"),
    })
}

/// Writes a random model with `spec`'s shape and `vocab_from`'s tokenizer to `path`.
pub fn write_random_model(vocab_from: &GgufFile, spec: &RandomSpec, path: &Path) -> Result<()> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let mut w = GgufWriter::new();
    let arch = spec.arch.name();
    let n_vocab = vocab_from.tensor_info("token_embd.weight")?.n_rows();
    w.meta("general.architecture", Value::Str(arch.into()));
    w.meta(
        "general.name",
        Value::Str(format!("random {arch} {}x{}", spec.n_layer, spec.n_embd)),
    );
    let k = |s: &str| format!("{arch}.{s}");
    w.meta(&k("block_count"), Value::U32(spec.n_layer as u32));
    w.meta(&k("context_length"), Value::U32(8192));
    w.meta(&k("embedding_length"), Value::U32(spec.n_embd as u32));
    w.meta(&k("feed_forward_length"), Value::U32(spec.n_ff as u32));
    w.meta(&k("attention.head_count"), Value::U32(spec.n_head as u32));
    w.meta(&k("attention.head_count_kv"), Value::U32(spec.n_head_kv as u32));
    w.meta(&k("attention.key_length"), Value::U32(spec.head_dim as u32));
    w.meta(&k("attention.value_length"), Value::U32(spec.head_dim as u32));
    w.meta(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    w.meta(&k("rope.freq_base"), Value::F32(10000.0));
    if spec.arch == Arch::Gemma3 {
        w.meta(&k("attention.sliding_window"), Value::U32(16));
    }
    let moe = spec.arch == Arch::Qwen3Moe;
    let (n_x, n_used, n_ff_exp) = spec.experts;
    if moe {
        w.meta(&k("expert_count"), Value::U32(n_x as u32));
        w.meta(&k("expert_used_count"), Value::U32(n_used as u32));
        w.meta(&k("expert_feed_forward_length"), Value::U32(n_ff_exp as u32));
    }
    for (key, v) in &vocab_from.metadata {
        if key.starts_with("tokenizer.") {
            w.meta(key, vocab_from.owned_value(v)?);
        }
    }

    let mut mat = |rows: usize, cols: usize, ty: GgmlType| -> Result<(Vec<u64>, GgmlType, Vec<u8>)> {
        let scale = 1.0 / (cols as f32).sqrt();
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| rng.gen_range(-1.0f32..1.0) * scale * 1.7)
            .collect();
        Ok((vec![cols as u64, rows as u64], ty, encode(&v, ty)?))
    };
    let norm = |n: usize| {
        (
            vec![n as u64],
            GgmlType::F32,
            encode(&vec![1.0; n], GgmlType::F32).unwrap(),
        )
    };

    let e = spec.n_embd;
    let (q, kv) = (spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim);
    let mut tensors = vec![("token_embd.weight".to_string(), mat(n_vocab, e, spec.ty)?)];
    tensors.push(("output_norm.weight".into(), norm(e)));
    for il in 0..spec.n_layer {
        let p = |t: &str| format!("blk.{il}.{t}.weight");
        tensors.push((p("attn_norm"), norm(e)));
        tensors.push((p("attn_q"), mat(q, e, spec.ty)?));
        tensors.push((p("attn_k"), mat(kv, e, spec.ty)?));
        tensors.push((p("attn_v"), mat(kv, e, spec.ty)?));
        tensors.push((p("attn_output"), mat(e, q, spec.ty)?));
        tensors.push((p("ffn_norm"), norm(e)));
        if moe {
            // The router scaled up (logits of spread ~4) so that a token's experts are clear choices.
            let (dims, ty, data) = mat(n_x, e, GgmlType::F32)?;
            let data = data
                .chunks_exact(4)
                .flat_map(|b| (4.0 * f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes())
                .collect();
            tensors.push((p("ffn_gate_inp"), (dims, ty, data)));
            // A 3-D tensor is its experts' matrices one after another.
            for (t, rows, cols) in [
                ("ffn_gate_exps", n_ff_exp, e),
                ("ffn_up_exps", n_ff_exp, e),
                ("ffn_down_exps", e, n_ff_exp),
            ] {
                let (_, ty, data) = mat(n_x * rows, cols, spec.ty)?;
                tensors.push((p(t), (vec![cols as u64, rows as u64, n_x as u64], ty, data)));
            }
        } else {
            tensors.push((p("ffn_gate"), mat(spec.n_ff, e, spec.ty)?));
            tensors.push((p("ffn_up"), mat(spec.n_ff, e, spec.ty)?));
            tensors.push((p("ffn_down"), mat(e, spec.n_ff, spec.ty)?));
        }
        if matches!(spec.arch, Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe) {
            tensors.push((p("attn_q_norm"), norm(spec.head_dim)));
            tensors.push((p("attn_k_norm"), norm(spec.head_dim)));
        }
        if spec.arch == Arch::Gemma3 {
            tensors.push((p("post_attention_norm"), norm(e)));
            tensors.push((p("post_ffw_norm"), norm(e)));
        }
        if spec.arch == Arch::Qwen2 {
            for (t, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                let (_, ty, data) = mat(1, n, GgmlType::F32)?;
                tensors.push((format!("blk.{il}.{t}.bias"), (vec![n as u64], ty, data)));
            }
        }
    }
    for (name, (dims, ty, data)) in tensors {
        w.tensor(&name, dims, ty, data);
    }
    w.write(path)
}
