"""The engine's host time per round, the part a GPU would wait for: from the moment a round's
one sync returns to the first forward of the next round (bookkeeping, the next round's
set-up, the draft's catch-up inputs), and the booking of what the round committed.

On a GPU every microsecond of that gap is idle device time once per round (the rest of a
round's launches are queued while the device is busy), so it bounds the round overhead
from below: the sd round-overhead goal is ≤ 5% of a round (issue 26). Measured on the CPU
with tiny random models (the gap does not depend on the model's size; on the CPU the
forwards run as they are launched, so only the host-only stretch between them is timed).
Not included: on CUDA the whole-chain draft graph's ~12 input copies before its replay.

    python bench/host_overhead.py --out bench/results/host_overhead_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import gpu_e2e
from specengine import Engine
from specengine import generation as G
from specengine.benchmark import environment
from specengine.runtime.runner import ModelRunner


class GapClock:
    """Wraps Generation.step and ModelRunner.verify to time (sync returned -> next forward)."""

    def __init__(self):
        self.end, self.first, self.gaps, self.book = None, True, [], []
        step, verify, book = G.Generation.step, ModelRunner.verify, G.Generation._book
        clock = self

        def timed_step(gen):
            clock.first = True
            out = step(gen)
            clock.end = time.perf_counter()
            return out

        def timed_verify(runner, *a, **kw):
            if clock.first and clock.end is not None:
                clock.gaps.append(time.perf_counter() - clock.end)
                clock.first = False
            return verify(runner, *a, **kw)

        def timed_book(gen, *a):
            t0 = time.perf_counter()
            out = book(gen, *a)
            clock.book.append(time.perf_counter() - t0)
            return out
        G.Generation.step, ModelRunner.verify, G.Generation._book = timed_step, timed_verify, timed_book


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args(argv)
    gpu_e2e.S = gpu_e2e.SMOKE  # tiny random models on the CPU
    target, draft = gpu_e2e.random_model("qwen2.5-1.5b", 0), gpu_e2e.random_model("qwen2.5-0.5b", 1)
    eng = Engine(target, gpu_e2e.NoTokenizer(), draft, max_seq_len=1024, batch_invariant=False)
    rows, clock = [], GapClock()
    for method, gamma in (("ar", None), ("sd", 2), ("sd", 4), ("sd", 6)):
        clock.gaps, clock.book = [], []
        with torch.inference_mode():
            for _ in range(3):
                clock.end = None
                eng.generate(gpu_e2e.prompts(1, 24), max_new_tokens=args.tokens, method=method, gamma=gamma,
                             ignore_eos=True)
        row = dict(provider=method if gamma is None else f"{method}:{gamma}", rounds=len(clock.book),
                   sync_to_next_forward_us=statistics.median(clock.gaps) * 1e6,
                   book_us=statistics.median(clock.book) * 1e6)
        row["host_gap_us"] = row["sync_to_next_forward_us"] + row["book_us"]  # booking runs after the sync
        rows.append(row)
        print(f"{row['provider']:6s}: sync -> next round's first forward {row['sync_to_next_forward_us']:6.1f} µs "
              f"(median of {len(clock.gaps)}), booking {row['book_us']:5.1f} µs", flush=True)
    Path(args.out).write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
