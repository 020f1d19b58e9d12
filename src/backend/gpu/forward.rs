//! A whole forward pass on the GPU, weights and KV cache resident: the proof that the op set composes into the
//! architectures' layers (llama and gemma3, the same scripts as `model/llama.rs` and `model/gemma3.rs`), checked
//! token for token against the CPU session. Not yet behind the `Backend` trait or `--backend` (docs/gpu.md).
//!
//! Only the embedding lookup runs on the host (a row per token, uploaded); everything after it, up to the logits of
//! the batch's last row, is one submission.

use super::buffers::{GpuMatrix, Halves, Tensor};
use super::rope::GpuRope;
use super::{Gpu, u32_of};
use crate::backend::AttnShape;
use crate::kernels::ops::RopeTable;
use crate::kernels::{Glu, Matrix};
use crate::model::{Arch, Hparams, Model, RopeType};
use anyhow::{Result, bail, ensure};

/// One block's weights on the device.
struct Layer {
    attn_norm: Tensor,
    wq: GpuMatrix,
    wk: GpuMatrix,
    wv: GpuMatrix,
    wo: GpuMatrix,
    ffn_norm: Tensor,
    gate: GpuMatrix,
    up: GpuMatrix,
    down: GpuMatrix,
    /// Gemma 3's per-head Q/K norms and post-attention / post-feed-forward norms.
    gemma: Option<[Tensor; 4]>,
    k: Halves,
    v: Halves,
}

/// A whole model on the device, with its KV cache and working buffers for batches of up to `n_batch` rows.
pub struct GpuModel<'g> {
    gpu: &'g Gpu,
    hp: Hparams,
    layers: Vec<Layer>,
    output_norm: Tensor,
    output: GpuMatrix,
    /// The token embedding, read on the host one row per token.
    embd: Matrix,
    /// One table per RoPE base, and which one each layer uses.
    ropes: Vec<GpuRope>,
    rope_of: Vec<usize>,
    n_ctx: usize,
    n_batch: usize,
    n_past: usize,
    x: Tensor,
    xn: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    att: Tensor,
    h: Tensor,
    last: Tensor,
    logits: Tensor,
}

impl<'g> GpuModel<'g> {
    /// Uploads every layer of `model` (which must hold all of them) for a context of `n_ctx` positions. The
    /// matrices are read from the file as stored: the CPU's copies may have been repacked for its kernels.
    pub fn upload(gpu: &'g Gpu, model: &Model, n_ctx: usize, n_batch: usize) -> Result<GpuModel<'g>> {
        let hp = model.hp.clone();
        ensure!(
            model.range == (0..hp.n_layer),
            "the GPU forward takes the whole model, not layers {:?}",
            model.range
        );
        ensure!(n_ctx > 0 && n_batch > 0, "a GPU model needs a context and a batch");
        // The GPU forward mirrors llama and gemma3 with plain RoPE; anything else would compute the wrong thing.
        let biases = model
            .layers
            .iter()
            .any(|l| l.bq.is_some() || l.bk.is_some() || l.bv.is_some());
        ensure!(
            matches!(hp.arch, Arch::Llama | Arch::Gemma3)
                && hp.rope_freqs.is_none()
                && hp.rope_freq_scale == 1.0
                && !biases,
            "the GPU forward implements llama and gemma3 without RoPE scaling or Q/K/V biases, not this {} model \
             (rope scaling: {}, biases: {biases})",
            hp.arch.name(),
            hp.rope_scaling_label()
        );
        let f = &model.file;
        let mapped = |name: &str| -> Result<Matrix> { Matrix::mapped(f, f.tensor_info(name)?) };
        let matrix = |name: &str| -> Result<GpuMatrix> { gpu.upload_matrix(&mapped(name)?) };
        let vector = |name: &str| -> Result<Tensor> { gpu.upload(&mapped(name)?.to_f32()) };
        let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
        let mut layers = Vec::with_capacity(hp.n_layer);
        for il in 0..hp.n_layer {
            let p = |t: &str| format!("blk.{il}.{t}.weight");
            let gemma = match hp.arch {
                Arch::Gemma3 => Some([
                    vector(&p("attn_q_norm"))?,
                    vector(&p("attn_k_norm"))?,
                    vector(&p("post_attention_norm"))?,
                    vector(&p("post_ffw_norm"))?,
                ]),
                _ => None,
            };
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm"))?,
                wq: matrix(&p("attn_q"))?,
                wk: matrix(&p("attn_k"))?,
                wv: matrix(&p("attn_v"))?,
                wo: matrix(&p("attn_output"))?,
                ffn_norm: vector(&p("ffn_norm"))?,
                gate: matrix(&p("ffn_gate"))?,
                up: matrix(&p("ffn_up"))?,
                down: matrix(&p("ffn_down"))?,
                gemma,
                k: gpu.zero_halves(hp.n_head_kv * n_ctx * hdk)?,
                v: gpu.zero_halves(hp.n_head_kv * n_ctx * hdv)?,
            });
        }
        let head = if f.tensors.contains_key("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let mut bases: Vec<f32> = Vec::new();
        let rope_of = (0..hp.n_layer)
            .map(|il| {
                let b = hp.rope_base_of(il);
                bases.iter().position(|&x| x == b).unwrap_or_else(|| {
                    bases.push(b);
                    bases.len() - 1
                })
            })
            .collect();
        let ropes = bases
            .iter()
            .map(|&b| gpu.upload_rope(&RopeTable::new(b, hp.n_rot, n_ctx)))
            .collect::<Result<_>>()?;
        let n = n_batch;
        Ok(GpuModel {
            gpu,
            layers,
            output_norm: vector("output_norm.weight")?,
            output: matrix(head)?,
            embd: mapped("token_embd.weight")?,
            ropes,
            rope_of,
            n_ctx,
            n_batch,
            n_past: 0,
            x: gpu.zeros(n * hp.n_embd)?,
            xn: gpu.zeros(n * hp.n_embd)?,
            q: gpu.zeros(n * hp.n_head * hdk)?,
            k: gpu.zeros(n * hp.n_head_kv * hdk)?,
            v: gpu.zeros(n * hp.n_head_kv * hdv)?,
            att: gpu.zeros(n * hp.n_head * hdv)?,
            h: gpu.zeros(n * hp.n_ff)?,
            last: gpu.zeros(hp.n_embd)?,
            logits: gpu.zeros(hp.n_vocab)?,
            hp,
        })
    }

    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Runs `tokens` at positions `n_past()..` and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let hp = &self.hp;
        let (n, e) = (tokens.len(), hp.n_embd);
        ensure!(
            n > 0 && n <= self.n_batch,
            "a batch of {n} tokens (at most {})",
            self.n_batch
        );
        ensure!(
            self.n_past + n <= self.n_ctx,
            "context full: {} + {n} positions exceed {}",
            self.n_past,
            self.n_ctx
        );
        let mut x = vec![0.0; n * e];
        for (row, &id) in x.chunks_exact_mut(e).zip(tokens) {
            if id as usize >= hp.n_vocab {
                bail!("token id {id} is outside the vocabulary of {}", hp.n_vocab);
            }
            self.embd.dequantize_row_into(id as usize, row);
            if hp.embd_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= hp.embd_scale);
            }
        }
        self.gpu.write(&self.x, &x)?;
        let positions: Vec<u32> = (self.n_past..self.n_past + n)
            .map(|p| u32_of(p, "position"))
            .collect::<Result<_>>()?;
        let pos = self.gpu.upload_u32(&positions)?;
        let neox = hp.rope_type == RopeType::Neox;
        let (hdk, hdv) = (hp.head_dim_k, hp.head_dim_v);
        let glu = match hp.arch {
            Arch::Gemma3 => Glu::Gelu,
            _ => Glu::Silu,
        };

        let mut pass = self.gpu.pass();
        for (il, l) in self.layers.iter().enumerate() {
            let rope = &self.ropes[self.rope_of[il]];
            pass.rms_norm(&self.x, &l.attn_norm, hp.rms_eps, n, &self.xn)?;
            pass.matmul(&l.wq, &self.xn, n, &self.q)?;
            pass.matmul(&l.wk, &self.xn, n, &self.k)?;
            pass.matmul(&l.wv, &self.xn, n, &self.v)?;
            if let Some([qn, kn, _, _]) = &l.gemma {
                pass.rms_norm_inplace(&self.q, qn, hp.rms_eps, n * hp.n_head)?;
                pass.rms_norm_inplace(&self.k, kn, hp.rms_eps, n * hp.n_head_kv)?;
            }
            pass.rope(rope, &self.q, n, hp.n_head, hdk, &pos, neox)?;
            pass.rope(rope, &self.k, n, hp.n_head_kv, hdk, &pos, neox)?;
            pass.kv_store(&self.k, n, hp.n_head_kv, hdk, &l.k, self.n_ctx, &pos)?;
            pass.kv_store(&self.v, n, hp.n_head_kv, hdv, &l.v, self.n_ctx, &pos)?;
            let shape = AttnShape {
                n_tok: n,
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                hdk,
                hdv,
                window: hp.window(il),
                scale: hp.attn_scale,
            };
            pass.attend(&shape, &self.q, &l.k, &l.v, self.n_ctx, &pos, &self.att)?;
            pass.matmul(&l.wo, &self.att, n, &self.xn)?;
            if let Some([_, _, post_attn, _]) = &l.gemma {
                pass.rms_norm_inplace(&self.xn, post_attn, hp.rms_eps, n)?;
            }
            pass.add(&self.x, &self.xn, n * e)?;

            pass.rms_norm(&self.x, &l.ffn_norm, hp.rms_eps, n, &self.xn)?;
            pass.matmul_glu(&l.gate, &l.up, glu, &self.xn, n, &self.h)?;
            pass.matmul(&l.down, &self.h, n, &self.xn)?;
            if let Some([_, _, _, post_ffn]) = &l.gemma {
                pass.rms_norm_inplace(&self.xn, post_ffn, hp.rms_eps, n)?;
            }
            pass.add(&self.x, &self.xn, n * e)?;
        }
        pass.copy(&self.x, (n - 1) * e, &self.last, 0, e)?;
        pass.rms_norm_inplace(&self.last, &self.output_norm, hp.rms_eps, 1)?;
        pass.matmul(&self.output, &self.last, 1, &self.logits)?;
        pass.finish()?;
        self.n_past += n;
        self.gpu.read(&self.logits)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_gpu;
    use super::*;
    use crate::engine::session::{Input, Session, Want};
    use crate::kernels::ThreadPool;
    use std::sync::Arc;

    /// Index of the largest logit, and its gap to the second largest.
    fn top(logits: &[f32]) -> (u32, f32) {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        (idx[0] as u32, logits[idx[0]] - logits[idx[1]])
    }

    /// Greedy decoding of `n_new` tokens after `prompt` on the GPU and on the CPU backend: the same tokens, or a
    /// first difference where the CPU's top two logits are within 0.1 (a near-tie, which the two backends' roundings
    /// may break differently: the CPU rounds activations to 8 bits). Logits stay close all along.
    fn greedy_matches(file: &str, prompt: &[u32], n_new: usize) {
        let Some(gpu) = test_gpu() else { return };
        // A default model is fetched (or the test fails), as every test that needs one.
        let path = crate::fetch::resolve(file).unwrap_or_else(|e| panic!("model {file} unavailable: {e:#}"));
        let model = Arc::new(Model::load(&path).unwrap());
        let n_ctx = 64;
        let mut cpu = Session::new(model.clone(), Arc::new(ThreadPool::new(2)), n_ctx, 32).unwrap();
        let t = std::time::Instant::now();
        let mut gm = GpuModel::upload(gpu, &model, n_ctx, 32).unwrap();
        eprintln!("{file}: uploaded in {:.2} s", t.elapsed().as_secs_f32());

        let mut c_logits = cpu.forward(Input::Tokens(prompt), Want::LastLogits).unwrap().to_vec();
        let t = std::time::Instant::now();
        let mut g_logits = gm.forward(prompt).unwrap();
        eprintln!(
            "{file}: GPU prompt of {} in {:.2} s",
            prompt.len(),
            t.elapsed().as_secs_f32()
        );
        let t = std::time::Instant::now();
        for step in 0..n_new {
            let (ct, gap) = top(&c_logits);
            let (gt, _) = top(&g_logits);
            let scale = c_logits.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let diff = c_logits
                .iter()
                .zip(&g_logits)
                .fold(0.0f32, |a, (c, g)| a.max((c - g).abs()));
            eprintln!(
                "{file} step {step}: CPU {ct} GPU {gt}, top-2 gap {gap:.3}, max logit diff {diff:.4} of {scale:.1}"
            );
            // The CPU rounds activations to 8 bits before each matmul and the GPU does not: through the layers of
            // these small quantized models that moves the logits by up to a unit (the CPU's own ISAs differ by 0.3,
            // docs/correctness.md). This bound only catches gross faults; `tiny_models_match_cpu` is the tight check.
            assert!(
                diff <= 0.1 * scale.max(1.0),
                "{file} step {step}: logits differ by {diff}"
            );
            if ct != gt {
                assert!(
                    gap < 0.1,
                    "{file} step {step}: CPU picks {ct}, GPU {gt}, with a gap of {gap}"
                );
                eprintln!("{file}: parted at a near-tie at step {step} (gap {gap:.3})");
                return;
            }
            c_logits = cpu.forward(Input::Tokens(&[ct]), Want::LastLogits).unwrap().to_vec();
            g_logits = gm.forward(&[gt]).unwrap();
        }
        eprintln!(
            "{file}: {n_new} steps in {:.2} s, both backends",
            t.elapsed().as_secs_f32()
        );
    }

    /// Tiny random-weight F32 models of both architectures (Gemma 3's with a sliding window of 16): there the CPU
    /// multiplies f32 activations too, so the two backends differ only in summation order and `exp`, and the logits
    /// agree within 1e-3 of their scale, at a 24-token prompt (past the window) and every decode step after it.
    #[test]
    fn tiny_models_match_cpu() {
        use crate::gguf::GgufFile;
        use crate::model::random::{RandomSpec, write_random_model};
        let Some(gpu) = test_gpu() else { return };
        let base = crate::fetch::resolve("smollm2").unwrap_or_else(|e| panic!("model smollm2 unavailable: {e:#}"));
        let dir = tempfile::tempdir().unwrap();
        for arch in [Arch::Llama, Arch::Gemma3] {
            let p = dir.path().join(format!("{}.gguf", arch.name()));
            write_random_model(&GgufFile::open(&base).unwrap(), &RandomSpec::tiny(arch), &p).unwrap();
            let model = Arc::new(Model::load(&p).unwrap());
            let n_ctx = 48;
            let mut cpu = Session::new(model.clone(), Arc::new(ThreadPool::new(2)), n_ctx, 32).unwrap();
            let mut gm = GpuModel::upload(gpu, &model, n_ctx, 32).unwrap();
            let prompt: Vec<u32> = (0..24).map(|i| 100 + (i * 37) % 900).collect();
            let mut c = cpu.forward(Input::Tokens(&prompt), Want::LastLogits).unwrap().to_vec();
            let mut g = gm.forward(&prompt).unwrap();
            for step in 0..8 {
                let scale = c.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let diff = c.iter().zip(&g).fold(0.0f32, |a, (c, g)| a.max((c - g).abs()));
                eprintln!("{arch:?} step {step}: max logit diff {diff:.2e} of {scale:.2}");
                assert!(
                    diff <= 1e-3 * scale.max(1.0),
                    "{arch:?} step {step}: logits differ by {diff} (scale {scale})"
                );
                let (t, _) = top(&c);
                c = cpu.forward(Input::Tokens(&[t]), Want::LastLogits).unwrap().to_vec();
                g = gm.forward(&[t]).unwrap();
            }
        }
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
