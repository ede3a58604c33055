"""CUDA graphs for the model's forward steps, captured per shape bucket, over static buffers.

A step is keyed by (batch, Q bucket, attention-length bucket). Inputs are copied into
static buffers, the graph is replayed, and the logits are read from a static output.
Padding rules (why padded work is harmless):
- Q padding: extra query columns carry token 0 at positions cache.lens + Q .. lens + Qb - 1.
  Their K/V land past every row's length (masked, overwritten later) and no real query
  sees them (chain causality); their logits are dropped. The caller's capacity check
  reserves room for the padded width (`padded_width`).
- attention-length bucket: the graph reads a fixed prefix of the cache, at least as long
  as any row needs this step; positions past a row's length are masked anyway.
Shapes without a graph (Q above the largest bucket, a tree mask, hidden states asked for,
CPU tensors, or `enabled=False`) run eagerly: the same function, the same results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Q_BUCKETS = (1, 2, 4, 8, 16, 32)


def q_bucket(q: int, buckets=Q_BUCKETS) -> int | None:
    """Smallest bucket >= q, or None when q is larger than every bucket."""
    return next((b for b in buckets if b >= q), None)


def padded_width(q: int, buckets=Q_BUCKETS) -> int:
    """Positions a step of q tokens may write when it runs padded to its bucket."""
    return q_bucket(q, buckets) or q


def len_bucket(length: int, max_len: int, smallest: int = 256) -> int:
    """Power-of-two attention-length bucket >= length (capped at the buffer length)."""
    b = smallest
    while b < length:
        b *= 2
    return min(b, max_len)


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph, or a callable replay for tests
    tokens: torch.Tensor  # static input [B, Qb]
    logits: torch.Tensor  # static output [B, Qb, V]


def cuda_capture(fn, tokens: torch.Tensor, pool=None):
    """Capture fn(tokens) into a CUDA graph (warm-up on a side stream first, as torch requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(tokens)
    return graph, out


class GraphRunner:
    """Replays captured forwards of one model; eager fallback for everything else.

    `capture(fn, static_tokens, pool) -> (replayable, static_out)` is torch.cuda.graph
    capture on GPU; tests pass a stand-in that keeps the same static-buffer contract.
    """

    def __init__(self, model, enabled: bool = True, capture=None, buckets=Q_BUCKETS):
        self.model = model
        self.buckets = buckets
        self.capture = capture or cuda_capture
        self.enabled = enabled
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.replays = 0

    def usable(self, tokens: torch.Tensor, tree_mask, return_hidden: bool) -> bool:
        on_device = tokens.is_cuda or self.capture is not cuda_capture
        return (self.enabled and on_device and tree_mask is None and not return_hidden
                and q_bucket(tokens.shape[1], self.buckets) is not None)

    def reset(self) -> None:
        """Drop the graphs (the KV buffer they point at was reallocated)."""
        self.graphs.clear()
        self.pool = None

    def __call__(self, tokens: torch.Tensor, attn_len: int | None) -> torch.Tensor:
        B, Q = tokens.shape
        qb = q_bucket(Q, self.buckets)
        lb = len_bucket(attn_len or self.model.cache.max_seq_len, self.model.cache.max_seq_len)
        key = (B, qb, lb)
        g = self.graphs.get(key)
        if g is None:
            static = torch.zeros(B, qb, dtype=tokens.dtype, device=tokens.device)
            static[:, :Q] = tokens
            if self.pool is None and tokens.is_cuda:
                self.pool = torch.cuda.graph_pool_handle()  # one memory pool for all of them
            graph, out = self.capture(lambda t: self.model.forward(t, attn_len=lb), static, self.pool)
            g = self.graphs[key] = _Graph(graph, static, out)
        g.tokens.zero_()
        g.tokens[:, :Q] = tokens
        g.graph.replay()
        self.replays += 1
        return g.logits[:, :Q]
