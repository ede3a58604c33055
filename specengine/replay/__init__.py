"""Acceptance traces of a real pair and their replay on random weights (benchmarks only).

`record.py` records what the real pair decides on a CPU (fp32, greedy); `replay.py` makes an
engine over random weights of the same shapes decide exactly that, so a GPU run that cannot
hold the real weights still runs the real rounds (bench/gpu_e2e.py). Never used by generation
outside a benchmark: an Engine replays only after `Replay.attach`.
"""
from .replay import Replay
from .trace import Trace, TraceSet

__all__ = ["Replay", "Trace", "TraceSet"]
