"""`ar`: the target alone, one token per forward; the baseline every speedup is measured against.

Sampling goes through the same rejection sampler with zero drafts (a bonus token from p),
so `ar` and the speculative methods share one definition of the target distribution.
"""
from __future__ import annotations

import torch

from .sampling import filter_logits
from .base import Method
from .state import DecodeState, RoundOutput


class AutoRegressive(Method):
    name = "ar"
    needs_draft = False
    _none: tuple | None = None

    def _no_drafts(self, B: int, device):
        """([B,0] draft tokens, [B] zero draft counts), made once per batch size (nothing reads
        them for writing): two launches fewer per token."""
        cached = self._none
        if cached is None or cached[1].shape[0] != B or cached[1].device != device:
            self._none = (torch.zeros(B, 0, dtype=torch.int64, device=device),
                          torch.zeros(B, dtype=torch.int32, device=device))
        return self._none

    def round(self, state: DecodeState, timer) -> RoundOutput:
        B = state.batch
        with timer.phase("target"):
            logits = self.ctx.target.decode(state.last_tokens(), attn_len=state.attn_len)
        no_drafts, zeros = self._no_drafts(B, logits.device)
        out, n_acc = self.ctx.sampler(filter_logits(logits[:, None], state.params), no_drafts, None, zeros,
                                      state.temperature, state.seed, state.offset)
        one = n_acc + 1
        state.commit(out, one)
        return RoundOutput(out, n_acc, zeros, one, target_forwards=1)
