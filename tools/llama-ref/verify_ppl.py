"""Independent check of a perplexity-<model>.json written by llama-ref.

Usage: python3 verify_ppl.py perplexity-<model>.json [chunk0-logits.f32]

Recomputes, with numpy in float64, what llama-perplexity's arithmetic gives from the recorded per-position
values: chunk count, running ppl after each chunk, final ppl and stderr. With the logits of chunk 0 dumped
by `llama-ref perplexity --dump-logits`, it also recomputes each scored position's nll and argmax from the
raw logits, checking the position/target alignment (position j predicts token j+1, j = n_ctx/2 .. n_ctx-2).
"""

import json
import math
import sys

import numpy as np


def main() -> None:
    doc = json.load(open(sys.argv[1]))
    n_ctx = doc["settings"]["n_ctx"]
    first = n_ctx // 2
    per = n_ctx - first - 1
    tokens = doc["tokens"]
    assert doc["n_tokens"] == len(tokens)
    assert doc["n_chunks"] == len(tokens) // n_ctx, "chunk count"
    assert doc["scored_per_chunk"] == per
    nll = np.array(doc["nll"], dtype=np.float64)
    assert len(nll) == doc["n_chunks"] * per == len(doc["argmax"])

    running = [math.exp(nll[: (c + 1) * per].mean()) for c in range(doc["n_chunks"])]
    for c, (a, b) in enumerate(zip(running, doc["chunk_running_ppl"])):
        assert abs(a - b) / b < 1e-5, f"running ppl of chunk {c}: {a} vs {b}"
    mean = nll.mean()
    ppl = math.exp(mean)
    var = (nll * nll).mean() - mean * mean
    err = math.sqrt(var / (len(nll) - 1)) * ppl
    assert abs(ppl - doc["ppl"]) / doc["ppl"] < 1e-5, (ppl, doc["ppl"])
    assert abs(err - doc["ppl_stderr"]) / doc["ppl_stderr"] < 1e-3, (err, doc["ppl_stderr"])
    agree = sum(int(a == tokens[(k // per) * n_ctx + first + k % per + 1]) for k, a in enumerate(doc["argmax"]))
    assert agree == doc["top1_matches_target"]
    print(f"{sys.argv[1]}: recomputed ppl {ppl:.4f} +/- {err:.5f} over {len(nll)} positions; running ppl ok")

    if len(sys.argv) > 2:
        n_vocab = doc["n_vocab"]
        logits = np.fromfile(sys.argv[2], dtype="<f4").reshape(per, n_vocab).astype(np.float64)
        m = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - m).sum(axis=1)) + m[:, 0]
        targets = np.array(tokens[first + 1 : first + 1 + per])
        want = lse - logits[np.arange(per), targets]
        diff = np.abs(want - nll[:per]).max()
        am = logits.argmax(axis=1)
        same = int((am == np.array(doc["argmax"][:per])).sum())
        print(f"chunk 0 from raw logits: max |nll diff| {diff:.2e}, argmax agrees {same}/{per}")
        assert diff < 1e-4 and same == per


if __name__ == "__main__":
    main()
