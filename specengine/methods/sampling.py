"""Sampling parameters, logit filtering (top-k / top-p) and the distribution a token is drawn from.

The target distribution of a call is softmax(filter(logits) / T) with HF's order
(temperature, then top-k, then top-p). Speculative methods stay lossless because the
rejection sampler sees exactly that p and the q each draft token was sampled from.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import SpecEngineError
from ..kernels.draft_sampling import draft_sample_ref
from ..kernels.rng import tempered_softmax


FP32_MAX = torch.finfo(torch.float32).max
FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32


def check_number(name: str, value, what: str, integral: bool = False):
    """value as a Python int/float, or a SpecEngineError naming the field (bools are refused:
    True is an int to Python but never a meaningful temperature or seed)."""
    kind = numbers.Integral if integral else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise SpecEngineError(f"{name} must be {what}, got {value!r}", name)
    return int(value) if integral else float(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling parameters, validated and normalized where they are accepted.

    Every value must be representable where it is used (the samplers run in fp32): a
    temperature above fp32's maximum is refused, one below the smallest normal fp32 acts as
    its limit, greedy (dividing by a subnormal overflows); a top_p so small that it keeps no
    token keeps the most likely one (`filter_logits`).
    """
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        t = check_number("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not math.isfinite(t) or t < 0 or t > FP32_MAX:
            raise SpecEngineError(f"temperature must be a finite number >= 0 (0 = greedy) and at most fp32's "
                                  f"maximum {FP32_MAX:.4g}, got {self.temperature!r}", "temperature")
        top_k = check_number("top_k", self.top_k, "an integer >= 0 (0 = off)", integral=True)
        if top_k < 0:
            raise SpecEngineError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", "top_k")
        top_p = check_number("top_p", self.top_p, "a number in (0, 1]")
        if not 0 < top_p <= 1:  # NaN fails this too
            raise SpecEngineError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        seed = check_number("seed", self.seed, "an integer in [0, 2**63)", integral=True)
        if not 0 <= seed < 2**63:
            raise SpecEngineError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        object.__setattr__(self, "temperature", 0.0 if t < FP32_TINY else t)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Set logits outside top-k / top-p (of the tempered distribution) to -inf. [..., V]."""
    if not params.filters:
        return logits
    logits = logits.float()
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = tempered_softmax(sorted_logits, params.temperature)
        # drop a token when the mass strictly before it already reaches top_p; the most likely
        # token always stays (a top_p that rounds to 0 in fp32 would otherwise drop them all)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The (filtered, tempered) distribution a token is sampled from. [..., V] fp32."""
    return tempered_softmax(filter_logits(logits, params), params.temperature)


def sample_draft(logits: torch.Tensor, params: SamplingParams, seed, offset, pos: int, op=draft_sample_ref):
    """Draw one draft token per row from logits [B,V]: the call's filter, then `op` (the ops
    table's draft sampler, kernels/draft_sampling.py). Returns (token [B] int64, q [B,V] or
    None when greedy, q(token) [B] = the draft's confidence in its own token, used by the
    `confidence` policy)."""
    return op(filter_logits(logits, params), params.temperature, seed, offset, pos)
