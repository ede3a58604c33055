"""Log-probabilities of the committed tokens under the target, from the logits a round already has
(no extra forward): every method hands `capture` the target's logits row that decided each out
token (a chain's verify rows, a tree's accepted path, PEARL's pre/post-verify rows, a plain
step's one row), so accepted drafts and bonus tokens alike report the target's value, never the
draft's. The driver reads the result in the round's one sync (generation.py).

Which distribution (`mode`):
  "raw" (default): log_softmax of the target's logits, the model's own distribution (what
      scoring and evaluation harnesses want; independent of the sampling options);
  "processed": the distribution the token was drawn from, after top-k / top-p and temperature
      (greedy: all mass on the argmax, so the chosen token has 0 and every other -inf).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecEngineError
from .sampling import SamplingParams, filter_logits

MODES = ("raw", "processed")


@dataclass(frozen=True)
class LogprobSpec:
    top: int  # alternatives per position, most likely first (0: the chosen token's only)
    mode: str = "raw"

    @staticmethod
    def parse(logprobs, mode: str) -> "LogprobSpec | None":
        """generate's `logprobs` (None / False: off, True: the chosen token's only, k: top k too)."""
        if mode not in MODES:
            raise SpecEngineError(f"logprobs_mode must be one of {', '.join(MODES)}, got {mode!r}", "logprobs_mode")
        if logprobs is None or logprobs is False:
            return None
        top = 0 if logprobs is True else logprobs
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise SpecEngineError(f"logprobs must be True or an integer 0..20 (alternatives per token), "
                                  f"got {logprobs!r}", "logprobs")
        return LogprobSpec(top, mode)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token, its log-probability, and the `top` most likely tokens' (id -> lp)."""
    token_id: int
    logprob: float
    top: dict[int, float]


def distribution(logits: torch.Tensor, spec: LogprobSpec, params: SamplingParams, temperature: torch.Tensor):
    """Log-probabilities [B,W,V] (fp32) of logits [B,W,V] under the spec's mode; temperature [B]."""
    logits = logits.float()
    if spec.mode == "raw":
        return torch.log_softmax(logits, -1)
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None, None]
    greedy = greedy[:, None, None]
    sampled = torch.log_softmax(filter_logits(logits, params) / temp, -1)
    point = torch.full_like(logits, float("-inf")).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    return torch.where(greedy, point, sampled)


def token_logprobs(logits, tokens, spec: LogprobSpec, params: SamplingParams, temperature) -> torch.Tensor:
    """[B,W,1+2*top] fp32: each token's log-probability, then the top values, then their ids (exact
    in fp32: ids < 2^24). tokens [B,W] may hold -1 past what a row committed (read as token 0)."""
    logp = distribution(logits, spec, params, temperature)
    chosen = logp.gather(-1, tokens.clamp(min=0).to(torch.int64)[..., None])
    if not spec.top:
        return chosen
    values, ids = logp.topk(spec.top, -1)
    return torch.cat([chosen, values, ids.float()], -1)


def capture(state, logits: torch.Tensor, tokens: torch.Tensor, scored: torch.Tensor | None = None) -> None:
    """Record the round's log-probabilities when the call asked for them: logits [B,W,V] (raw, row j
    the target's distribution for out token j), tokens [B,W] the round's out tokens; scored: the same
    rows under the call's output constraint (what "processed" reports: the distribution sampled from)."""
    if state.logprobs is not None:
        src = scored if scored is not None and state.logprobs.mode == "processed" else logits
        state.round_logprobs = token_logprobs(src, tokens, state.logprobs, state.params, state.temperature)


def entries(row: list[float], token: int, spec: LogprobSpec) -> TokenLogprob:
    """One position's TokenLogprob from its host row [1+2*top] (token_logprobs' layout)."""
    k = spec.top
    return TokenLogprob(token, row[0], {int(i): v for v, i in zip(row[1:1 + k], row[1 + k:1 + 2 * k])})
