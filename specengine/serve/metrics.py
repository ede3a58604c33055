"""Prometheus text-format metrics of the server (GET /metrics)."""
from __future__ import annotations

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        self.sum, self.count = self.sum + x, self.count + 1
        for i, b in enumerate(self.buckets):
            if x <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
