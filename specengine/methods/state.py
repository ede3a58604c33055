"""State shared by every decoding method during one generate call, and the commit step.

Invariant at the start of each round: every model's cache holds the committed tokens
except the last one (`cache.lens = n - 1`), so a round always starts by feeding the
last committed token. Everything here stays on the device; the driver syncs once per
round to read what was committed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.commit_tokens import commit_tokens_ref
from .sampling import SamplingParams


def buffer_positions(start: torch.Tensor, width: int, size: int) -> torch.Tensor:
    """[B,width] token-buffer positions start[b] + j, clamped inside a buffer of `size` (rows at
    the end of their capacity read/write the last slot, never out of range)."""
    j = torch.arange(width, device=start.device)[None, :]
    return (start.to(torch.int64)[:, None] + j).clamp(max=size - 1)


@dataclass
class DecodeState:
    tokens: torch.Tensor  # [B,S] int64, committed tokens (prompt + generated) per row
    n: torch.Tensor  # [B] int64, committed count per row
    active: torch.Tensor  # [B] bool, rows still generating (finished rows are frozen)
    params: SamplingParams
    temperature: torch.Tensor  # [B] fp32 (0 = greedy)
    seed: torch.Tensor  # [B] int64, per row (kernels/rng.py: a row's numbers never depend on its index)
    offset: torch.Tensor  # [B] int64, the row's round: bumped every round, fresh random numbers
    attn_len: int | None = None  # host bound on positions any step reads this round
    commit_op: Callable = commit_tokens_ref  # the ops table's (kernels/commit_tokens.py)
    logprobs: object = None  # a LogprobSpec when the call wants log-probabilities (methods/logprobs.py)
    round_logprobs: torch.Tensor | None = None  # [B,W,1+2k]: this round's, aligned with its out tokens
    constraints: object = None  # structured.RowConstraints when some row is constrained: masks target logits

    def constrain(self, logits: torch.Tensor, following=None) -> torch.Tensor:
        """Target logits [B,W,V] masked by each row's constraint, position i after the committed tokens
        and following[:, :i] (structured/rows.py); unchanged without constraints."""
        return logits if self.constraints is None else self.constraints.mask_chain(logits, following)

    def read_ahead(self, *tensors):
        """Under a constraint, host copies of what the mask walk will read (the drafts), started
        before the verify is queued (structured.rows.HostCopy); otherwise the tensors themselves."""
        if self.constraints is None:
            return tensors if len(tensors) > 1 else tensors[0]
        copies = tuple(self.constraints.read_ahead(t) for t in tensors)
        return copies if len(copies) > 1 else copies[0]

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    def positions(self, start: torch.Tensor, width: int) -> torch.Tensor:
        return buffer_positions(start, width, self.tokens.shape[1])

    def last_tokens(self) -> torch.Tensor:
        return self.tokens.gather(1, (self.n - 1)[:, None]).squeeze(1)

    def commit(self, out_tokens: torch.Tensor, n_new: torch.Tensor) -> None:
        """Append out_tokens[b, :n_new[b]] to the active rows and move to fresh random numbers."""
        self.commit_op(self.tokens, self.n, self.offset, self.active, out_tokens, n_new)


@dataclass
class RoundOutput:
    """What a round committed (device tensors), read by the driver in one sync."""
    tokens: torch.Tensor  # [B,K+1] accepted drafts, then the corrected/bonus token, then -1
    n_acc: torch.Tensor  # [B] accepted draft tokens
    num_draft: torch.Tensor  # [B] proposed draft tokens
    n_committed: torch.Tensor  # [B] tokens appended this round (n_acc + 1 unless a bonus is withheld)
    target_forwards: int = 1
    draft_forwards: int = 0
    draft_lens: torch.Tensor | None = None  # [B] the draft cache's valid length after the round
