"""Timing on the ground floor (imported by every layer, imports nothing of ours).

`Stopwatch`: one span's seconds with no sync inside it: CUDA events on a GPU, perf_counter on a
CPU, read after the round that holds it was synced.
`PhaseTimer`: a call's seconds per phase, its spans Stopwatches resolved when the call ends.
`best_seconds`: the one best-of-N wall-clock loop of every start-up measurement (step costs,
the batch-invariant cost, CPU matmul paths).
`CLOCK_SUFFIX`, `CURVES_SUFFIX`, `FILED`: where measured round timings and n-gram acceptance curves live in the engine's acceptance store (the
methods' round clocks and runtime/step_costs.FiledClocks, which files and seeds them, share them).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

CLOCK_SUFFIX = ":round_clock"  # a policy's round cost factors: store[key + CLOCK_SUFFIX]
CURVES_SUFFIX = ":by_match"  # the n-gram acceptance curves of a method and mode: store[f"{name}:{mode}" + CURVES_SUFFIX]
FILED = ":filed"  # what the machine's table filed for key (seeded beside the engine's own)
LEARNED = ":learned"  # PEARL's state a call leaves for the next: store[f"{name}:{mode}" + LEARNED]


class Stopwatch:
    """One span's seconds with no sync inside it: CUDA events on a GPU, read by `seconds()` only once the
    work queued after the span was synced (a round's own read); perf_counter on a CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._s = 0.0

    def __enter__(self) -> "Stopwatch":
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._s = time.perf_counter() - self._t

    def seconds(self) -> float:
        return self._start.elapsed_time(self._end) / 1e3 if self.cuda else self._s


class PhaseTimer:
    """Seconds per named phase of a call, each span a `Stopwatch`, resolved (one sync on a GPU) when the
    totals are read at the call's end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = torch.device(device).type == "cuda"
        self._spans = defaultdict(list)

    @contextmanager
    def phase(self, name: str):
        with Stopwatch(self.device) as watch:
            yield
        self._spans[name].append(watch)

    def totals(self) -> dict[str, float]:
        """Seconds spent per phase."""
        if self.cuda and self._spans:
            torch.cuda.synchronize()
        return {name: sum(w.seconds() for w in spans) for name, spans in self._spans.items()}


def best_seconds(fn, repeats: int, device=None, setup=None, best: float = float("inf"), back_to_back: int = 1) -> float:
    """The least wall time of `repeats` calls of fn() (the first call also pays one-time costs
    such as kernel selection for a new shape; the minimum drops it). On CUDA the device is
    synchronized around each call, so its queued work is timed too. setup(): untimed, before
    each call. best: a minimum so far, to extend across interleaved rounds. back_to_back: each
    time is that many calls queued between two syncs, divided by it: a call's cost as a round
    pays it when the host queues it behind other work (a draft step inside a chain), not its
    latency from an idle device (on a CPU the two are the same)."""
    sync = torch.device(device).type == "cuda" if device is not None else False
    for _ in range(repeats):
        if setup is not None:
            setup()
        if sync:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(back_to_back):
            fn()
        if sync:
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t) / back_to_back)
    return best
