#!/usr/bin/env python3
"""Writes the small random-weight GGUF test models of tests/models/ (one per architecture family Baton runs).

Each model has a real byte-level BPE tokenizer: SmolLM2's, cut down to its first N_VOCAB tokens (the 17 special
tokens, the 256 byte tokens and the earliest merges; a merge is kept when both its parts and its result are kept),
so the embedding table stays small. Weights are random with a fixed seed, so a rerun writes the same bytes.
llama.cpp's goldens for these files are written by scripts/gen-test-goldens.py.

    pip install -r scripts/requirements-gen-test-models.txt
    python3 scripts/gen-test-models.py [--vocab-from SmolLM2-135M-Instruct.Q4_1.gguf] [--out tests/models]
"""

import argparse
import os
import sys

import numpy as np
import gguf

N_VOCAB = 4096
SEED = 20

# One entry per model: its architecture, shape, storage type of the block matrices and what is special about it.
MODELS = {
    # Llama 3.1-style: RoPE frequency factors (rope_freqs.weight), the llama-bpe pre-tokenizer, base 500 000.
    "llama3": dict(arch="llama", pre="llama-bpe", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                   head_dim=16, rope_base=500000.0, ty="F32", rope_freqs=True),
    # Qwen 2: biases on Q, K and V, NeoX RoPE, the qwen2 pre-tokenizer; Q8_0 matrices.
    "qwen2": dict(arch="qwen2", pre="qwen2", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                  head_dim=16, rope_base=1000000.0, ty="Q8_0", qkv_bias=True),
    # Qwen 3: per-head RMSNorm of Q and K, head size 32 (not n_embd / n_head), NeoX RoPE; F16 matrices. Also linear
    # RoPE scaling (factor 4), which no other model here has.
    "qwen3": dict(arch="qwen3", pre="qwen2", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                  head_dim=32, rope_base=1000000.0, ty="F16", qk_norm=True, rope_linear=4.0),
    # Qwen 3 MoE: qwen3's attention, and a mixture of 8 experts of width 32 of which each token uses 2 (softmax
    # router, top-k weights renormalised); the experts are 3-D tensors, one per matrix per layer; F32 matrices.
    "qwen3moe": dict(arch="qwen3moe", pre="qwen2", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                     head_dim=32, rope_base=1000000.0, ty="F32", qk_norm=True, n_expert=8, n_expert_used=2,
                     n_ff_exp=32),
}


# Every i-quant in one model: a Llama (llama-bpe, no frequency factors) whose block matrices are random blocks of
# IQ2_XXS .. IQ4_XS (gguf-py cannot quantize to them), n_embd 256 so every matrix's rows are whole 256-weight blocks.
MODELS["iquants"] = dict(arch="llama", pre="llama-bpe", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                         head_dim=64, rope_base=10000.0, ty="F32",
                         types=[dict(attn_q="IQ2_XXS", attn_k="IQ2_XS", attn_v="IQ2_S", attn_output="IQ3_XXS",
                                     ffn_gate="IQ3_S", ffn_up="IQ4_NL", ffn_down="IQ4_XS"),
                                dict(attn_q="IQ1_S", attn_k="IQ4_NL", attn_v="IQ4_XS", attn_output="IQ2_S",
                                     ffn_gate="IQ2_XXS", ffn_up="IQ3_XXS", ffn_down="IQ2_XS")])


# Phi-3: Q/K/V fused into attn_qkv and gate/up into ffn_up, NeoX RoPE; a sliding window of 8 that llama.cpp ignores
# for phi3 (so must Baton: the prompts are longer than 8); F32 matrices.
MODELS["phi3"] = dict(arch="phi3", pre="llama-bpe", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                      head_dim=16, rope_base=10000.0, ty="F32", fused=True, sliding_window=8,
                      name="fused projections")

# dots.llm1: qwen3's attention without GQA (llama.cpp's dots1 sizes K and V for every head), one leading dense layer,
# then DeepSeek V3-style routing written as data: sigmoid gating, a selection bias (exp_probs_b) that only chooses,
# 16 experts in 4 groups of which the best 2 are kept (llama.cpp applies groups to any architecture), 4 experts per
# token, weights renormalised then scaled by 2.5, and 2 shared experts (one feed-forward 2 x 32 wide); F32 matrices.
MODELS["dots1"] = dict(arch="dots1", pre="qwen2", n_layer=3, n_embd=64, n_ff=128, n_head=4, n_head_kv=4,
                       head_dim=16, rope_base=1000000.0, ty="F32", qk_norm=True, n_expert=16, n_expert_used=4,
                       n_ff_exp=32, n_dense_lead=1, n_shared=2, gating="SIGMOID", norm_w=True, w_scale=2.5,
                       probs_bias=True, n_group=4, n_group_used=2)

# GLM-4.5 / GLM-4.5-Air: biases on Q, K and V; a head of 32 of which RoPE turns the first 16 (partial NeoX RoPE, as
# GLM's partial_rotary_factor 0.5); Q/K norms on layers 0 and 2 only (llama.cpp applies them where present: GLM-4.5
# has them, Air not); no ffn_norm, its pre-FFN norm is post_attention_norm; one leading dense layer, then 32 experts of
# which each token uses 4, sigmoid gating with a selection bias, weights renormalised and scaled by 2.5, one shared
# expert; and one NextN/MTP layer after the 3 trunk layers (nextn_predict_layers 1, block_count 4), which llama.cpp
# loads (or skips) but never runs in its decoder graph; F32 matrices.
MODELS["glm4moe"] = dict(arch="glm4moe", pre="qwen2", n_layer=3, n_nextn=1, n_embd=64, n_ff=128, n_head=4,
                         n_head_kv=2, head_dim=32, n_rot=16, rope_base=1000000.0, ty="F32", qkv_bias=True,
                         qk_norm_layers=[0, 2], post_attn_norm=True, n_expert=32, n_expert_used=4, n_ff_exp=16,
                         n_dense_lead=1, n_shared=1, gating="SIGMOID", norm_w=True, w_scale=2.5, probs_bias=True)

# DeepSeek V3 / Kimi K2 (deepseek2): multi-head latent attention in llama.cpp's layout without the absorption
# (attn_kv_b, not attn_k_b/attn_v_b): Q through a low-rank pair (q_lora_rank 32, attn_q_a_norm between), one
# attn_kv_a_mqa row giving a compressed KV vector of 32 (kv_lora_rank, normalised by attn_kv_a_norm) and a RoPE key of
# 16 shared by the heads; attn_kv_b gives each head a K_nope of 32 and a V of 24, so K heads are 48 wide (32 unrotated,
# then 16 turned by RoPE in adjacent pairs) and V heads 24; one leading dense layer, then V3's routing: 16 experts in
# 4 groups of which the best 2 are kept, sigmoid gating with a selection bias, 4 experts per token, renormalised and
# scaled by 2.5, 2 shared experts; F32 matrices.
MODELS["deepseek2"] = dict(arch="deepseek2", pre="qwen2", n_layer=3, n_embd=64, n_ff=128, n_head=4, n_head_kv=4,
                           head_dim=48, head_dim_v=24, n_rot=16, q_lora_rank=32, kv_lora_rank=32,
                           rope_base=10000.0, ty="F32", n_expert=16, n_expert_used=4, n_ff_exp=32, n_dense_lead=1,
                           n_shared=2, gating="SIGMOID", norm_w=True, w_scale=2.5, probs_bias=True, n_group=4,
                           n_group_used=2)

# DeepSeek V3 / Kimi K2 as llama.cpp's converters write them now: the absorbed MLA layout. attn_kv_b is split into
# attn_k_b (per head, K_nope's rows as [kv_lora_rank, n_nope], which takes Q's unrotated part into the compressed
# space) and attn_v_b (per head, [head_dim_v, kv_lora_rank], which takes the attention's output out of it); the
# cache holds one KV head: the normalised compressed vector (40) then the RoPE key (16), K 56 and V 40 wide
# (key_length / value_length), while key_length_mla 48 and value_length_mla 24 are each head's decompressed sizes.
# With YaRN as DeepSeek's configs have it (factor 4 over an original context of 1024, mscale_all_dim 0.707 written as
# a log multiplier of 0.0707): the RoPE angles mix interpolation and extrapolation by pair, the attention is scaled
# by YaRN's mscale squared. Otherwise deepseek2's; F32 matrices.
MODELS["deepseek2-mla"] = dict(arch="deepseek2", pre="qwen2", n_layer=3, n_embd=64, n_ff=128, n_head=4, n_head_kv=1,
                               head_dim=48, head_dim_v=24, n_rot=16, q_lora_rank=32, kv_lora_rank=40,
                               absorbed=True, yarn=dict(factor=4.0, orig_ctx=1024, log_mul=0.0707),
                               rope_base=10000.0, ty="F32", n_expert=16, n_expert_used=4, n_ff_exp=32,
                               n_dense_lead=1, n_shared=2, gating="SIGMOID", norm_w=True, w_scale=2.5,
                               probs_bias=True, n_group=4, n_group_used=2)

# Qwen 3 with YaRN RoPE scaling (factor 4 over an original context of 1024, as Qwen's long-context configs): each
# rotated pair's angle mixes the interpolated and the original one by a ramp over the pairs, and the cosines and sines
# are scaled by 1 + 0.1 ln 4; otherwise qwen3's shape; F16 matrices.
MODELS["qwen3-yarn"] = dict(arch="qwen3", pre="qwen2", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                            head_dim=32, rope_base=1000000.0, ty="F16", qk_norm=True,
                            yarn=dict(factor=4.0, orig_ctx=1024))

# Models for benchmarks only (`--experts-split` in docs/moe.md), written only when named: too large to commit. A
# scaled-down Qwen3-30B-A3B: 16 experts of which each token uses 4, experts as wide as the model, Q8_0 matrices
# (about 230 MB); the active experts are most of a token's work.
BENCH_MODELS = {
    "qwen3moe-bench": dict(arch="qwen3moe", pre="qwen2", n_layer=4, n_embd=1024, n_ff=1024, n_head=16,
                           n_head_kv=4, head_dim=64, rope_base=1000000.0, ty="Q8_0", qk_norm=True, n_expert=16,
                           n_expert_used=4, n_ff_exp=1024),
    # GPU figures (docs/gpu.md, scripts/bench-gpu): Llama 3.2 1B's and Llama 3.1 8B's shapes with SmolLM2's whole
    # vocabulary (49152 tokens, not Llama 3's 128256, so the head is smaller) and Q4_K_M's common types: Q4_K, with
    # Q6_K for attn_v, ffn_down and the head (Q4_K_M gives Q6_K to about half of those). Random blocks, written
    # without quantizing (seconds, not minutes, for 4.6 GB).
    "llama1b-bench": dict(arch="llama", pre="llama-bpe", n_layer=16, n_embd=2048, n_ff=8192, n_head=32,
                          n_head_kv=8, head_dim=64, rope_base=500000.0, ty="Q4_K", n_vocab=49152,
                          q6k=("attn_v", "ffn_down")),
    "llama8b-bench": dict(arch="llama", pre="llama-bpe", n_layer=32, n_embd=4096, n_ff=14336, n_head=32,
                          n_head_kv=8, head_dim=128, rope_base=500000.0, ty="Q4_K", n_vocab=49152,
                          q6k=("attn_v", "ffn_down")),
    # DeepSeek-V2-Lite's layers (latent attention: 16 heads, K 192 = 128 + 64 rotated, V 128, kv_lora_rank 512; a
    # dense first layer, then 64 experts of 1408 of which 6 are used, 2 shared, softmax gating) with Q through V2's
    # low-rank pair of 1536 (llama.cpp reads attn_q only in files of V2-Lite's 26 or 27 layers), 4 layers, Q8_0
    # (1408 is not whole K-quant blocks), SmolLM2's vocabulary: about 2.1 GB. For the GPU's MLA and experts.
    "deepseek2-bench": dict(arch="deepseek2", pre="llama-bpe", n_layer=4, n_embd=2048, n_ff=10944, n_head=16,
                            n_head_kv=16, head_dim=192, head_dim_v=128, n_rot=64, q_lora_rank=1536,
                            kv_lora_rank=512, rope_base=10000.0, ty="Q8_0", n_vocab=49152, n_expert=64,
                            n_expert_used=6, n_ff_exp=1408, n_dense_lead=1, n_shared=2, gating="SOFTMAX",
                            norm_w=False, w_scale=1.0),
    # deepseek2-bench in the absorbed layout llama.cpp's converters write now (attn_k_b/attn_v_b, a one-head cache of
    # 512 + 64), with DeepSeek-V2-Lite's YaRN (factor 40 over 4096, mscale_all_dim 0.707): the CPU's absorbed MLA
    # against llama.cpp's; about 2.1 GB.
    "deepseek2-mla-bench": dict(arch="deepseek2", pre="llama-bpe", n_layer=4, n_embd=2048, n_ff=10944, n_head=16,
                                n_head_kv=1, head_dim=192, head_dim_v=128, n_rot=64, q_lora_rank=1536,
                                kv_lora_rank=512, absorbed=True, yarn=dict(factor=40.0, orig_ctx=4096, log_mul=0.0707),
                                rope_base=10000.0, ty="Q8_0", n_vocab=49152, n_expert=64, n_expert_used=6,
                                n_ff_exp=1408, n_dense_lead=1, n_shared=2, gating="SOFTMAX", norm_w=False,
                                w_scale=1.0),
}

# Where each block type keeps its f16 scales (d, and dmin where it has one): random bytes there could be inf or NaN.
F16_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q6_K": (208,), "Q3_K": (108,),
              "Q2_K": (80, 82)}


def random_blocks(rng, ty, rows, cols, std):
    """rows x cols weights of type `ty` as random blocks (any quants, indices, signs and sub-scales), the f16 scales
    of each block chosen so the weights' standard deviation is about `std` (measured on the first 4096 blocks)."""
    bs, ts = gguf.constants.GGML_QUANT_SIZES[ty]
    n = rows * cols // bs
    raw = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    at = F16_SCALES.get(ty.name, (0,))
    for o in at:
        raw[:, o:o + 2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    unit = gguf.quants.dequantize(raw[:4096].reshape(1, -1), ty).std()
    for o in at:
        raw[:, o:o + 2] = np.array([std / unit], dtype=np.float16).view(np.uint8)
    return dict(tensor=raw.reshape(rows, cols // bs * ts), raw_dtype=ty)


def cut_vocab(reader, n):
    """The first n tokens of the source vocab with the merges among them, and the other tokenizer keys."""
    f = reader.fields
    tokens = f["tokenizer.ggml.tokens"].contents()[:n]
    types = f["tokenizer.ggml.token_type"].contents()[:n]
    kept = set(tokens)
    merges = []
    for m in f["tokenizer.ggml.merges"].contents():
        a, b = m.split(" ", 1)
        if a in kept and b in kept and a + b in kept:
            merges.append(m)
    meta = {k: f[k].contents() for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                         "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                                         "tokenizer.chat_template")}
    for k, v in meta.items():
        if isinstance(v, int) and v >= n:
            sys.exit(f"{k} = {v} is not among the first {n} tokens")
    return tokens, types, merges, meta


def write_vocab_only(reader, path):
    """A GGUF holding only the reader's tokenizer keys: what cut_vocab reads, without the weights."""
    f = reader.fields
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list(f["tokenizer.ggml.tokens"].contents())
    w.add_token_types(f["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(f["tokenizer.ggml.merges"].contents())
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"].contents())
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"].contents())
    w.add_unk_token_id(f["tokenizer.ggml.unknown_token_id"].contents())
    w.add_pad_token_id(f["tokenizer.ggml.padding_token_id"].contents())
    w.add_chat_template(f["tokenizer.chat_template"].contents())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path}: {os.path.getsize(path)} bytes")


def llama3_rope_factors(n_rot, base):
    """Llama 3.1's factors (convert_hf_to_gguf's formula) with a short original context so that most pairs are
    scaled: high frequencies keep 1, low ones get `factor`, those between are smoothed."""
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 64
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, n_rot, 2):
        freq = 1.0 / base ** (i / n_rot)
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_model(path, name, spec, vocab, rng):
    tokens, types, merges, meta = vocab
    arch, e, hd = spec["arch"], spec["n_embd"], spec["head_dim"]
    nq, nkv = spec["n_head"] * hd, spec["n_head_kv"] * hd
    w = gguf.GGUFWriter(path, arch)
    # llama.cpp gives special tokens of a model named like Phi-3 extra attributes, looking up "</s>", which this
    # vocabulary lacks: the phi3 model is named for what it tests instead.
    w.add_name(f"baton test {spec.get('name', name)} (random weights)")
    n_nextn = spec.get("n_nextn", 0)
    w.add_block_count(spec["n_layer"] + n_nextn)
    if n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)
    w.add_context_length(4096)
    w.add_embedding_length(e)
    w.add_feed_forward_length(spec["n_ff"])
    w.add_head_count(spec["n_head"])
    w.add_head_count_kv(spec["n_head_kv"])
    if spec.get("absorbed"):
        # The cache's one KV head: the compressed vector and the RoPE key; each head's own sizes as *_mla.
        w.add_key_length(spec["kv_lora_rank"] + spec["n_rot"])
        w.add_value_length(spec["kv_lora_rank"])
        w.add_key_length_mla(hd)
        w.add_value_length_mla(spec["head_dim_v"])
    else:
        w.add_key_length(hd)
        w.add_value_length(spec.get("head_dim_v", hd))
    if "kv_lora_rank" in spec:
        w.add_q_lora_rank(spec["q_lora_rank"])
        w.add_kv_lora_rank(spec["kv_lora_rank"])
    w.add_rope_dimension_count(spec.get("n_rot", hd))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec["rope_base"])
    if "n_expert" in spec:
        w.add_expert_count(spec["n_expert"])
        w.add_expert_used_count(spec["n_expert_used"])
        w.add_expert_feed_forward_length(spec["n_ff_exp"])
    if "gating" in spec:
        w.add_expert_gating_func(getattr(gguf.ExpertGatingFuncType, spec["gating"]))
        w.add_expert_weights_norm(spec["norm_w"])
        w.add_expert_weights_scale(spec["w_scale"])
        w.add_expert_shared_count(spec["n_shared"])
        w.add_leading_dense_block_count(spec["n_dense_lead"])
    if "n_group" in spec:
        w.add_expert_group_count(spec["n_group"])
        w.add_expert_group_used_count(spec["n_group_used"])
    if "sliding_window" in spec:
        w.add_sliding_window(spec["sliding_window"])
    if "rope_linear" in spec:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec["rope_linear"])
    if "yarn" in spec:
        y = spec["yarn"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(y["factor"])
        w.add_rope_scaling_orig_ctx_len(y["orig_ctx"])
        if "log_mul" in y:
            w.add_rope_scaling_yarn_log_mul(y["log_mul"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])

    ty = getattr(gguf.GGMLQuantizationType, spec["ty"])

    def mat(rows, cols, scale=1.7, kind=None, il=0):
        if kind is not None and "types" in spec:
            qt = getattr(gguf.GGMLQuantizationType, spec["types"][il][kind])
            return random_blocks(rng, qt, rows, cols, scale / np.sqrt(3.0 * cols))
        if "n_vocab" in spec:
            qt = gguf.GGMLQuantizationType.Q6_K if kind in spec.get("q6k", ()) else ty
            return random_blocks(rng, qt, rows, cols, scale / np.sqrt(3.0 * cols))
        v = (rng.uniform(-1.0, 1.0, (rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)
        if ty == gguf.GGMLQuantizationType.F32:
            return dict(tensor=v)
        if ty == gguf.GGMLQuantizationType.F16:
            return dict(tensor=v.astype(np.float16))
        return dict(tensor=gguf.quants.quantize(v, ty), raw_dtype=ty)

    def stack(mats):
        return dict(tensor=np.stack([m["tensor"] for m in mats]), raw_dtype=mats[0].get("raw_dtype"))

    def vec(n, lo=0.8, hi=1.2):
        return dict(tensor=rng.uniform(lo, hi, n).astype(np.float32))

    t = {}
    # F16 embeddings and an untied F16 output head (a tied head would mostly pick the last input token again), its
    # logits spread wide enough that the top two rarely tie.
    # The bench models' are block types, as a real model's.
    bench = "n_vocab" in spec
    if bench:
        t["token_embd.weight"] = random_blocks(rng, ty, len(tokens), e, 1.0)
    else:
        t["token_embd.weight"] = dict(tensor=rng.normal(0.0, 1.0, (len(tokens), e)).astype(np.float16))
    t["output_norm.weight"] = vec(e)
    if bench:
        t["output.weight"] = random_blocks(rng, gguf.GGMLQuantizationType.Q6_K, len(tokens), e, 0.6)
    else:
        t["output.weight"] = dict(tensor=rng.normal(0.0, 0.6, (len(tokens), e)).astype(np.float16))
    if spec.get("rope_freqs"):
        t["rope_freqs.weight"] = dict(tensor=llama3_rope_factors(hd, spec["rope_base"]))
    for il in range(spec["n_layer"] + n_nextn):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = vec(e)
        if spec.get("fused"):
            t[p + "attn_qkv.weight"] = mat(nq + 2 * nkv, e)
        elif "kv_lora_rank" in spec:
            # DeepSeek's latent attention (see MODELS["deepseek2"]); the norms sit in the path of Q and of K/V.
            ql, kl, rot, hv = spec["q_lora_rank"], spec["kv_lora_rank"], spec["n_rot"], spec["head_dim_v"]
            t[p + "attn_q_a.weight"] = mat(ql, e)
            t[p + "attn_q_a_norm.weight"] = vec(ql)
            t[p + "attn_q_b.weight"] = mat(nq, ql)
            t[p + "attn_kv_a_mqa.weight"] = mat(kl + rot, e)
            t[p + "attn_kv_a_norm.weight"] = vec(kl)
            if spec.get("absorbed"):
                # Per head (numpy [head, row, col], llama.cpp's {cols, rows, n_head}): K_nope's rows transposed,
                # then V's.
                t[p + "attn_k_b.weight"] = stack([mat(kl, hd - rot) for _ in range(spec["n_head"])])
                t[p + "attn_v_b.weight"] = stack([mat(hv, kl) for _ in range(spec["n_head"])])
            else:
                t[p + "attn_kv_b.weight"] = mat(spec["n_head"] * (hd - rot + hv), kl)
        else:
            t[p + "attn_q.weight"] = mat(nq, e, kind="attn_q", il=il)
            t[p + "attn_k.weight"] = mat(nkv, e, kind="attn_k", il=il)
            t[p + "attn_v.weight"] = mat(nkv, e, kind="attn_v", il=il)
        if spec.get("qkv_bias"):
            t[p + "attn_q.bias"] = vec(nq, -0.5, 0.5)
            t[p + "attn_k.bias"] = vec(nkv, -0.5, 0.5)
            t[p + "attn_v.bias"] = vec(nkv, -0.5, 0.5)
        if spec.get("qk_norm") or il in spec.get("qk_norm_layers", []):
            t[p + "attn_q_norm.weight"] = vec(hd)
            t[p + "attn_k_norm.weight"] = vec(hd)
        t[p + "attn_output.weight"] = mat(e, spec["n_head"] * spec.get("head_dim_v", hd), kind="attn_output", il=il)
        t[p + ("post_attention_norm.weight" if spec.get("post_attn_norm") else "ffn_norm.weight")] = vec(e)
        if "n_expert" in spec and il >= spec.get("n_dense_lead", 0):
            # The router stays F32 (as llama.cpp's quantizer leaves it), with logits spread wide enough that the
            # k-th and (k+1)-th experts rarely tie. A 3-D tensor is written in numpy's order [expert, row, col],
            # which gguf reverses into llama.cpp's {cols, rows, n_expert}.
            n_x, f = spec["n_expert"], spec["n_ff_exp"]
            t[p + "ffn_gate_inp.weight"] = dict(
                tensor=(rng.uniform(-1.0, 1.0, (n_x, e)) * 4.0 / np.sqrt(e)).astype(np.float32))
            for name, rows, cols in (("ffn_gate_exps", f, e), ("ffn_up_exps", f, e), ("ffn_down_exps", e, f)):
                t[p + name + ".weight"] = stack([mat(rows, cols) for _ in range(n_x)])
            if spec.get("probs_bias"):
                # Sigmoid probabilities spread over (0, 1); a bias of this size often changes which experts win.
                t[p + "exp_probs_b.bias"] = vec(n_x, -0.4, 0.4)
            if spec.get("n_shared"):
                sw = spec["n_shared"] * f
                t[p + "ffn_gate_shexp.weight"] = mat(sw, e)
                t[p + "ffn_up_shexp.weight"] = mat(sw, e)
                t[p + "ffn_down_shexp.weight"] = mat(e, sw)
        elif spec.get("fused"):
            t[p + "ffn_up.weight"] = mat(2 * spec["n_ff"], e)
            t[p + "ffn_down.weight"] = mat(e, spec["n_ff"])
        else:
            t[p + "ffn_gate.weight"] = mat(spec["n_ff"], e, kind="ffn_gate", il=il)
            t[p + "ffn_up.weight"] = mat(spec["n_ff"], e, kind="ffn_up", il=il)
            t[p + "ffn_down.weight"] = mat(e, spec["n_ff"], kind="ffn_down", il=il)
        if il >= spec["n_layer"]:
            # A NextN/MTP layer's own tensors (its embedding and head are the model's): never run by the decoder.
            t[p + "nextn.eh_proj.weight"] = mat(e, 2 * e)
            t[p + "nextn.enorm.weight"] = vec(e)
            t[p + "nextn.hnorm.weight"] = vec(e)
            t[p + "nextn.shared_head_norm.weight"] = vec(e)
    for k, v in t.items():
        w.add_tensor(k, v["tensor"], raw_dtype=v.get("raw_dtype"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-from",
                    default=os.path.expanduser("~/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "models"))
    ap.add_argument("names", nargs="*", help=f"models to write (default all: {', '.join(MODELS)}; for benchmarks "
                                                f"only, when named: {', '.join(BENCH_MODELS)})")
    ap.add_argument("--vocab-only", metavar="PATH",
                    help="write only --vocab-from's tokenizer to PATH (a small GGUF that can stand in for "
                         "--vocab-from where the model is not, such as a GPU machine) and exit")
    a = ap.parse_args()
    if not os.path.exists(a.vocab_from):
        sys.exit(f"{a.vocab_from} not found (`baton models fetch` downloads it)")
    reader = gguf.GGUFReader(a.vocab_from)
    if a.vocab_only:
        write_vocab_only(reader, a.vocab_only)
        return
    vocabs = {}
    os.makedirs(a.out, exist_ok=True)
    every = {**MODELS, **BENCH_MODELS}
    # Seeds in the order the models were added (a new one goes at the end), so adding one leaves the others' bytes.
    seed_order = ["llama3", "qwen2", "qwen3", "qwen3moe", "iquants", "phi3", "qwen3moe-bench", "dots1", "glm4moe",
                  "deepseek2", "llama1b-bench", "llama8b-bench", "deepseek2-bench", "deepseek2-mla", "qwen3-yarn", "deepseek2-mla-bench"]
    for name in a.names or MODELS:
        if name not in every:
            sys.exit(f"unknown model {name!r} (known: {', '.join(every)})")
        path = os.path.join(a.out, f"{name}.gguf")
        n_vocab = every[name].get("n_vocab", N_VOCAB)
        if n_vocab not in vocabs:
            vocabs[n_vocab] = cut_vocab(reader, n_vocab)
        # One generator per model, seeded by its position in seed_order, so writing one model alone writes the
        # bytes of a full run.
        seed = SEED + seed_order.index(name)
        write_model(path, name, every[name], vocabs[n_vocab], np.random.default_rng(seed))
        print(f"{path}: {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
