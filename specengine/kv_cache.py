"""One preallocated KV buffer per model, all layers, token-major (flash-attn kvcache layout).

`kv[layer, 0|1, row, position, kv_head, head_dim]`; `lens[row]` (int32, on the device)
counts the valid positions of each row. Rolling a chain back is only lowering `lens`:
entries past a row's length are masked out of attention and overwritten later.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers, batch, max_seq_len, num_kv_heads, head_dim, dtype, device):
        self.kv = torch.zeros(num_layers, 2, batch, max_seq_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)

    @property
    def batch(self) -> int:
        return self.kv.shape[2]

    @property
    def max_seq_len(self) -> int:
        return self.kv.shape[3]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store k/v [B,T,Hkv,D] at positions pos [B,T] of every row (no host sync)."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(pos)
        self.kv[layer, 0].index_put_((rows, pos), k)
        self.kv[layer, 1].index_put_((rows, pos), v)

    def layer(self, layer: int, length: int | None = None):
        """K and V views of one layer, optionally only the first `length` positions."""
        k, v = self.kv[layer, 0], self.kv[layer, 1]
        if length is not None:
            k, v = k[:, :length], v[:, :length]
        return k, v

    def set_lens(self, lens: torch.Tensor) -> None:
        self.lens.copy_(lens)

    def reset(self) -> None:
        self.lens.zero_()
