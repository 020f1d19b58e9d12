"""Dumps gguf-py's dequantization of a few tensors of a GGUF file, for the ignored test
`kernels::tests::real_model_dequant_matches_gguf_py` (which decodes the same rows with Baton and compares).

usage: python3 dequant_ref.py MODEL.gguf OUT_DIR [max_rows]
Writes OUT_DIR/<tensor>.f32 (raw little-endian f32, the first max_rows rows) for every 2-D tensor of
block 0 plus token_embd.
"""
import sys, os
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

model, out = sys.argv[1], sys.argv[2]
max_rows = int(sys.argv[3]) if len(sys.argv) > 3 else 64
os.makedirs(out, exist_ok=True)
r = GGUFReader(model)
for t in r.tensors:
    if not (t.name.startswith("blk.0.") or t.name == "token_embd.weight") or len(t.shape) != 2:
        continue
    ne0 = int(t.shape[0])
    data = np.asarray(t.data)
    rows = min(max_rows, int(t.shape[1]))
    # t.data is (rows, row_bytes) for quantized types, (rows, ne0) for float ones.
    x = dequantize(data[:rows], t.tensor_type).reshape(rows, ne0).astype(np.float32)
    x.tofile(os.path.join(out, t.name + ".f32"))
    print(t.name, t.tensor_type.name, ne0, rows)

# Synthetic blocks of every quantized type (random bytes, sane f16 scales): OUT_DIR/synthetic/<TYPE>.bin + .f32.
from gguf import GGMLQuantizationType as T
rng = np.random.default_rng(1)
f16_offsets = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
syn = os.path.join(out, "synthetic")
os.makedirs(syn, exist_ok=True)
from gguf.constants import GGML_QUANT_SIZES
for name, offs in f16_offsets.items():
    ty = T[name]
    bs, ts = GGML_QUANT_SIZES[ty]
    n = 8
    raw = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    for o in offs:
        s = (rng.uniform(0.001, 0.05, size=n) * rng.choice([-1, 1], size=n)).astype(np.float16)
        raw[:, o:o + 2] = s.view(np.uint8).reshape(n, 2)
    raw.tofile(os.path.join(syn, name + ".bin"))
    dequantize(raw.reshape(1, n * ts), ty).astype(np.float32).tofile(os.path.join(syn, name + ".f32"))
    print("synthetic", name)
