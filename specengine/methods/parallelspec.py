"""`parallelspec`: a parallel drafter proposes k tokens in ONE draft forward (arXiv 2410.05589).

One round: the draft reads its unseen committed tokens (1 .. k+1 of them: everything
committed since the last round) followed by MASK_1 .. MASK_{k-1}; the last real token's
logits propose d1 and MASK_i's propose d_{i+1}, each sampled from its own q. The target
verifies [last committed, d1..dk] in one forward and the existing rejection sampler accepts
a prefix (lossless: greedy exact, sampling with the drafter's own q). The draft cache keeps
exactly the committed tokens: masks and unused slots lie past its length.

Rows have different numbers of unseen tokens, so the draft forward is a tree over k+1 real
slots and k-1 masks: a real slot sees the real slots before it; a mask sees the row's
valid real slots and the masks before it. Positions follow from the tree (a node's depth),
so MASK_1 sits at the next token's position in every row.
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError
from .base import Method, speculative_stats
from .common import DecodeState, RoundOutput
from .sd import verify_and_commit
from .trees import positional_tree, verify_tree_and_commit


def drafter_layout(unseen: torch.Tensor, k: int, real_width: int | None = None):
    """(mask_index [B,T], tree_mask [B,T,T]) for `real_width` real slots (default k+1) then
    k-1 masks, T = real_width + k - 1."""
    W = k + 1 if real_width is None else real_width
    B, T = unseen.shape[0], W + k - 1
    dev = unseen.device
    j = torch.arange(T, device=dev)
    mask_index = torch.where(j >= W, j - W + 1, 0).expand(B, T)
    causal = j[None, :] <= j[:, None]  # [T,T]
    is_mask = (j >= W)
    real_ok = j[None, :] < unseen[:, None]  # [B,T] valid real slots (as keys)
    # real query rows: causal over the real slots; mask query rows: valid real slots + earlier masks
    real_rows = causal & ~is_mask[None, :]
    mask_rows = (real_ok[:, None, :] & ~is_mask[None, None, :]) | (causal & is_mask[None, :])[None]
    tree = torch.where(is_mask[None, :, None], mask_rows, real_rows[None])
    return mask_index, tree


def parallel_logits(draft, drafter, state: DecodeState, k: int, upto: torch.Tensor, real_width: int):
    """Logits [B,k,V] of the k proposals continuing state.tokens[:, :upto], from ONE draft
    forward over the row's unseen tokens (1..real_width) then the masks; afterwards the
    draft cache holds exactly tokens[:, :upto]."""
    seen = draft.cache.lens.to(torch.int64)
    unseen = (upto - seen).clamp(1, real_width)
    real = state.tokens.gather(1, state.positions(seen, real_width))
    tokens = torch.cat([real, torch.zeros_like(real[:, : k - 1])], 1)
    mask_index, tree = drafter_layout(unseen, k, real_width)
    logits = draft.drafter_forward(drafter, tokens, mask_index, tree, attn_len=state.attn_len)
    draft.cache.set_lens(upto)
    masks = real_width + torch.arange(k - 1, device=logits.device)[None, :].expand(state.batch, k - 1)
    at = torch.cat([(unseen - 1)[:, None], masks], 1)  # d1 from the last real slot, d2.. from the masks
    return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))


def parallel_draft(draft, drafter, state: DecodeState, k: int, upto: torch.Tensor, real_width: int):
    """k draft tokens per row [B,k] continuing state.tokens[:, :upto] in ONE draft forward,
    and their q [B,k,V] (None if greedy)."""
    logits = parallel_logits(draft, drafter, state, k, upto, real_width)
    toks, qs = [], []
    for i in range(k):
        tok, q, _ = state.draft_sampler(logits[:, i].contiguous(), state.params, state.seed, state.offset, i)
        toks.append(tok), qs.append(q)
    return torch.stack(toks, 1), None if state.params.greedy else torch.stack(qs, 1)


class ParallelSpec(Method):
    name = "parallelspec"

    takes_tree = True

    def __init__(self, engine, gamma=None, policy=None, threshold=None, tree=None):
        super().__init__(engine, threshold=threshold, tree=tree)
        k = 4 if gamma in (None, "auto") else gamma
        if not isinstance(k, int) or k < 1:
            raise SpecEngineError(f"parallelspec k (gamma) must be an integer >= 1, got {gamma!r}")
        if self.tree is not None and gamma is not None:
            raise SpecEngineError("parallelspec with a tree takes its depth from the tree ('KxD:N'), not gamma")
        self.k = k if self.tree is None else self.tree.depth
        self.drafter = None

    @property
    def max_width(self) -> int:  # the draft forward: k+1 real slots and k-1 masks; a tree's verify
        return max(2 * self.k, 0 if self.tree is None else self.tree.nodes + 1)

    def begin(self, generation) -> None:
        self.drafter = self.engine.parallel_drafter()
        if self.k > self.drafter.meta.k_max:
            raise SpecEngineError(f"parallelspec k={self.k} exceeds the drafter's k_max={self.drafter.meta.k_max}")

    def round(self, state: DecodeState, timer) -> RoundOutput:
        draft, k = self.engine.draft, self.k
        if self.tree is not None:
            with timer.phase("draft"):
                logits = parallel_logits(draft, self.drafter, state, k, state.n, real_width=k + 1)
                tree = positional_tree(state.last_tokens(), torch.log_softmax(logits.float(), -1), self.tree)
            return verify_tree_and_commit(self.engine, state, tree, self.tree, timer, draft_forwards=1)
        start = state.n.clone()
        with timer.phase("draft"):  # everything committed since the last round: 1..k+1 tokens
            drafts, q = parallel_draft(draft, self.drafter, state, k, start, real_width=k + 1)
            num_draft = torch.full((state.batch,), k, dtype=torch.int32, device=drafts.device)
        out, n_acc = verify_and_commit(self.engine, state, drafts, q, num_draft, timer)
        return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1,
                           draft_forwards=1, draft_lens=start)

    def stats(self, generation) -> dict:
        return {"policy": "parallel", "gamma": self.k, **self.tree_stats(), "gamma_mean": float(self.k),
                **speculative_stats(generation, generation.timer.totals())}
