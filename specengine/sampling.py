"""Sampling parameters, logit filtering (top-k / top-p) and draft-token sampling.

The target distribution of a call is softmax(filter(logits) / T) with HF's order
(temperature, then top-k, then top-p). Speculative methods stay lossless because the
rejection sampler sees exactly that p and the q each draft token was sampled from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SpecEngineError
from .kernels.rng import STREAM_DRAFT, categorical_from_counter


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise SpecEngineError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecEngineError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SpecEngineError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise SpecEngineError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

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
        probs = torch.softmax(sorted_logits / params.temperature, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The (filtered, tempered) distribution a token is sampled from. [..., V] fp32."""
    return torch.softmax(filter_logits(logits, params).float() / params.temperature, dim=-1)


def sample_draft(logits: torch.Tensor, params: SamplingParams, seed, offset, pos: int):
    """Draw one draft token per row from logits [B,V].

    Returns (token [B] int64, q [B,V] or None when greedy, q(token) [B] = the draft's
    confidence in its own token, used by the `confidence` policy).
    """
    if params.greedy:
        probs = torch.softmax(logits.float(), dim=-1)
        conf, tok = probs.max(dim=-1)
        return tok, None, conf
    q = probs_of(logits, params)
    rows = torch.arange(logits.shape[0], device=logits.device)
    pos_t = torch.full_like(rows, pos)
    tok = categorical_from_counter(q, seed, offset, rows, pos_t, STREAM_DRAFT)
    return tok, q, q.gather(-1, tok[:, None]).squeeze(-1)
