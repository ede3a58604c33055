"""`make demo`: fetch the default real pair and compare `ar` with `sd` on a coding prompt."""
from __future__ import annotations

import argparse
import statistics
import time

from . import precision
from .api import Engine
from .config import parse_gamma
from .benchmark import invariant_summary
from .machine import machine
from .models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from .prompts import BUILTIN_PROMPT


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=parse_gamma, default="auto", help="draft length, or auto (measured costs)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="ar/sd pairs, interleaved")
    args = ap.parse_args(argv)

    m = machine()
    print(f"machine: {m['cpu']} ({m['isa']}), {m['threads']} threads, torch {m['torch']}")
    t = time.perf_counter()
    engine = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024, gamma=args.gamma,
                                    dtype=args.dtype)
    engine.warmup()
    dtype = precision.setting_of(engine.target.model)  # "gguf": the file's blocks, fp32 activations
    ddtype = precision.setting_of(engine.draft.model)
    print(f"target {DEFAULT_TARGET} ({dtype})  draft {DEFAULT_DRAFT} ({ddtype})  device {engine.device}  greedy  "
          f"(load + one-time measurements {time.perf_counter() - t:.1f} s)\n")
    print("prompt:\n" + BUILTIN_PROMPT)
    # interleaved and repeated: a shared VM's speed drifts by minutes, so one run of each would
    # compare two moments; the speed-up printed is the median of the pairs' ratios
    runs, ratios = {}, []
    for _ in range(args.repeats):
        for m in ("ar", "sd"):
            runs[m] = engine.generate(BUILTIN_PROMPT, max_new_tokens=args.max_new_tokens, method=m, ignore_eos=True)
        ratios.append(runs["sd"].stats["tokens_per_s"] / runs["ar"].stats["tokens_per_s"])
    for m, r in runs.items():
        print(f"----- {m} -----\n{r.text}\n")
    ar, sd = runs["ar"].stats, runs["sd"].stats
    print(f"identical tokens: {runs['ar'].token_ids == runs['sd'].token_ids}  ({dtype}; "
          f"{invariant_summary(engine.batch_invariant_info)})")
    plain = {dtype: ar["tokens_per_s"]} | best_plain_elsewhere(engine, args)
    for dt, tps in plain.items():
        print(f"ar ({dt}): {tps:.2f} tokens/s")
    best_dt = max(plain, key=plain.get)
    if best_dt == dtype:  # the same engine's ar: the median of the interleaved pairs' ratios
        speedup, versus = pairs_speedup(ratios)
    else:
        speedup, versus = sd["tokens_per_s"] / plain[best_dt], f"vs ar in {best_dt}, the fastest plain decoding here"
    print(f"sd: {sd['tokens_per_s']:.2f} tokens/s  speedup {speedup:.2f}x ({versus})  "
          f"gamma {sd['policy'] if sd['policy'] == 'auto' else sd['gamma']} (mean {sd['gamma_mean']:.2f}, "
          f"{sd.get('plain_rounds', 0)} plain rounds)  acceptance_rate {sd['acceptance_rate']:.2f}  "
          f"tokens_per_target_forward {sd['tokens_per_target_forward']:.2f}  "
          f"draft_cost_ratio {sd['draft_cost_ratio'] or 0:.2f}")


def pairs_speedup(ratios: list[float]) -> tuple[float, str]:
    """The median of the interleaved pairs' sd/ar ratios, and how it was taken. Of an even count the
    mean of the middle two (until 2026-12-02 the upper one was printed: of the default two pairs, the
    better one)."""
    return statistics.median(ratios), (f"median of {len(ratios)} interleaved ar/sd pairs: "
                                       + ", ".join(f"{r:.2f}" for r in ratios))


def best_plain_elsewhere(engine, args) -> dict:
    """{dtype: ar tokens/s} of the target in the dtype dtype "auto" measured fastest for plain
    decoding, when that is not the dtype it chose for `sd` (so the speedup printed is against the
    fastest plain decoding on this machine, not against ar in a dtype chosen for speculation)."""
    best = ((engine.dtype_choice or {}).get("best_by_method") or {}).get("ar")
    if best is None or best["target"] == precision.setting_of(engine.target.model):
        return {}
    plain = Engine.from_pretrained(DEFAULT_TARGET, max_seq_len=1024, method="ar", **precision.load_options(best["target"]))
    plain.generate(BUILTIN_PROMPT, max_new_tokens=4, ignore_eos=True)  # warm-up
    r = plain.generate(BUILTIN_PROMPT, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    return {best["target"]: r.stats["tokens_per_s"]}


if __name__ == "__main__":
    main()
