"""N-gram drafting on input-grounded work, in one run on the real pair (issue 39; `make bench-ngram`).

Two prompt sets, every provider side by side on each: prompts that copy their input
(specengine/prompts.py, COPY_PROMPTS: type hints, docstrings, a bug fix, answers and a summary from a
passage) and the HumanEval prompts, where little is copied. Providers: transformers `generate`
and its prompt lookup (`prompt_lookup_num_tokens=10`, fp32 float weights), our `ar`, n-gram
chains (γ 10 as transformers, and auto), an n-gram tree, the draft model (`sd` γ auto) and the
hybrid. Greedy; ours in the engine's default setting (weights and dtype "auto").
Ratios (the issue's goals) come from the same run.

Whole replies by default: every provider stops at EOS (up to 512 new tokens), as a user's edit
or answer does. `--fixed-length` is the earlier protocol: exactly 128 tokens, EOS ignored, which
cuts an edit short and times what the model writes after its reply ends.

    python bench/ngram_cpu.py --out bench/results/cpu_ngram.json [--fixed-length] [--humaneval 2]
"""
from __future__ import annotations

import argparse
import sys

from specengine.prompts import COPY_PROMPTS

from specengine import Engine
from specengine.benchmark import run_benchmark, save
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.models.loading import resolve

PROVIDERS = ["ar", "hf", "hf-lookup", "ngram:10", "ngram:auto", "ngram[tree=4x6:16]", "sd:auto", "hybrid:auto"]


def rate(report: dict, provider: str, key: str = "tokens_per_s") -> float:
    return next(r[key] for r in report["results"] if r["provider"] == provider)


def goals(copy: dict, code: dict, key: str = "tokens_per_s") -> dict:
    """The issue's figures from this run: tokens/s with prefill (every provider has it), or
    key="decode_tokens_per_s", ours with prefill left out (the HF ratio has no such figure)."""
    ngrams = ("ngram:10", "ngram:auto", "ngram[tree=4x6:16]")
    best_ngram = max(rate(copy, p, key) for p in ngrams)
    mixed = {p: rate(copy, p, key) + rate(code, p, key) for p in ("ngram:auto", "sd:auto", "hybrid:auto")}
    out = {
        "ngram_vs_ar_on_copy_prompts": best_ngram / rate(copy, "ar", key),
        "hybrid_vs_best_of_draft_and_ngram_mixed_set": mixed["hybrid:auto"] / max(mixed["sd:auto"], mixed["ngram:auto"]),
        "ngram_auto_vs_ar_on_humaneval": rate(code, "ngram:auto", key) / rate(code, "ar", key),
    }
    if key == "tokens_per_s":
        out["ngram_vs_hf_prompt_lookup"] = max(rate(copy, p) for p in ngrams) / rate(copy, "hf-lookup")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_ngram.json")
    ap.add_argument("--fixed-length", action="store_true",
                    help="exactly --max-new-tokens a prompt (default 128), EOS ignored: the earlier protocol")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="at most this many new tokens a prompt (default 512 whole replies, 128 --fixed-length)")
    ap.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts in the second set")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help="a subset for a quick look (the goals need every default provider)")
    args = ap.parse_args(argv)
    providers = args.providers.split(",")
    max_new = args.max_new_tokens or (128 if args.fixed_length else 512)
    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=2048)
    common = dict(target_path=resolve(DEFAULT_TARGET), draft_path=resolve(DEFAULT_DRAFT), baseline="ar",
                  max_new_tokens=max_new, stop_at_eos=not args.fixed_length)
    copy = run_benchmark(eng, providers, **common,
                         prompts=("input-grounded (specengine/prompts.py, COPY_PROMPTS)", [p for _, p in COPY_PROMPTS]))
    code = run_benchmark(eng, providers, n_prompts=args.humaneval, **common)
    report = {"benchmark": "ngram_cpu", "command": " ".join(["python"] + sys.argv), "copy": copy,
              "humaneval": code, "copy_prompt_kinds": [k for k, _ in COPY_PROMPTS],
              "protocol": "fixed length, EOS ignored" if args.fixed_length else "whole replies (stop at EOS)"}
    if set(PROVIDERS) <= set(providers):
        report["goals"], report["goals_decode_only"] = goals(copy, code), goals(copy, code, "decode_tokens_per_s")
    for name, rep in (("input-grounded", copy), ("HumanEval", code)):
        print(name, {r["provider"]: round(r["tokens_per_s"], 2) for r in rep["results"]}, flush=True)
    for name in ("goals", "goals_decode_only") if "goals" in report else ():
        print(name, {k: round(v, 2) for k, v in report[name].items()})
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
