"""Token trees: shape, layout, lossless acceptance over a tree, and the accepted path's K/V.

A row's tree has node 0 = the last committed token (the root) and nodes 1..N = drafts,
each with `parent < own index` (depth-major order), so the target verifies all of it in
one forward of N+1 tokens with `ancestor_mask(parent)` as the tree mask; node j's K/V land
at slot root_slot + j. Acceptance (`tree_accept`) walks from the root: at node u it tries
u's children in order (most probable first) with the target's distribution p_u —

    accept child x with probability r(x) / sum(r)   (r starts as p_u);
    on a rejection set r(x) = 0 and try the next child;
    if no child is accepted, sample the next token from r (greedy: argmax p_u).

The candidates are a deterministic function of the context (top-k of the draft), so this
is sequential sampling from p_u: P(x) = p_u(x) exactly, whatever the draft proposed; at
temperature 0 a child is accepted iff it is the target's argmax, so the output is `ar`'s.
The accepted path's K/V then move to contiguous slots (`KVCache.compact_path`, the
compact_kv extension or its torch fallback) and the cache lengths are set: no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecEngineError
from ..kernels.rng import STREAM_ACCEPT, STREAM_SAMPLE, categorical_from_counter, counter_uniform, tempered_softmax


@dataclass(frozen=True)
class TreeShape:
    """Expand the `topk` best children of the `topk` best nodes per depth, `depth` levels,
    then keep the `budget` most probable nodes (by cumulative draft log-probability)."""
    topk: int = 4
    depth: int = 4
    budget: int | None = None  # None: every node drafted (topk * depth)

    @property
    def nodes(self) -> int:
        return min(self.budget or self.topk * self.depth, self.topk * self.depth)

    @classmethod
    def parse(cls, spec) -> "TreeShape":
        """`TreeShape`, a dict, or "KxD" / "KxD:N" (e.g. "4x5:16": top-4, depth 5, 16 nodes)."""
        if isinstance(spec, TreeShape):
            shape = spec
        elif isinstance(spec, dict):
            shape = cls(**spec)
        elif isinstance(spec, str):
            try:
                kd, _, n = spec.partition(":")
                k, d = kd.lower().split("x")
                shape = cls(int(k), int(d), int(n) if n else None)
            except ValueError:
                raise SpecEngineError(f"tree must look like 'KxD' or 'KxD:N' (e.g. '4x5:16'), got {spec!r}") from None
        else:
            raise SpecEngineError(f"tree must be a TreeShape, a dict or a 'KxD:N' string, got {type(spec).__name__}")
        if shape.topk < 1 or shape.depth < 1 or (shape.budget is not None and shape.budget < 1):
            raise SpecEngineError(f"tree topk, depth and budget must be >= 1, got {shape}")
        if shape.nodes + 1 > 256:
            raise SpecEngineError(f"a tree holds at most 255 nodes (the compaction limit), got {shape.nodes}")
        return shape


@dataclass
class TokenTree:
    tokens: torch.Tensor  # [B,N+1] int64, node 0 = the root
    parent: torch.Tensor  # [B,N+1] int64, -1 at the root
    depth: torch.Tensor  # [B,N+1] int64
    source: torch.Tensor | None = None  # [B,N+1] where the draft wrote each node's K/V (index from the root)
    draft_depth: int = 0  # nodes shallower than this have draft K/V at `source`


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """[B,N,N] bool: mask[b,i,j] = j is i or an ancestor of i (parent[b,i] < i, -1 = none)."""
    B, N = parent.shape
    rows = torch.arange(B, device=parent.device)[:, None]
    mask = torch.eye(N, dtype=torch.bool, device=parent.device).expand(B, N, N).clone()
    # in index order a node's parent row is final before the node's own row is built
    for i in range(1, N):
        p = parent[:, i].clamp(min=0)
        mask[:, i] |= mask[rows[:, 0], p] & (parent[:, i] >= 0)[:, None]
    return mask


def children_table(parent: torch.Tensor, width: int) -> torch.Tensor:
    """[B,N,width] int64: the children of every node in index order, -1 padded."""
    B, N = parent.shape
    idx = torch.arange(N, device=parent.device)
    is_child = parent[:, None, :] == idx[None, :, None]  # [B,node,candidate]
    rank = is_child.long().cumsum(-1) - 1
    table = torch.full((B, N, width + 1), -1, dtype=torch.int64, device=parent.device)
    slot = torch.where(is_child & (rank < width), rank, width)  # overflow/non-children -> spill column
    table.scatter_(2, slot, torch.where(is_child, idx[None, None, :], -1).expand(B, N, N))
    return table[..., :width]


def tree_accept(logits, tree: TokenTree, temperature, seed, offset, max_depth: int, max_children: int):
    """Lossless acceptance over a tree (the rule in the module docstring).

    logits [B,N+1,V] (filtered; row u = the target after node u); temperature [B] (0: greedy).
    Returns (tokens [B,max_depth+1]: the accepted path's tokens, then the corrected/bonus
    token, then -1; n_acc [B]; path [B,max_depth] node indices, -1 past n_acc).
    """
    B, N1, V = logits.shape
    dev = logits.device
    rows = torch.arange(B, device=dev)
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    p = tempered_softmax(logits, temp[:, None, None])
    argmax = logits.argmax(-1)  # [B,N+1]
    kids = children_table(tree.parent, max_children)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # still walking down
    end_resid = torch.zeros(B, V, device=dev)
    path = torch.full((B, max_depth), -1, dtype=torch.int64, device=dev)
    for d in range(max_depth):
        resid = p[rows, cur]
        mass = torch.ones(B, device=dev)
        nxt, moved = cur.clone(), torch.zeros(B, dtype=torch.bool, device=dev)
        row_kids = kids[rows, cur]  # [B,width]
        for r in range(max_children):
            c = row_kids[:, r]
            try_it = (c >= 0) & alive & ~moved
            x = tree.tokens.gather(1, c.clamp(min=0)[:, None]).squeeze(1)
            px = resid.gather(1, x[:, None]).squeeze(1)
            u = counter_uniform(seed, offset, c.clamp(min=0), d, STREAM_ACCEPT)
            ok = torch.where(greedy, x == argmax[rows, cur], u * mass < px) & try_it
            rejected = try_it & ~ok
            resid = resid.scatter(1, x[:, None], torch.where(rejected, 0.0, px)[:, None])
            mass = mass - torch.where(rejected, px, 0.0)
            nxt, moved = torch.where(ok, c, nxt), moved | ok
        stopped = alive & ~moved
        end_resid = torch.where(stopped[:, None], resid, end_resid)
        path[:, d] = torch.where(moved, nxt, -1)
        cur, alive = nxt, alive & moved
    end_resid = torch.where(alive[:, None], p[rows, cur], end_resid)  # walked to the deepest level: bonus
    n_acc = (path >= 0).sum(1)
    sampled = categorical_from_counter(end_resid, seed, offset, n_acc, STREAM_SAMPLE)
    last = torch.where(greedy, argmax[rows, cur], sampled)
    out = torch.where(path >= 0, tree.tokens.gather(1, path.clamp(min=0)), -1)
    out = torch.cat([out, torch.full((B, 1), -1, dtype=out.dtype, device=dev)], 1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return out, n_acc.to(torch.int32), path

