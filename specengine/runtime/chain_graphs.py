"""One CUDA graph for a whole chain draft: the catch-up forward, γ−1 decode steps and the
γ draft samplings, replayed as a single launch (docs/design.md, "Model runner and CUDA
graphs"). Per-step graphs still pay a launch, a copy into the static token buffer and a
Python round trip per draft token; here the draft of a round is one replay.

A graph is keyed by (batch bucket, γ, attention-length bucket, sampling parameters) and
captured on the first round that needs it (a capture is two eager runs plus the capture;
the chain is idempotent: it sets the draft's lengths from a static input before feeding, so
the warm-up runs leave the same state the replay does). Static inputs: the token buffer,
the draft's length before the round, the length to reach, seeds and the round's offset;
the 2-token catch-up feed is computed from them inside the replay (by the caller's `feed`
function), so a round launches five copies and one replay. Padding rows (B..b−1) are
unused cache rows: their lengths are 0 before and after each replay, so they never hold
anything another call could read.
"""
from __future__ import annotations

import torch

from .graphs import batch_bucket, batch_buckets, capture_graph, cuda_capture, len_bucket, len_buckets


class DraftChainGraphs:
    def __init__(self, runner, max_gamma: int = 16, capture=None):
        self.runner, self.capture = runner, capture or cuda_capture
        buf = runner._buffer
        self.max_batch, self.max_seq_len, self.max_gamma = buf.batch, buf.max_seq_len, max_gamma
        dev, V, bm = runner.device, runner.config.vocab_size, buf.batch
        self.tokens = torch.zeros(bm, self.max_seq_len, dtype=torch.int64, device=dev)
        self.seen = torch.zeros(bm, dtype=torch.int32, device=dev)
        self.upto = torch.zeros(bm, dtype=torch.int32, device=dev)
        self.seed = torch.zeros(bm, dtype=torch.int64, device=dev)
        self.offset = torch.zeros(bm, dtype=torch.int64, device=dev)
        self.toks = torch.zeros(bm, max_gamma, dtype=torch.int64, device=dev)
        self.confs = torch.zeros(bm, max_gamma, dtype=torch.float32, device=dev)
        self.q = None  # [bm, max_gamma, V] fp32, allocated on the first sampled capture
        self.vocab = V
        self.rows = torch.arange(bm, device=dev)
        self.graphs: dict[tuple, object] = {}
        self._fns: dict[tuple, object] = {}  # the captured closures, kept alive with their graphs
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.replays = 0

    def key(self, batch: int, gamma: int, attn_len: int | None, params) -> tuple | None:
        b = batch_bucket(batch, self.max_batch)
        if b is None or gamma > self.max_gamma:
            return None
        n = len_bucket(attn_len or self.max_seq_len, self.max_seq_len)
        return b, gamma, n, (params.temperature, params.top_k, params.top_p)  # seeds are an input

    def _chain(self, b: int, gamma: int, n: int, params, sampler, feed):
        # every tensor the graph reads is an attribute of self: a graph holds raw pointers, and a
        # tensor local to this closure would be freed (and its memory reused) after the capture
        runner, buf, rows = self.runner, self.runner._buffer.rows(b), self.rows[:b]

        def chain():
            buf.lens.copy_(self.seen[:b])  # the catch-up feeds the unseen tokens from there
            tok2, which = feed(self.tokens[:b], self.seen[:b], self.upto[:b])
            logits = runner._forward_rows(tok2, b, n)[rows, which]
            buf.lens.copy_(self.upto[:b])
            for j in range(gamma):
                if j:
                    logits = runner._forward_rows(self.toks[:b, j - 1:j], b, n)[:, 0]
                    buf.lens.add_(1)
                tok, q, conf = sampler(logits, params, self.seed[:b], self.offset[:b], j)
                self.toks[:b, j].copy_(tok)
                self.confs[:b, j].copy_(conf)
                if q is not None:
                    self.q[:b, j].copy_(q)
        return chain

    def prepare(self, sampler, feed, gammas, params) -> int:
        """Capture now, for `params`, the graphs of every batch bucket, γ in `gammas` and length
        bucket (Engine.warmup), so that no call captures one mid-round: a probe's captures were
        its cost on the first H200 run (docs/design.md, "The first GPU runs"). Each chain runs as
        the padding rows of `run` do (catch-up at 0 to length 1: scratch K/V); every length ends
        at 0. Returns how many it captured."""
        before = len(self.graphs)
        for b in batch_buckets(self.max_batch):
            self.seen[:b].zero_()
            self.upto[:b].fill_(1)
            for gamma in gammas:
                for n in len_buckets(self.max_seq_len):
                    key = self.key(b, gamma, n, params)
                    if key is not None:
                        self._graph(key, params, sampler, feed)
        self.runner._buffer.lens.zero_()
        return len(self.graphs) - before

    def _graph(self, key: tuple, params, sampler, feed):
        """The graph of `key`, captured on first need (its closure kept alive beside it)."""
        graph = self.graphs.get(key)
        if graph is None:
            fn = self._fns[key] = self._chain(*key[:3], params, sampler, feed)
            graph = self.graphs[key] = capture_graph(self.capture, fn, self.pool, self.runner.device)
        return graph

    def run(self, state, sampler, feed, gamma: int, seen, upto):
        """The chain `methods.steps.draft_chain` would compute with the draft `sampler` (tokens
        [B,γ], q [B,γ,V] | None, confs [B,γ]), from one graph replay; None when no graph fits
        (then the caller runs it eagerly). feed(tokens, seen, upto) -> (the catch-up's 2 tokens
        [B,2], which of their logits continues [B]) runs inside the replay; seen: the draft's
        length [B], upto: the length to reach [B]."""
        B = state.batch
        key = self.key(B, gamma, state.attn_len, state.params)
        if key is None or state.tokens.shape[1] != self.max_seq_len:
            return None
        b = key[0]
        if not state.params.greedy and self.q is None:
            self.q = torch.zeros(self.max_batch, self.max_gamma, self.vocab, dtype=torch.float32,
                                 device=self.runner.device)
        self.tokens[:B].copy_(state.tokens)
        self.seen[:B].copy_(seen)
        self.upto[:B].copy_(upto)
        self.seed[:B].copy_(state.seed)
        self.offset[:B].copy_(state.offset)
        if b > B:  # padding rows: catch-up at 0 to length 1, lengths end at γ; reset after
            self.seen[B:b].zero_()
            self.upto[B:b].fill_(1)
        self._graph(key, state.params, sampler, feed).replay()
        self.replays += 1
        if b > B:
            self.runner._buffer.lens[B:b].zero_()
        # copies: the static outputs are overwritten by the next replay (PEARL keeps drafts a round)
        q = None if state.params.greedy else self.q[:B, :gamma].clone()
        return self.toks[:B, :gamma].clone(), q, self.confs[:B, :gamma].clone()
