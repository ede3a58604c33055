"""`make bench-grid`: dtype "auto" against the whole grid it chooses from, in one run.

The real pair is loaded once per (target dtype, draft dtype) cell, fp32/bf16 each, and every
cell runs `ar` and `sd` at γ = 1..6 and γ auto on the same HumanEval prompts (greedy, EOS
ignored). Then the engine dtype "auto" builds (its own choice) runs `sd` γ auto. The JSON
names the best cell, auto's choice, auto's distance from the best cell and from the fastest
`ar`, and the cost model's prediction error per provider (γ auto rows).

    python bench/dtype_grid.py --out bench/results/cpu_dtype_grid.json [--n-prompts 3 --max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import gc
import sys

from specengine import Engine
from specengine.benchmark import environment, run_benchmark, save
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET

DTYPES = ("float32", "bfloat16")
GRID_PROVIDERS = ["ar"] + [f"sd:{g}" for g in range(1, 7)] + ["sd:auto"]


def load(target_dtype: str | None, draft_dtype: str | None) -> Engine:
    """The pair with each model in its dtype (None: dtype "auto")."""
    if target_dtype is None:
        return Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024)
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024, dtype=target_dtype)
    if draft_dtype != target_dtype:  # a mixed pair: the draft reloaded in its own dtype
        draft = Engine.from_pretrained(DEFAULT_DRAFT, max_seq_len=1024, dtype=draft_dtype, method="ar")
        eng = Engine(eng.target.model, eng.tokenizer, draft.target.model, max_seq_len=1024)
    return eng


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_dtype_grid.json")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    kw = dict(n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens)
    cells = []
    for tdt in DTYPES:
        for ddt in DTYPES:
            eng = load(tdt, ddt)
            report = run_benchmark(eng, GRID_PROVIDERS, baseline="ar", **kw)
            for row in report["results"]:
                cells.append({"target": tdt, "draft": ddt, "batch_invariant": report["batch_invariant"], **row})
                print(f"{tdt:8s} {ddt:8s} {row['provider']:8s} {row['tokens_per_s']:6.2f} tok/s  "
                      f"same as ar {row['same_tokens_as_reference']}", flush=True)
            del eng
            gc.collect()
    auto = load(None, None)
    report = run_benchmark(auto, ["ar", "sd:auto"], baseline="ar", **kw)
    auto_rows = report["results"]
    speculative = [c for c in cells if c["provider"] != "ar"]
    best = max(speculative + [c for c in cells if c["provider"] == "ar"], key=lambda c: c["tokens_per_s"])
    best_ar = max((c for c in cells if c["provider"] == "ar"), key=lambda c: c["tokens_per_s"])
    auto_sd = next(r for r in auto_rows if r["provider"] == "sd:auto")
    summary = {"best_cell": {k: best[k] for k in ("target", "draft", "provider", "tokens_per_s")},
               "best_ar": {k: best_ar[k] for k in ("target", "provider", "tokens_per_s")},
               "auto_choice": auto.dtype_choice and {k: auto.dtype_choice.get(k) for k in (
                   "target", "draft", "why", "predicted_gamma", "predicted_tokens_per_s")},
               "auto_sd_tokens_per_s": auto_sd["tokens_per_s"],
               "auto_vs_best_cell": auto_sd["tokens_per_s"] / best["tokens_per_s"],
               "auto_vs_best_ar": auto_sd["tokens_per_s"] / best_ar["tokens_per_s"],
               "auto_same_tokens_as_its_ar": auto_sd["same_tokens_as_reference"],
               "auto_prediction_error": auto_sd.get("prediction_error")}
    out = {"benchmark": "dtype_grid", "pair": [DEFAULT_TARGET, DEFAULT_DRAFT], **kw,
           "environment": environment(), "summary": summary, "grid": cells, "auto": auto_rows,
           "auto_dtype_choice": auto.dtype_choice}
    save(out, args.out)
    print(f"best cell {summary['best_cell']}\nauto {summary['auto_choice']}: sd:auto {auto_sd['tokens_per_s']:.2f} "
          f"tok/s = {summary['auto_vs_best_cell']:.2f}x the best cell, {summary['auto_vs_best_ar']:.2f}x the best ar")
    return 0


if __name__ == "__main__":
    sys.exit(main())
