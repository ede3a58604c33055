"""Interleaved A/B of `hybrid:auto` against its code at an earlier commit, in one process on the
real pair: per prompt, `ar`, `ngram:auto`, `sd:auto`, the hybrid at the commit and the hybrid
here, in turn, `--repeats` times (a shared VM's speed drifts by 20-30% within minutes; side by
side it moves every variant alike). Whole replies (stop at EOS, at most 512 tokens); every
variant must give `ar`'s tokens. The old hybrid is methods/ngram.py at the commit, loaded as a
sibling module for the run (its helpers from this tree).

    python bench/hybrid_ab.py --old-commit 30259af --out bench/results/cpu_hybrid_ab.json
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import subprocess
import sys
import time

from ngram_prompts import COPY_PROMPTS

from specengine import Engine
from specengine.benchmark import environment, save
from specengine.methods import METHODS
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.prompts import humaneval

OLD = pathlib.Path(__file__).resolve().parents[1] / "specengine" / "methods" / "_ab_old_ngram.py"


def load_old(commit: str):
    OLD.write_text(subprocess.check_output(["git", "show", f"{commit}:specengine/methods/ngram.py"], text=True))
    try:
        mod = importlib.import_module("specengine.methods._ab_old_ngram")
    finally:
        OLD.unlink()
    cls = type("OldHybrid", (mod.HybridDecoding,), {"name": "hybrid-old"})
    METHODS["hybrid-old"] = cls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-commit", required=True)
    ap.add_argument("--out", default="bench/results/cpu_hybrid_ab.json")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--humaneval", type=int, default=2)
    args = ap.parse_args(argv)
    load_old(args.old_commit)
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=2048)
    sets = {"copy": [p for _, p in COPY_PROMPTS], "humaneval": [p["prompt"] for p in humaneval(args.humaneval)]}
    variants = ["ar", "ngram", "sd", "hybrid-old", "hybrid"]
    for v in variants:  # warm-up: allocations, step costs
        eng.generate(sets["copy"][0], max_new_tokens=4, method=v, gamma="auto" if v != "ar" else None)
    totals = {(s, v): [0, 0.0, 0.0, 0] for s in sets for v in variants}  # tokens, wall, prefill, draft rounds
    for rep in range(args.repeats):
        for s, prompts in sets.items():
            for j, p in enumerate(prompts):
                ref = None
                for v in variants:
                    t = time.perf_counter()
                    r = eng.generate(p, max_new_tokens=512, method=v, gamma="auto" if v != "ar" else None)
                    wall = time.perf_counter() - t
                    ref = ref or r.token_ids
                    assert r.token_ids == ref, f"{v} diverged from ar on {s}[{j}]"
                    tot = totals[(s, v)]
                    tot[0] += len(r.token_ids)
                    tot[1] += wall
                    tot[2] += r.stats["prefill_s"]
                    tot[3] += r.stats.get("draft_rounds", 0)
                print(f"rep {rep} {s}[{j}] done", flush=True)
    results = [{"set": s, "variant": v, "tokens_per_s": n / w, "decode_tokens_per_s": n / (w - pre),
                "draft_rounds": dr, "new_tokens": n} for (s, v), (n, w, pre, dr) in totals.items()]
    mixed = {v: sum(r["tokens_per_s"] for r in results if r["variant"] == v) for v in variants}
    report = {"benchmark": "hybrid:auto here against its code at --old-commit, interleaved A/B",
              "command": " ".join(["python"] + sys.argv), "environment": environment(), "repeats": args.repeats,
              "results": results, "same_tokens": "every variant gave ar's tokens on every prompt (asserted)",
              "mixed_set_tokens_per_s": mixed,
              "hybrid_vs_best_of_mixed_set": {v: mixed[v] / max(mixed["ngram"], mixed["sd"]) for v in ("hybrid", "hybrid-old")}}
    for r in results:
        print(f"{r['set']:10s} {r['variant']:11s} {r['tokens_per_s']:6.2f} tok/s  decode {r['decode_tokens_per_s']:6.2f}  draft rounds {r['draft_rounds']}")
    print("mixed set (sum of the sets' tok/s):", {k: round(v, 1) for k, v in mixed.items()},
          {k: round(v, 3) for k, v in report["hybrid_vs_best_of_mixed_set"].items()})
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
