"""Prefill attention on CPU: the compiled per-row attention (csrc/cpu/attention_impl.h, the
batch-invariant mode's attention at every width) against the torch reference's SDPA, at prefill
widths on the 1.5B target's heads (12 query / 2 KV heads, D 128), then the target's whole prefill
of a long copy prompt and of all six joined (bench/ngram_prompts.py). Best of 5 kernel calls and
of 3 prefills, each after a warm-up call. To compare two builds, run it once under each (the extension registers its ops
once per process).

    python bench/prefill_attention.py --out bench/results/cpu_prefill_attention.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from gguf_cpu import best_ms
from ngram_prompts import COPY_PROMPTS
from specengine import Engine
from specengine.benchmark import environment, save
from specengine.kernels.row_attention import verify_attention_rows
from specengine.kernels.verify_attention import verify_attention_ref
from specengine.models.fetch import DEFAULT_TARGET

WIDTHS = (1, 8, 274, 800, 1079)


def kernel_ms() -> dict:
    out = {}
    for T in WIDTHS:
        g = torch.Generator().manual_seed(T)
        q, k, v = torch.randn(1, T, 12, 128, generator=g), torch.randn(1, 2048, 2, 128, generator=g), \
            torch.randn(1, 2048, 2, 128, generator=g)
        lens = torch.zeros(1, dtype=torch.int32)  # an empty cache: the prompt's own causal attention
        out[T] = {"rows_ms": best_ms(lambda: verify_attention_rows(q, k, v, lens), 5),
                  "torch_ref_ms": best_ms(lambda: verify_attention_ref(q, k, v, lens), 5)}
        print(f"{T:5d} queries: rows {out[T]['rows_ms']:.2f} ms, torch reference {out[T]['torch_ref_ms']:.2f} ms",
              flush=True)
    return out


def prefill_s() -> dict:
    eng = Engine.from_pretrained(DEFAULT_TARGET, max_seq_len=2048)
    tok = eng.tokenizer

    def ids(messages):
        return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]

    longest = max((m for _, m in COPY_PROMPTS), key=lambda m: len(str(m)))
    joined = [{"role": "user", "content": "\n\n".join(m[-1]["content"] for _, m in COPY_PROMPTS)}]
    out = {}
    for name, p in (("longest copy prompt", ids(longest)), ("six copy prompts joined", ids(joined))):
        out[name] = {"tokens": len(p), "prefill_and_one_token_s":  # best_ms warms up first
                     best_ms(lambda: eng.generate(p, max_new_tokens=1, method="ar"), 3) / 1e3}
        print(f"{name}: {len(p)} tokens, prefill + 1 token {out[name]['prefill_and_one_token_s']:.3f} s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_prefill_attention.json")
    args = ap.parse_args(argv)
    report = {"benchmark": "prefill attention, CPU", "command": " ".join(["python"] + sys.argv),
              "environment": environment(), "kernel_ms": kernel_ms(), "prefill": prefill_s()}
    save(report, args.out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
