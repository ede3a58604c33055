"""Two builds of the CPU extension (`specengine._quantext`) side by side: each round runs one child
process per build, alternating, so that this VM's drift (20-30% within minutes) hits both alike.
A child measures
- the interleaved kernel per activation row count (1..16) on bench/x8_rows.py's shape, Q4_K and Q6_K;
- the real target's forward per width (1..13 tokens, the verify widths n-gram drafting uses) after
  the prefill of a copy prompt, the engine's default GGUF plan; best of --reps each.
The JSON holds each build's best over all rounds and the ratios baseline / current.

    git stash -u; make install; cp specengine/_quantext*.so /tmp/base.so; git stash pop; make install
    python bench/ext_ab.py --baseline /tmp/base.so --baseline-commit <sha> --out bench/results/cpu_ext_ab.json
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import subprocess
import sys

ROWS = range(1, 17)
WIDTHS = range(1, 14)


def load_extension(path: str) -> None:
    """Make `specengine._quantext` the build at `path` before specengine imports its own."""
    import torch  # noqa: F401  (loads libc10 and libtorch, which the build links against)

    loader = importlib.machinery.ExtensionFileLoader("specengine._quantext", path)
    spec = importlib.util.spec_from_file_location("specengine._quantext", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules["specengine._quantext"] = module


def child(reps: int) -> dict:
    import torch

    from gguf_cpu import EXT_CODES, K, N, best_ms, blocks, forward_ms
    from ngram_prompts import COPY_PROMPTS
    from specengine import Engine
    from specengine.kernels.quant_pack import pack_x8
    from specengine.models.fetch import DEFAULT_TARGET
    from specengine.models.quant_linear import _quantext

    out = {"isa": _quantext.isa(), "kernel_ms": {}}
    for qtype in ("Q4_K", "Q6_K"):
        wp, code = pack_x8(blocks(qtype), qtype), EXT_CODES[qtype]
        xs = {m: torch.randn(m, K) for m in ROWS}
        out["kernel_ms"][qtype] = [best_ms(lambda: _quantext.quant_matmul_x8(xs[m], wp, code, N), 2 * reps) for m in ROWS]
    eng = Engine.from_pretrained(DEFAULT_TARGET, max_seq_len=2048)
    runner = eng.target
    prompt = eng.tokenizer.apply_chat_template(COPY_PROMPTS[0][1], add_generation_prompt=True, return_tensors="pt")
    prompt = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    out["forward_ms"] = forward_ms(runner, prompt, WIDTHS, reps, max_len=2048)
    out["prompt_tokens"] = int(prompt.shape[1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the baseline build's .so")
    ap.add_argument("--baseline-commit", default="unknown", help="the commit the baseline was built at")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/cpu_ext_ab.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # "" (the installed build) or a .so path
    args = ap.parse_args(argv)
    if args.child is not None:
        if args.child:
            load_extension(args.child)
        print(json.dumps(child(args.reps)))
        return 0
    if not args.baseline:
        ap.error("--baseline PATH.so is required")
    from specengine.benchmark import environment, save

    runs = {"baseline": [], "current": []}
    for r in range(args.rounds):
        for name, so in (("baseline", args.baseline), ("current", "")):
            cmd = [sys.executable, __file__, "--child", so, "--reps", str(args.reps)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["forward_ms"] = {int(w): ms for w, ms in run["forward_ms"].items()}  # JSON made the keys strings
            runs[name].append(run)
            print(f"round {r + 1}/{args.rounds} {name}: width 1 / 8 / 13 "
                  + " / ".join(f"{run['forward_ms'][w]:.1f}" for w in (1, 8, 13)) + " ms", flush=True)
    best = {name: {"kernel_ms": {q: [min(run["kernel_ms"][q][i] for run in rs) for i in range(len(ROWS))]
                                 for q in rs[0]["kernel_ms"]},
                   "forward_ms": {w: min(run["forward_ms"][w] for run in rs) for w in WIDTHS}}
            for name, rs in runs.items()}
    b, c = best["baseline"], best["current"]
    report = {"benchmark": "ext_ab", "command": " ".join(["python"] + sys.argv), "environment": environment(),
              "isa": runs["current"][0]["isa"], "baseline_commit": args.baseline_commit,
              "kernel_shape": "17920 x 1536 (bench/x8_rows.py)", "rows": list(ROWS), "widths": list(WIDTHS),
              "prompt_tokens": runs["current"][0]["prompt_tokens"], "rounds": args.rounds, "best": best,
              "forward_baseline_over_current": {w: b["forward_ms"][w] / c["forward_ms"][w] for w in WIDTHS},
              "forward_x_decode": {name: {w: v["forward_ms"][w] / v["forward_ms"][1] for w in WIDTHS}
                                   for name, v in best.items()},
              "runs": runs}
    for name, v in best.items():
        print(name, "forward x decode:", " ".join(f"{w}:{v['forward_ms'][w] / v['forward_ms'][1]:.2f}" for w in WIDTHS))
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
