"""What the compiled layer stack (models/cpu_stack.py) saves per forward, on the real GGUF pair.

Providers, interleaved round robin in one run so that drift hits each alike: `stack` (the layers in
one C++ call), `python` (the same layers through decoder.py's loop), and `matmuls` (only the
quantized matmuls of one forward, called back to back on the model's own weights: the floor the
other ops sit on). Each is timed as one forward of 1 token (decode) and of 5 tokens (a γ 4 verify)
after a prompt, for the target and the draft; best of --reps. Then `ar` and `sd` (γ auto),
greedy, with and without the stack; the tokens must be equal.

    python bench/cpu_stack.py --out bench/results/cpu_stack.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from specengine import Engine
from specengine.benchmark import environment, save
from specengine.models import cpu_stack
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.models.quant_linear import EXT_CODES, _quantext, extension_isa, quant_layers

PROMPT = "Write a Python function that parses a CSV file and returns the rows as dictionaries."


def matmuls_only(model, rows: int):
    """Every quantized matmul of one forward of `rows` tokens, called directly."""
    calls = [(torch.randn(rows, layer.in_features), w, EXT_CODES[q], n)
             for layer in quant_layers(model) for (q, w), n in zip(layer.stored(), layer.packed)]

    def run():
        for x, w, code, n in calls:
            _quantext.quant_matmul(x, w, code) if n is None else _quantext.quant_matmul_x8(x, w, code, n)
    return run


def forward_fn(runner, width: int, stacked: bool):
    tokens = torch.ones(1, width, dtype=torch.int64)
    real = cpu_stack.run

    def run():
        cpu_stack.run = real if stacked else (lambda *a: None)
        try:
            runner.verify(tokens, attn_len=int(runner.cache.lens.max()) + width)
        finally:
            cpu_stack.run = real
    return run


@torch.inference_mode()
def forwards(eng, reps: int) -> dict:
    prompt = eng.tokenizer(PROMPT, return_tensors="pt").input_ids
    out = {}
    for role, runner in (("target", eng.target), ("draft", eng.draft)):
        runner.allocate(1, 1024)
        runner.prefill(prompt, torch.tensor([prompt.shape[1]]))
        for width in (1, 5):
            fns = {"stack": forward_fn(runner, width, True), "python": forward_fn(runner, width, False),
                   "matmuls": matmuls_only(runner.model, width)}
            best = {k: float("inf") for k in fns}
            for _ in range(reps):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t)
            out[f"{role} width {width}"] = {k: v * 1e3 for k, v in best.items()}
            print(f"{role} width {width}: " + "  ".join(f"{k} {v * 1e3:6.2f} ms" for k, v in best.items()),
                  file=sys.stderr)
    return out


def generation(eng, reps: int, new: int) -> tuple[dict, bool]:
    real, rates, tokens = cpu_stack.run, {}, {}
    eng.generate(PROMPT, max_new_tokens=8, ignore_eos=True, method="sd")  # measures sd's step costs once
    for _ in range(reps):
        for stacked in (True, False):
            cpu_stack.run = real if stacked else (lambda *a: None)
            try:
                for method in ("ar", "sd"):
                    s = eng.generate(PROMPT, max_new_tokens=new, ignore_eos=True, method=method)
                    st = s.stats
                    key = f"{method} {'stack' if stacked else 'python'}"
                    rates.setdefault(key, []).append((st["new_tokens"] - 1) / (st["wall_time_s"] - st["prefill_s"]))
                    tokens.setdefault(method, set()).add(str(s.token_ids))
            finally:
                cpu_stack.run = real
    return {k: {"best": max(v), "runs": v} for k, v in rates.items()}, all(len(v) == 1 for v in tokens.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--gen-reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/cpu_stack.json")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, weights="gguf")
    report = {"environment": environment(), "isa": extension_isa(), "command": " ".join(["python"] + sys.argv),
              "prompt": PROMPT, "forward_ms_best": forwards(eng, args.reps)}
    report["decode_tokens_per_s"], same = generation(eng, args.gen_reps, args.max_new_tokens)
    report["same_tokens_with_and_without"] = same
    save(report, args.out)
    for k, v in report["decode_tokens_per_s"].items():
        print(f"{k:12s} best {v['best']:6.2f} decode tok/s")
    print("same tokens with and without the stack:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
