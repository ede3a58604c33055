"""`ar`: the target alone, one token per forward; the baseline every speedup is measured against.

Sampling goes through the same rejection sampler with zero drafts (a bonus token from p),
so `ar` and the speculative methods share one definition of the target distribution.
"""
from __future__ import annotations

from .base import Method
from .state import DecodeState, RoundOutput
from .steps import PlainStep


class AutoRegressive(Method):
    name = "ar"
    needs_draft = False
    one_token_rounds = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.step = PlainStep()

    def round(self, state: DecodeState, timer) -> RoundOutput:
        return self.step(self.ctx, state, timer)
