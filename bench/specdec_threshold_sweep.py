"""Choose SpecDec++'s default threshold on held-out text, not on the evaluation prompts.

Prompts are the starts of held-out files of the head's training corpus (files of the
recipe's packages whose path hash puts them in the `val` split, which training never reads),
so HumanEval stays untouched until the benchmark.
Every threshold runs the same prompts in one process; the fastest becomes the default
(`methods/policies.py`, DEFAULT_SPECDEC_THRESHOLD).

    python bench/specdec_threshold_sweep.py --out bench/results/cpu_specdec_threshold_sweep.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from specengine import Engine
from specengine.drafting.acceptance_head import default_head_path
from specengine.benchmark import environment


def heldout_prompts(report_path: Path, n: int, chars: int) -> list[str]:
    import random

    from specengine.training.head import python_corpus

    recipe = json.loads(report_path.read_text())["recipe"]
    val = [text for meta, text in python_corpus(recipe["packages"], recipe["val_fraction"])
           if meta.split == "val" and len(text) >= chars and "__init__" not in meta.path]
    random.Random(0).shuffle(val)
    return [t[:chars] for t in val[:n]]


def head_cost(engine, reps: int = 50) -> dict:
    """Median seconds of one head call and of one draft decode step (batch 1), same process."""
    import statistics

    import torch

    head = engine.acceptance_head("greedy")
    h = torch.randn(1, engine.draft.model.config.hidden_size)
    tok = torch.zeros(1, 1, dtype=torch.int64)
    engine.draft.allocate(1, 64)

    def median(fn, n):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    with torch.inference_mode():
        t_head = median(lambda: head.accept_prob(h), reps * 4)
        t_draft = median(lambda: engine.draft.verify(tok), reps)
    return {"head_s": t_head, "draft_step_s": t_draft, "head_fraction_of_draft_step": t_head / t_draft}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--thresholds", default="0.1,0.2,0.3,0.4,0.5,0.7")
    ap.add_argument("--gamma", type=int, default=8, help="the budget (k_max)")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.from_pretrained(args.target, draft=args.draft, dtype="float32")
    head = default_head_path(engine.draft.model.config, "greedy")
    prompts = heldout_prompts(head.with_suffix(".json"), args.n_prompts, 600)
    ids = [engine.encode(p)[0][0] for p in prompts]
    engine.generate(ids[0], max_new_tokens=4, method="sd", policy="specdec++", gamma=args.gamma, ignore_eos=True)
    cost = head_cost(engine)
    print(cost)
    rows = []
    for th in [float(t) for t in args.thresholds.split(",")]:
        wall = new = 0
        gm = []
        for p in tqdm(ids, desc=f"h={th}", leave=False):
            t = time.perf_counter()
            r = engine.generate(p, max_new_tokens=args.max_new_tokens, method="sd", policy="specdec++",
                                gamma=args.gamma, threshold=th, ignore_eos=True)
            wall += time.perf_counter() - t
            new += len(r.token_ids)
            gm.append(r.stats["gamma_mean"])
        rows.append({"threshold": th, "tokens_per_s": new / wall, "gamma_mean": sum(gm) / len(gm)})
        print(rows[-1])
    best = max(rows, key=lambda r: r["tokens_per_s"])
    report = {"benchmark": "specdec_threshold_sweep", "prompts": f"{len(ids)} held-out corpus files, first 600 chars",
              "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "head": str(head.name),
              "environment": environment(), "head_cost": cost, "results": rows,
              "best_threshold": best["threshold"]}
    print(f"best threshold {best['threshold']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
