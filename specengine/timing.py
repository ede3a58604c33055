"""Per-phase timers that never sync inside a step: CUDA events on GPU, perf_counter on CPU.

Events are resolved once, when the totals are read at the end of a call.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._cpu = defaultdict(float)
        self._events = defaultdict(list)

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            t = time.perf_counter()
            yield
            self._cpu[name] += time.perf_counter() - t

    def totals(self) -> dict[str, float]:
        """Seconds spent per phase."""
        out = dict(self._cpu)
        if self._events:
            torch.cuda.synchronize()
            for name, pairs in self._events.items():
                out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs) / 1e3
        return out
