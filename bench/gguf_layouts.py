"""What the interleaved GGUF layout (kernels/quant_pack.py) gains end to end, in one run on this CPU.

The real pair with weights="gguf" (fp32 activations), one engine; its Q4_K / Q6_K layers switched
between three holdings, interleaved round robin so that drift hits each alike: every packable
segment interleaved ("all", what the measured choice takes on the CPUs tried so far), Q4_K only,
and the file's rows ("none", the previous kernel). `ar` and `sd` (γ auto), greedy, EOS ignored;
tokens/s over prefill + decode, best and every repeat; the tokens of each holding must equal
the file-rows ones (the layouts share one integer arithmetic).

    python bench/gguf_layouts.py --out bench/results/cpu_gguf_layouts.json
"""
from __future__ import annotations

import argparse
import sys
import time

from specengine import Engine
from specengine.benchmark import environment, save
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.models.quant_linear import extension_isa, quant_layers

HOLDINGS = {"all": ("Q4_K", "Q6_K"), "q4_k only": ("Q4_K",), "none (file rows)": ()}
PROMPT = "Write a Python function that parses a CSV file and returns the rows as dictionaries."


def hold(layers, formats) -> None:
    for layer in layers:
        for i, q in enumerate(layer.qtypes):
            layer.pack_segment(i, q in formats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/results/cpu_gguf_layouts.json")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, weights="gguf")
    layers = quant_layers(eng.target.model) + quant_layers(eng.draft.model)
    runs, tokens = {}, {}
    for rep in range(args.reps):
        for name, formats in HOLDINGS.items():
            hold(layers, formats)
            for method in ("ar", "sd"):
                t = time.perf_counter()
                out = eng.generate(PROMPT, max_new_tokens=args.max_new_tokens, ignore_eos=True, method=method)
                runs.setdefault(f"{name} / {method}", []).append(args.max_new_tokens / (time.perf_counter() - t))
                tokens.setdefault(method, {})[name] = out.token_ids
                print(f"rep {rep + 1}/{args.reps}  {name:18s} {method}: {runs[f'{name} / {method}'][-1]:.2f} tok/s",
                      file=sys.stderr)
    same = all(len({str(v) for v in by.values()}) == 1 for by in tokens.values())
    report = {"environment": environment(), "isa": extension_isa(), "command": " ".join(["python"] + sys.argv),
              "prompt": PROMPT, "max_new_tokens": args.max_new_tokens,
              "tokens_per_s_incl_prefill": {k: {"best": max(v), "runs": v} for k, v in runs.items()},
              "same_tokens_in_every_holding": same}
    save(report, args.out)
    for k, v in runs.items():
        print(f"{k:28s} best {max(v):6.2f} tok/s")
    print("same tokens in every holding:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
