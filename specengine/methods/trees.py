"""Tree rounds for `sd` and `parallelspec` (`tree="KxD:N"`): draft a token tree, verify it in
one target forward, accept a root path losslessly, compact its K/V (specengine/tree.py).

Tree drafting keeps K nodes per depth (a beam over cumulative draft log-probability, the
EAGLE-2 rule): depth 1 is the draft's top-K after the root; depth d+1 is the best K of the
K×K children of depth d's nodes; finally the N most probable nodes are kept (a child
never scores above its parent, so the kept set is closed under ancestors).
  - autoregressive draft: depth d+1's candidates come from one draft forward over every
    node drafted so far as a tree (widths K, 2K, ..., (D−1)K). Re-feeding the earlier
    levels keeps the attention contract (a tree over the new tokens only); node j's draft
    K/V lands at root_slot + j, so the accepted path is compacted in the draft cache too.
  - parallel drafter: one draft forward gives every depth's distribution at once (the
    last real token, then MASK_1..), so depth d+1's candidates are the same top-K under
    every node; the draft cache keeps the committed tokens only, nothing to compact.
Candidates are the draft's top-K (not samples), which is what lets `tree_accept` be
lossless without the draft's q.
"""
from __future__ import annotations

import torch

from ..sampling import filter_logits
from ..tree import TokenTree, TreeShape, ancestor_mask, compact_path, tree_accept
from .common import DecodeState, RoundOutput
from .sd import draft_catch_up


class _Beam:
    """Nodes drafted so far, K per depth, as lists of [B,K] columns (root first)."""

    def __init__(self, root: torch.Tensor, K: int):
        B = root.shape[0]
        self.K = K
        self.tokens, self.parent = [root[:, None]], [torch.full((B, 1), -1, dtype=torch.int64, device=root.device)]
        self.score, self.depth = [torch.zeros(B, 1, device=root.device)], [torch.zeros_like(self.parent[0])]

    @property
    def size(self) -> int:
        return sum(t.shape[1] for t in self.tokens)

    def grow(self, logq: torch.Tensor) -> None:
        """Add the next depth from the draft's log-probs after each frontier node [B,F,V]."""
        B, F, _ = logq.shape
        first = self.size - F  # index of the first frontier node
        cand, tok = logq.float().topk(self.K, -1)  # [B,F,K]
        total = (self.score[-1][:, :, None] + cand).reshape(B, F * self.K)
        best, flat = total.topk(min(self.K, F * self.K), -1)
        self.tokens.append(tok.reshape(B, F * self.K).gather(1, flat))
        self.parent.append(first + flat // self.K)
        self.score.append(best)
        self.depth.append(self.depth[-1][:, :1] + 1 + torch.zeros_like(flat))

    def all(self):
        cat = lambda xs: torch.cat(xs, 1)  # noqa: E731
        return cat(self.tokens), cat(self.parent), cat(self.score), cat(self.depth)

    def tree(self, budget: int, draft_depth: int) -> TokenTree:
        """The `budget` most probable nodes (ties: shallower first), re-indexed depth-major."""
        tokens, parent, score, depth = self.all()
        B, n = tokens.shape
        if budget >= n - 1:
            return TokenTree(tokens, parent, depth, torch.arange(n, device=tokens.device).expand(B, n), draft_depth,
                             score)
        order = torch.sort(-score[:, 1:], dim=1, stable=True).indices[:, :budget] + 1
        kept = torch.cat([torch.zeros_like(order[:, :1]), torch.sort(order, 1).values], 1)  # [B,N+1] old ids
        new_id = torch.zeros(B, n, dtype=torch.int64, device=tokens.device)
        new_id.scatter_(1, kept, torch.arange(budget + 1, device=tokens.device).expand(B, budget + 1))
        old_parent = parent.gather(1, kept)
        new_parent = torch.where(old_parent >= 0, new_id.gather(1, old_parent.clamp(min=0)), -1)
        return TokenTree(tokens.gather(1, kept), new_parent, depth.gather(1, kept), kept, draft_depth,
                         score.gather(1, kept))


def draft_tree(draft, state: DecodeState, shape: TreeShape) -> TokenTree:
    """A tree from the autoregressive draft: D−1 draft forwards after the catch-up."""
    logits = draft_catch_up(draft, state, state.n)  # the draft now holds the root at slot n-1
    beam = _Beam(state.last_tokens(), shape.topk)
    beam.grow(torch.log_softmax(logits.float(), -1)[:, None])
    for _ in range(shape.depth - 1):
        tokens, parent, _, _ = beam.all()
        out = draft.verify(tokens[:, 1:], tree_mask=ancestor_mask(parent)[:, 1:, 1:], attn_len=state.attn_len)
        F = beam.tokens[-1].shape[1]
        beam.grow(torch.log_softmax(out[:, -F:].float(), -1))
    return beam.tree(shape.nodes, draft_depth=shape.depth)


def positional_tree(root: torch.Tensor, logq: torch.Tensor, shape: TreeShape) -> TokenTree:
    """A tree from per-depth draft log-probs [B,D,V] that do not depend on the parent (the
    parallel drafter's one forward): depth d+1's candidates are position d's top-K."""
    beam = _Beam(root, shape.topk)
    for d in range(shape.depth):
        F = beam.tokens[-1].shape[1]
        beam.grow(logq[:, d: d + 1].expand(-1, F, -1))
    return beam.tree(shape.nodes, draft_depth=0)  # the draft keeps committed tokens only


def verify_tree_and_commit(engine, state: DecodeState, tree: TokenTree, shape: TreeShape, timer, draft_forwards):
    """One target forward over the tree, lossless acceptance, K/V compaction, commit."""
    start = state.n.clone()
    with timer.phase("target"):
        logits = engine.target.verify(tree.tokens, tree_mask=tree.mask(), attn_len=state.attn_len)
    out, n_acc, path = tree_accept(filter_logits(logits, state.params), tree, state.temperature, state.seed,
                                   state.offset, shape.depth, shape.topk)
    root_slot = start - 1
    compact_path(engine.target.cache, root_slot, path, n_acc)
    draft_lens = start  # the parallel drafter's cache holds the committed tokens only
    if tree.draft_depth:  # the draft wrote the nodes shallower than draft_depth at root_slot + source
        fed = n_acc.to(torch.int64).clamp(max=tree.draft_depth - 1)
        compact_path(engine.draft.cache, root_slot, tree.source.gather(1, path.clamp(min=0)), fed)
        draft_lens = start + fed
    state.commit(out, n_acc + 1)
    num_draft = torch.full_like(n_acc, shape.depth)  # per-depth acceptance: alpha_d = P(depth d | d-1)
    return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1, draft_forwards=draft_forwards,
                       draft_lens=draft_lens)
