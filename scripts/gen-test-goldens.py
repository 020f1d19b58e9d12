#!/usr/bin/env python3
"""Writes llama.cpp's goldens for the generated test models (tests/models/, scripts/gen-test-models.py) into
tests/golden/: `tokens-<model>.json` (tools/llama-ref `tokens`) and `greedy-<model>.json`.

tools/llama-ref's `greedy` writes a chat prompt for llama and gemma3 only, so the greedy goldens here are made with
its `dump` subcommand, which evaluates a list of token ids as one batch from an empty cache and writes the logits of
the last one (`result_output`): each greedy step evaluates the prompt plus the ids chosen so far and appends the
argmax (the lowest id wins a tie). The prompts are those of the smollm2 greedy golden.

    python3 scripts/gen-test-goldens.py [--llama-ref tools/llama-ref/target/avx2/release/llama-ref] [names...]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GOLDEN = os.path.join(ROOT, "tests", "golden")
MODELS = os.path.join(ROOT, "tests", "models")
N_PREDICT = 16


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def last_logits(ref, model, ids, tmp):
    with open(os.path.join(tmp, "ids.txt"), "w") as f:
        f.write(" ".join(map(str, ids)))
    out = os.path.join(tmp, "dump")
    run([ref, "dump", "-m", model, "--tokens", os.path.join(tmp, "ids.txt"), "-o", out, "--filter", "result_output",
         "--n-ctx", "512"])
    index = open(os.path.join(out, "index.txt")).read().split()
    if index[:1] != ["result_output"] or index[2] != "1":
        sys.exit(f"unexpected dump index {index}")
    return np.fromfile(os.path.join(out, "result_output.f32"), dtype="<f4")


def top2(logits):
    first = int(np.argmax(logits))  # the lowest index among equal maxima
    rest = logits.copy()
    rest[first] = -np.inf
    second = int(np.argmax(rest))
    return first, second


def greedy(ref, name, prompts, tmp):
    model = os.path.join(MODELS, f"{name}.gguf")
    texts = os.path.join(tmp, "texts.json")
    json.dump({"texts": [p["prompt"] for p in prompts]}, open(texts, "w"))
    toks = os.path.join(tmp, "tokens.json")
    run([ref, "tokens", "-m", model, "--name", name, "--texts", texts, "-o", toks])
    tok = json.load(open(toks))
    doc = {k: tok[k] for k in tok if k not in ("cases", "pieces_hex")}
    doc["settings"] = {"method": "llama-ref dump: each step evaluates prompt + output so far as one batch from an "
                                 "empty cache (n_ctx 512, F16 KV cache), argmax of the last row, lowest id wins ties",
                       "n_predict": N_PREDICT, "add_special": True, "parse_special": True}
    doc["prompts"] = []
    for p, case in zip(prompts, tok["cases"]):
        ids = list(case["special"])
        out, steps, first_logits = [], [], None
        for _ in range(N_PREDICT):
            logits = last_logits(ref, model, ids + out, tmp)
            if first_logits is None:
                first_logits = logits
            a, b = top2(logits)
            steps.append({"id": a, "logit": float(logits[a]), "second": b, "gap": float(logits[a] - logits[b])})
            out.append(a)
        order = np.argsort(-first_logits, kind="stable")[:20]
        doc["prompts"].append({
            "label": p["label"], "prompt": p["prompt"], "prompt_ids": ids, "output_ids": out, "steps": steps,
            "last_prompt_logits": {
                "top20": [[int(i), float(first_logits[i])] for i in order],
                "mean": float(first_logits.astype(np.float64).mean()),
                "std": float(first_logits.astype(np.float64).std()),
            },
        })
        print(f"{name}/{p['label']}: {len(ids)} prompt ids, smallest gap {min(s['gap'] for s in steps):.4f}")
    return doc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-ref", default=os.path.join(ROOT, "tools/llama-ref/target/avx2/release/llama-ref"))
    ap.add_argument("names", nargs="*", default=["llama3", "qwen2", "qwen3", "qwen3moe"])
    a = ap.parse_args()
    ref = a.llama_ref
    if not os.access(ref, os.X_OK):
        sys.exit(f"{ref} is not an executable (tools/llama-ref/README.md builds it)")
    prompts = json.load(open(os.path.join(GOLDEN, "greedy-smollm2-avx2.json")))["prompts"]
    prompts = [{"label": p["label"], "prompt": p["prompt"]} for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.names:
            model = os.path.join(MODELS, f"{name}.gguf")
            # llama3's vocabulary and pre-tokenizer: tokens-llama3.json covers iquants and phi3; qwen3moe's (qwen2) dots1,
            # glm4moe, deepseek2 and deepseek2-mla; qwen3's qwen3-yarn.
            if name not in ("iquants", "phi3", "dots1", "glm4moe", "deepseek2", "deepseek2-mla", "qwen3-yarn"):
                run([ref, "tokens", "-m", model, "--name", name, "--texts",
                     os.path.join(GOLDEN, "tokenizer_texts.json"), "-o", os.path.join(GOLDEN, f"tokens-{name}.json")])
            doc = greedy(ref, name, prompts, tmp)
            with open(os.path.join(GOLDEN, f"greedy-{name}.json"), "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")


if __name__ == "__main__":
    main()
