"""One preallocated KV buffer per model, all layers, token-major (flash-attn kvcache layout).

`kv[layer, 0|1, row, position, kv_head, head_dim]`; `lens[row]` (int32, on the device)
counts the valid positions of each row. Rolling a chain back is only lowering `lens`:
entries past a row's length are masked out of attention and overwritten later.
The RoPE tables live here too: they are static buffers of the same length.

Writes are clamped inside the buffer (a bad position can never corrupt memory) and
`high_water` records, on the device, the furthest position any forward wrote; the
driver checks it once per round, in the round's one host sync (docs/design.md, "Data
path of one round").
"""
from __future__ import annotations

import torch

from ..models.rope import rope_tables
from .kv_compact import compact_kv


class KVCache:
    def __init__(self, num_layers, batch, max_seq_len, num_kv_heads, head_dim, dtype, device, rope, rope_local=None):
        self.kv = torch.zeros(num_layers, 2, batch, max_seq_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.high_water = torch.zeros((), dtype=torch.int64, device=device)  # max position written + 1
        self.rope_cos, self.rope_sin = rope  # [max_seq_len, head_dim] fp32
        self.rope_local = rope_local  # the sliding-window layers' (cos, sin) where they differ (Gemma 3), else None

    @classmethod
    def for_model(cls, model, batch: int, max_seq_len: int) -> "KVCache":
        """A static buffer (and RoPE tables) for `model`, on its device and in its dtype."""
        c = model.config
        rope = rope_tables(c.hf_config, c.head_dim, max_seq_len, model.device)
        local = None
        if c.gemma:  # its local layers rotate with their own base
            local = rope_tables(c.hf_config, c.head_dim, max_seq_len, model.device, "sliding_attention")
        return cls(c.num_layers, batch, max_seq_len, c.num_kv_heads, c.head_dim, model.dtype, model.device, rope,
                   local)

    def rows(self, n: int) -> "KVCache":
        """A view of the first n rows (same storage, lengths and high-water mark)."""
        return self if n == self.batch else self._view(slice(0, n))

    def row(self, i: int) -> "KVCache":
        """A view of row i alone (same storage): prefilling one slot while the others decode."""
        return self._view(slice(i, i + 1))

    def _view(self, rows: slice) -> "KVCache":
        view = object.__new__(KVCache)
        view.kv, view.lens = self.kv[:, :, rows], self.lens[rows]
        view.high_water, view.rope_cos, view.rope_sin = self.high_water, self.rope_cos, self.rope_sin
        view.rope_local = self.rope_local
        return view

    @property
    def batch(self) -> int:
        return self.kv.shape[2]

    @property
    def max_seq_len(self) -> int:
        return self.kv.shape[3]

    def write_positions(self, width: int) -> torch.Tensor:
        """[B,width] positions lens[b] + j a forward of `width` tokens writes (recorded, clamped)."""
        pos = self.lens.to(torch.int64)[:, None] + torch.arange(width, device=self.lens.device)[None, :]
        torch.maximum(self.high_water, pos[:, -1].max() + 1, out=self.high_water)
        return pos.clamp(max=self.max_seq_len - 1)

    def store(self, layer: int, qkv: torch.Tensor, rope, num_heads: int, num_kv_heads: int, op,
              qk_norm=None) -> torch.Tensor:
        """The attention's write: `op` (the ops table's rope_kv_write) (norms and) rotates q and k
        of the merged projection qkv and stores k and v at the step's write positions (rope: the
        step's layers.rotary.StepRope); returns the rotated q."""
        return op(qkv, rope.cos, rope.sin, rope.write_pos, *self.layer(layer), num_heads, num_kv_heads, qk_norm)

    def compact_path(self, root_slot: torch.Tensor, source: torch.Tensor, count: torch.Tensor) -> None:
        """Tree rounds: move K/V of slots root_slot + source[b, i] to root_slot + 1 + i for
        i < count[b], every layer (the extension when built, else torch); no host sync. The
        caller sets the lengths."""
        src = root_slot[:, None] + source.clamp(min=0)
        compact_kv(self.kv, src, (root_slot + 1).to(torch.int32), count.to(torch.int32), check=False)

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
        self.high_water.zero_()
