"""The AMX tile copy of the interleaved Q4_K kernel (csrc/cpu/amx_impl.h) against the vector copy it
replaces, interleaved in one process on the real pair (a shared VM's speed drifts within minutes):
- the kernel alone on the target's gate/up shape (17920 x 1536, random blocks) per row count;
- whole replies of `ar`, `ngram:auto` and `sd:auto` on the input-grounded and HumanEval prompts,
  each copy in turn per prompt, `--repeats` times: prefill seconds and tokens per second. Every
  reply must be the same tokens under both copies (the tile copy's sums are the vector copy's bit
  for bit). Needs a CPU with AMX-INT8 and a kernel that grants tile data.

    python bench/amx_ab.py --out bench/results/cpu_amx_ab.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from gguf_cpu import EXT_CODES, K, N, best_ms, blocks
from ngram_prompts import COPY_PROMPTS
from specengine import Engine
from specengine.benchmark import environment, save
from specengine.kernels.quant_pack import pack_x8
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.models.quant_linear import _quantext
from specengine.prompts import humaneval

COPIES = ("avx512vnni", "avx512amx")
ROWS = (1, 8, 16, 32, 128, 512)
METHODS = ("ar", "ngram", "sd")


def kernel_ms() -> dict:
    wp, code = pack_x8(blocks("Q4_K"), "Q4_K"), EXT_CODES["Q4_K"]
    out = {c: [] for c in COPIES}
    for m in ROWS:
        x = torch.randn(m, K)
        for c in COPIES:
            _quantext.set_isa(c)
            out[c].append(best_ms(lambda: _quantext.quant_matmul_x8(x, wp, code, N), 5))
        print(f"{m:4d} rows: " + ", ".join(f"{c} {out[c][-1]:.2f} ms" for c in COPIES), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_amx_ab.json")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--humaneval", type=int, default=2)
    args = ap.parse_args(argv)
    if "avx512amx" not in _quantext.isas():
        print("this CPU (or its kernel) offers no AMX tiles: nothing to compare", file=sys.stderr)
        return 1
    default = _quantext.isa()
    report = {"benchmark": "AMX tile copy vs the vector copy, interleaved A/B", "command": " ".join(["python"] + sys.argv),
              "environment": environment(), "default_copy_measured_here": default, "shape": [N, K], "rows": list(ROWS)}
    report["kernel_ms"] = kernel_ms()
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=2048)
    sets = {"copy": [p for _, p in COPY_PROMPTS], "humaneval": [p["prompt"] for p in humaneval(args.humaneval)]}
    for m in METHODS:  # warm-up: allocations, step costs
        eng.generate(sets["copy"][0], max_new_tokens=4, method=m, gamma=None if m == "ar" else "auto")
    totals = {(s, m, c): [0, 0.0, 0.0] for s in sets for m in METHODS for c in COPIES}  # tokens, wall, prefill
    for rep in range(args.repeats):
        for s, prompts in sets.items():
            for j, p in enumerate(prompts):
                for m in METHODS:
                    ref = None
                    for c in COPIES:
                        _quantext.set_isa(c)
                        t = time.perf_counter()
                        r = eng.generate(p, max_new_tokens=512, method=m, gamma=None if m == "ar" else "auto")
                        wall = time.perf_counter() - t
                        ref = ref or r.token_ids
                        assert r.token_ids == ref, f"{m} under {c} diverged on {s}[{j}]"
                        tot = totals[(s, m, c)]
                        tot[0] += len(r.token_ids)
                        tot[1] += wall
                        tot[2] += r.stats["prefill_s"]
                print(f"rep {rep} {s}[{j}] done", flush=True)
    _quantext.set_isa(default)
    report["results"] = [{"set": s, "method": m, "copy": c, "new_tokens": n, "tokens_per_s": n / w,
                          "prefill_s": pre, "decode_tokens_per_s": n / (w - pre)}
                         for (s, m, c), (n, w, pre) in totals.items()]
    report["same_tokens"] = "each method gave the same tokens under both copies on every prompt (asserted)"
    for r in report["results"]:
        print(f"{r['set']:10s} {r['method']:6s} {r['copy']:11s} {r['tokens_per_s']:6.2f} tok/s  "
              f"prefill {r['prefill_s']:6.2f} s  decode {r['decode_tokens_per_s']:6.2f} tok/s")
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
