"""Counter-based random numbers: a hash of (seed, offset, row, position, index, stream).

No generator state, so results are reproducible, independent per row and safe inside a
captured CUDA graph, and a Triton kernel (`rng_triton.py`) computes the very same numbers.
Used on the hot path (draft sampling) and by the sampler references.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Streams keep the draws of different purposes independent.
STREAM_ACCEPT, STREAM_SAMPLE, STREAM_DRAFT = 1, 2, 3


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on uint32 values held in int64 (wrapping products, then masked)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def counter_uniform(seed, offset, row, pos, idx, stream: int) -> torch.Tensor:
    """Uniform float32 in (0, 1) from integer counters (broadcasting int64 tensors)."""
    h = _mix32(seed ^ (stream * 0x9E3779B9))
    h = _mix32(h ^ (seed >> 32))
    h = _mix32(h ^ offset)
    h = _mix32(h ^ row)
    h = _mix32(h ^ pos)
    h = _mix32(h ^ idx)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def categorical_from_counter(probs: torch.Tensor, seed, offset, row, pos, stream: int) -> torch.Tensor:
    """Sample from unnormalized `probs[N, V]` by the exponential race argmax(p / E), E ~ Exp(1)."""
    idx = torch.arange(probs.shape[-1], device=probs.device)
    u = counter_uniform(seed[:, None], offset, row[:, None], pos[:, None], idx[None, :], stream)
    return torch.argmax(probs / -torch.log(u), dim=-1)
