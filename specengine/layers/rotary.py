"""The once-per-step part of RoPE: each token's RoPE position (tree nodes: their depth), its
clamped write position, and cos/sin gathered there once for all layers. The per-layer part
is op `rope_kv_write` (kernels/rope_kv_write.py), which rotates q and k of the merged qkv
projection and stores k and v."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepRope:
    cos: torch.Tensor  # [B,T,D]: fp32 for the kernel (it rounds once), the model dtype for the reference
    sin: torch.Tensor
    write_pos: torch.Tensor  # [B,T] int64, lens[b] + j clamped inside the buffer

    @classmethod
    def build(cls, cache, rope_pos: torch.Tensor, write_pos: torch.Tensor, like: torch.Tensor,
              kernel: bool, local: bool = False) -> "StepRope":
        """local: the sliding-window layers' tables (`cache.rope_local`, Gemma 3)."""
        cos_t, sin_t = cache.rope_local if local else (cache.rope_cos, cache.rope_sin)
        cos, sin = cos_t[rope_pos], sin_t[rope_pos]
        if not kernel:  # cast once per step, not once per layer
            cos, sin = cos.to(like.dtype), sin.to(like.dtype)
        return cls(cos, sin, write_pos)
