"""What a verify of w tokens costs against a 1-token decode, ours against llama.cpp's, on the same
GGUF file, threads and context depth: the curve that bounds every speculative method on a CPU
(issue 39: the n-gram and hybrid ceilings are set by it).

- ours: the target runner's forward of w tokens after the prefill of `--depth` prompt tokens (the
  engine's default GGUF plan), best of --reps;
- llama.cpp: `llama-bench -p w -n 0 -d depth` (one batch of w tokens on a context of that depth),
  its mean over --reps.
Rounds alternate the two providers, so that this VM's drift hits both alike; each provider's best
round is kept. Ratios are each provider's forward over its own 1-token forward.

    python bench/llamacpp.py build
    python bench/verify_width_cost.py --out bench/results/cpu_verify_width_cost.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from gguf_cpu import forward_ms
from llamacpp import BUILD, build, run_tool, version
from specengine.benchmark import environment, save
from specengine.models.fetch import DEFAULT_TARGET
from specengine.models.gguf_weights import gguf_file

WIDTHS = (1, 2, 4, 8, 13, 16, 32)


def llama_ms(model: str, depth: int, widths, reps: int, threads: int) -> dict[int, float]:
    cmd = [str(BUILD / "bin" / "llama-bench"), "-m", model, "-p", ",".join(map(str, widths)), "-n", "0",
           "-d", str(depth), "-t", str(threads), "-r", str(reps), "-o", "json"]
    return {int(r["n_prompt"]): float(r["avg_ns"]) / 1e6 for r in json.loads(run_tool(cmd).stdout)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=256, help="context tokens before the timed forward")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="bench/results/cpu_verify_width_cost.json")
    args = ap.parse_args(argv)
    widths = sorted({int(w) for w in args.widths.split(",")} | {1})
    build()
    from specengine import Engine

    max_len = args.depth + max(widths) + 1
    eng = Engine.from_pretrained(DEFAULT_TARGET, max_seq_len=max_len)
    ids = torch.randint(100, 20000, (1, args.depth), generator=torch.Generator().manual_seed(0))
    model = str(gguf_file(DEFAULT_TARGET))
    best = {"ours": {}, "llama.cpp": {}}
    for r in range(args.rounds):
        for name, run in (("ours", lambda: forward_ms(eng.target, ids, widths, args.reps, max_len)),
                          ("llama.cpp", lambda: llama_ms(model, args.depth, widths, args.reps, args.threads))):
            got = run()
            print(f"round {r + 1} {name}: " + ", ".join(f"{w}: {got[w]:.1f}" for w in widths) + " ms", flush=True)
            best[name] = {w: min(got[w], best[name].get(w, float("inf"))) for w in widths}
    report = {
        "benchmark": "verify_width_cost", "command": " ".join(sys.argv), "environment": environment(),
        "llama_cpp": version(), "model": DEFAULT_TARGET, "depth": args.depth, "threads": args.threads,
        "rounds": args.rounds, "reps": args.reps, "forward_ms": best,
        "over_one_token": {k: {w: v[w] / v[1] for w in widths} for k, v in best.items()},
        "ours_over_llama_cpp": {w: best["ours"][w] / best["llama.cpp"][w] for w in widths},
    }
    for k, v in report["over_one_token"].items():
        print(k, "x 1-token:", {w: round(x, 2) for w, x in v.items()})
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
