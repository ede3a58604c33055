"""What the samplers' torch references share: counter-based random numbers (a hash of
seed, offset, position, index, stream), the exponential race that samples with them, and
the tempered softmax they sample from. `jit.py` is the Triton side of the same numbers.

No generator state, so results are reproducible and safe inside a captured CUDA graph, and
the Triton kernels (`jit.counter_uniform`) compute the very same numbers.

Seeds and offsets are per row and the row's index is not hashed: a row's numbers depend on
its own seed and round only, never on where it sits in a batch. So a request decodes the
same tokens alone, at any row of a batch, or in a serving slot it was admitted to late
(docs/design.md, "Random numbers"); rows that should differ need different seeds
(`Generation` gives row b of a call the seed `seed + b`).
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


def counter_uniform(seed, offset, pos, idx, stream: int) -> torch.Tensor:
    """Uniform float32 in (0, 1) from integer counters (broadcasting int64 tensors)."""
    h = _mix32(seed ^ (stream * 0x9E3779B9))
    h = _mix32(h ^ (seed >> 32))
    h = _mix32(h ^ offset)
    h = _mix32(h ^ pos)
    h = _mix32(h ^ idx)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def row_offsets(offset, rows: int) -> torch.Tensor:
    """The per-row round offsets [rows] int64 (a scalar offset applies to every row)."""
    return torch.as_tensor(offset).to(torch.int64).expand(rows)


def categorical_from_counter(probs: torch.Tensor, seed, offset, pos, stream: int) -> torch.Tensor:
    """Sample from unnormalized `probs[N, V]` by the exponential race argmax(p / E), E ~ Exp(1);
    seed, offset, pos: [N] (offset may be a scalar)."""
    idx = torch.arange(probs.shape[-1], device=probs.device)
    offset = row_offsets(offset, probs.shape[0])
    u = counter_uniform(seed[:, None], offset[:, None], pos[:, None], idx[None, :], stream)
    return torch.argmax(probs / -torch.log(u), dim=-1)


def tempered_softmax(logits: torch.Tensor, temperature) -> torch.Tensor:
    """softmax(logits / T) over the last dim in fp32, as softmax((l - max) / T): the same
    distribution, but finite for every T > 0 (l / T overflows fp32 when T is tiny). The
    Triton samplers compute it the same way. temperature: a number, or a tensor that
    broadcasts against logits[..., :1]."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row stays masked
    return torch.softmax((x - m) / temperature, dim=-1)


def row_seeds(seed: int, rows: int, device) -> torch.Tensor:
    """Row b of a call samples with seed + b (mod 2**63): rows differ, and each row is the
    call `generate(prompt_b, seed=seed + b)` on its own (kernels/rng.py)."""
    return torch.tensor([(seed + b) % 2**63 for b in range(rows)], dtype=torch.int64, device=device)
