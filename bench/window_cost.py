"""What a sliding window saves: one decode step of the registry Gemma 3 270M (GGUF blocks, the
batch-invariant CPU rows attention, which starts each query at its window) at a long context,
with its local layers reading their 512-token windows and with every layer reading the whole
context. Side by side in one run; JSON under bench/results/.

    python bench/window_cost.py [--context 3800] [--out bench/results/cpu_gemma_window.json]
"""
from __future__ import annotations

import argparse
import time

import torch

from specengine import Engine
from specengine.benchmark import environment, save


def step_ms(runner, cache, n: int, reps: int) -> float:
    token, times = torch.tensor([5]), []
    for _ in range(reps):
        cache.lens.fill_(n)
        t = time.perf_counter()
        runner.decode(token, attn_len=cache.max_seq_len)
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=3800)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="bench/results/cpu_gemma_window.json")
    args = ap.parse_args(argv)
    eng = Engine.from_pretrained("gemma-3-270m", max_seq_len=args.context + 256, weights="gguf", dtype="float32")
    runner = eng.target
    cache = runner.allocate(1, args.context + 256)
    runner.prefill(torch.randint(10, 200_000, (1, args.context)), torch.tensor([args.context]))
    windows = runner.model.config.layer_windows
    windowed = step_ms(runner, cache, args.context, args.reps)
    for layer in runner.model.layers:  # every layer global: what reading the whole context costs
        layer.self_attn.window = None
    everything = step_ms(runner, cache, args.context, args.reps)
    report = {"env": environment(), "model": "gemma-3-270m (GGUF blocks)", "attention": runner.ops.names["attention"],
              "context": args.context, "local_layers": sum(w is not None for w in windows), "window": max(
                  w for w in windows if w), "decode_ms_windowed": round(windowed, 2),
              "decode_ms_reading_everything": round(everything, 2)}
    print(report)
    save(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
