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
so MASK_1 sits at the next token's position in every row (steps.parallel_draft). With
`tree="KxD:N"` the one forward's per-depth distributions grow a token tree instead.
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError
from .base import CallInputs, CallTotals, Method, speculative_stats
from .context import MethodContext
from .state import DecodeState, RoundOutput
from .steps import parallel_draft, parallel_logits, positional_tree, verify_and_commit, verify_tree_and_commit


class ParallelSpec(Method):
    name = "parallelspec"

    takes_tree = True

    def __init__(self, gamma=None, policy=None, threshold=None, tree=None, defaults=None):
        super().__init__(threshold=threshold, tree=tree)
        k = 4 if gamma in (None, "auto") else gamma
        if not isinstance(k, int) or k < 1:
            raise SpecEngineError(f"parallelspec k (gamma) must be an integer >= 1, got {gamma!r}", "gamma")
        if self.tree is not None and gamma is not None:
            raise SpecEngineError("parallelspec with a tree takes its depth from the tree ('KxD:N'), not gamma",
                                  "tree")
        self.k = k if self.tree is None else self.tree.depth
        self.drafter = None

    @property
    def max_width(self) -> int:  # the draft forward: k+1 real slots and k-1 masks; a tree's verify
        return max(2 * self.k, 0 if self.tree is None else self.tree.nodes + 1)

    def begin(self, ctx: MethodContext, call: CallInputs) -> None:
        super().begin(ctx, call)
        self.drafter = ctx.parallel_drafter()
        if self.k > self.drafter.meta.k_max:
            raise SpecEngineError(f"parallelspec k={self.k} exceeds the drafter's k_max={self.drafter.meta.k_max}")

    def round(self, state: DecodeState, timer) -> RoundOutput:
        ctx, k = self.ctx, self.k
        if self.tree is not None:
            with timer.phase("draft"):
                logits = parallel_logits(ctx.draft, self.drafter, state, k, state.n, real_width=k + 1)
                tree = positional_tree(state.last_tokens(), torch.log_softmax(logits.float(), -1), self.tree)
                if ctx.replay is not None:  # the tree the real drafter built here (a benchmark's replay)
                    tree = ctx.replay.tree(state, "parallelspec", self.tree, 0)
            return verify_tree_and_commit(ctx, state, tree, self.tree, timer, draft_forwards=1)
        start = state.n.clone()
        with timer.phase("draft"):  # everything committed since the last round: 1..k+1 tokens
            drafts, q = parallel_draft(ctx, self.drafter, state, k, start, real_width=k + 1)
            num_draft = torch.full((state.batch,), k, dtype=torch.int32, device=drafts.device)
        out, n_acc = verify_and_commit(ctx, state, drafts, q, num_draft, timer)
        return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1,
                           draft_forwards=1, draft_lens=start)

    def stats(self, totals: CallTotals) -> dict:
        return {"policy": "parallel", "gamma": self.k, **self.tree_stats(), "gamma_mean": float(self.k),
                **speculative_stats(totals)}
