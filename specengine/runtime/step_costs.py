"""Measured step costs, the inputs of every draft-length choice that is made by cost.

`sd` with `gamma="auto"` needs the draft's one-token step and the target's forward as a
function of its width (1 … γmax+1 tokens per row: on a CPU a verify of 4 tokens can cost
anything from 1x to 3x a decode step, depending on the BLAS); PEARL needs their ratio c.
Both are timed on the real models, at the call's batch size, right after prefill.
Each timed step writes K/V at positions >= cache.lens (scratch that later steps overwrite).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..timing import best_seconds


@dataclass(frozen=True)
class StepCosts:
    batch: int
    draft_s: float  # one draft step (one token per row)
    target_s: tuple[float, ...]  # target_s[w - 1]: one target forward of w tokens per row
    measured: bool = False  # timed on this machine (not pinned): rounds' measured times may correct it

    @property
    def cost_ratio(self) -> float:
        """c = draft step / target decode step (PEARL's window is round(1/c))."""
        return self.draft_s / self.target_s[0]

    def verify_s(self, width: int) -> float:
        """Target forward of `width` tokens; past the measured range, extrapolated linearly."""
        t = self.target_s
        if width <= len(t):
            return t[width - 1]
        slope = (t[-1] - t[0]) / max(len(t) - 1, 1)
        return t[-1] + slope * (width - len(t))


def forward_call(runner, state, width: int):
    """One forward of `width` tokens per row on the state's cache, as a call to time."""
    tokens = state.tokens.gather(1, state.positions(state.n - 1, width))
    return lambda: runner.verify(tokens, attn_len=state.attn_len), tokens.device


def measure_step_costs(target, draft, state, max_width: int, repeats: int = 3) -> StepCosts:
    """Each cost is the best of `repeats` times, taken in rounds over every width and the draft
    step rather than width by width: a machine whose speed drifts (a shared VM: 20-30% within
    minutes) then moves all of them alike, and their ratios, which γ is chosen by, hold.
    draft None (n-gram drafting): proposing is free, draft_s = 0."""
    calls = {w: forward_call(target, state, w) for w in range(1, max_width + 1)}
    if draft is not None:
        calls[0] = forward_call(draft, state, 1)
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for key, (fn, device) in calls.items():
            best[key] = best_seconds(fn, 1, device, best=best[key])
    return StepCosts(state.batch, best.get(0, 0.0), tuple(best[w] for w in range(1, max_width + 1)), measured=True)
