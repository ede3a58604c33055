"""A draft model on its own device (PEARL with two GPUs: `draft_device=`).

The engine keeps every per-call tensor on the target's device. This adapter moves the
draft's inputs to its device and its outputs back; the copies are device-to-device and
asynchronous (no host sync), so the draft GPU works while the target GPU does.
"""
from __future__ import annotations

import torch


class _CacheView:
    """The draft's KV cache as the engine sees it: lengths on the engine's device."""

    def __init__(self, cache, home: torch.device):
        self._cache, self._home = cache, home

    @property
    def lens(self) -> torch.Tensor:
        return self._cache.lens.to(self._home, non_blocking=True)

    def set_lens(self, lens: torch.Tensor) -> None:
        self._cache.set_lens(lens.to(self._cache.lens.device, non_blocking=True))

    def __getattr__(self, name):
        return getattr(self._cache, name)


class CrossDeviceDraft:
    """Wraps the ModelRunner of a model on another device; same entry points as the runner."""

    def __init__(self, runner, home: torch.device):
        self.runner, self.home = runner, torch.device(home)
        self.config, self.model = runner.config, runner.model
        self.cache = None

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def allocate(self, batch: int, max_seq_len: int):
        self.cache = _CacheView(self.runner.allocate(batch, max_seq_len), self.home)
        return self.cache

    def _call(self, fn, tokens, **kw):
        out = fn(tokens.to(self.device, non_blocking=True), **kw)
        if isinstance(out, tuple):  # (logits, hidden)
            return tuple(t.to(self.home, non_blocking=True) for t in out)
        return out.to(self.home, non_blocking=True)

    def prefill_row(self, row: int, tokens, length: int, start: int = 0) -> None:
        self.runner.prefill_row(row, tokens.to(self.runner.device), length, start=start)

    def prefill(self, tokens, lens, attn_len=None):
        return self.runner.prefill(tokens.to(self.device), lens.to(self.device), attn_len=attn_len).to(self.home)

    def verify(self, tokens, tree_mask=None, attn_len=None, return_hidden=False):
        mask = None if tree_mask is None else tree_mask.to(self.device)
        return self._call(self.runner.verify, tokens, tree_mask=mask, attn_len=attn_len, return_hidden=return_hidden)

    def decode(self, token, attn_len=None, return_hidden=False):
        return self._call(self.runner.decode, token, attn_len=attn_len, return_hidden=return_hidden)
