"""CUDA graphs for one model's forward steps, captured at warm-up over static buffers.

A graph is keyed by (batch bucket, Q bucket, attention-length bucket) and captured once,
at `ModelRunner.warmup()`, on the model's own device (nano-vllm's ModelRunner is the
pattern). All graphs of a model share:
- one static token buffer [max_batch, max Q bucket] (each graph reads a corner of it),
- one static logits buffer [max_batch, max Q bucket, V] fp32 (each graph writes a corner),
- one memory pool: intermediates are dead after each replay, so graphs reuse them.
Total memory is measured and reported (`memory_bytes`); shapes whose logits alone would
exceed `memory_limit` are not captured and run eagerly.

Padding rules (why padded work is harmless):
- Q padding: extra query columns carry token 0 at positions lens + Q .. lens + Qb - 1.
  Their K/V land past every row's length (masked, overwritten later) and no real query
  sees them (chain causality); their logits are not returned. The capacity check reserves
  room for the padded width (`padded_width`).
- batch padding: rows B..b-1 of the bucket are unused cache rows whose lengths the runner
  keeps at 0; whatever they compute is never read.
- attention-length bucket: the graph reads a fixed prefix of the cache, at least as long
  as any row needs this step; positions past a row's length are masked anyway.
Tree verification and hidden-state requests (SpecDec++, trees) have graphs of their own,
keyed also by (tree, hidden) and captured the first time such a step runs: the tree mask
is a static input ([max_batch, Q, Q]; padded nodes see only themselves, as in
`ModelRunner._padded_verify`), the hidden states a static output. A capture mid-round is
harmless: its warm-up forwards write K/V only past every row's length, where the replay
writes right after. With `lazy=True` every key is captured that way, on first use. Q above
the largest bucket, batches above the declared maximum and shapes not captured run eagerly:
the same function, the same results.
"""
from __future__ import annotations

import torch

Q_BUCKETS = (1, 2, 4, 8, 16, 32)


def q_bucket(q: int, buckets=Q_BUCKETS) -> int | None:
    """Smallest bucket >= q, or None when q is larger than every bucket."""
    return next((b for b in buckets if b >= q), None)


def padded_width(q: int, buckets=Q_BUCKETS) -> int:
    """Positions a step of q tokens may write when it runs padded to its bucket."""
    return q_bucket(q, buckets) or q


def doubling_buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """smallest, 2·smallest, 4·smallest, ... below limit, then limit itself."""
    out, b = [], smallest
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out + [limit])


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch (max_batch itself included)."""
    return doubling_buckets(max_batch)


def batch_bucket(batch: int, max_batch: int) -> int | None:
    """The batch bucket a step of `batch` rows replays at, or None above max_batch."""
    return next((b for b in batch_buckets(max_batch) if b >= batch), None)


def len_buckets(max_len: int, smallest: int = 256) -> tuple[int, ...]:
    return doubling_buckets(max_len, smallest)


def len_bucket(length: int, max_len: int, smallest: int = 256) -> int:
    """Power-of-two attention-length bucket >= length (capped at the buffer length)."""
    return next((b for b in len_buckets(max_len, smallest) if b >= length), max_len)


_CAPTURE_STREAMS: dict = {}  # (device, pool) -> the stream that pool's graphs are captured on
_RESERVED: dict = {}  # device -> raw handles of the streams held as capture or side streams


def dedicated_stream(device) -> torch.cuda.Stream:
    """A stream no other capture or side stream of this process uses. torch.cuda.Stream()
    hands out a pool of streams round robin (32 a priority), so two calls far enough apart
    return the same stream. Draws until the handle is free, the high-priority pool second;
    past both (more than 64 held) the last stream drawn is shared."""
    taken = _RESERVED.setdefault(torch.device(device), set())
    for priority in (0, -1):
        for _ in range(33):
            stream = torch.cuda.Stream(device, priority=priority)
            if stream.cuda_stream not in taken:
                taken.add(stream.cuda_stream)
                return stream
    return stream


def capture_stream(pool, device: torch.device) -> torch.cuda.Stream:
    """The capture stream of one memory pool (one per model runner, chain or graphed-call set).
    torch keys the cuBLAS workspace a captured GEMM embeds by the capture stream, so graphs
    captured on one shared stream share one workspace. PEARL replays the draft's graphs beside
    the target's on a second stream: with a shared workspace their split-K GEMMs hung on an
    H200 (docs/design.md, "Experiments"). One stream per pool gives each its own workspace, and
    that stream is never PEARL's side stream (`dedicated_stream`)."""
    key = (torch.device(device), pool)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = dedicated_stream(device)
    return _CAPTURE_STREAMS[key]


_captured = 0  # graphs captured in this process (`capture_graph`)


def capture_graph(capture, fn, pool, device):
    """capture(fn, pool, device), counted: a round that captured a graph paid a one-time cost (two
    eager runs and the capture, tens of ms on a GPU) that Generation.step keeps off the round clock.
    On the first H200 run γ auto learned a probe's captures as the cost of drafting (3.9x its model)
    and decoded plainly at 0.89x `ar` where γ 4 ran 1.24-1.43x."""
    global _captured
    _captured += 1
    return capture(fn, pool, device)


def captures() -> int:
    return _captured


def cuda_capture(fn, pool, device: torch.device):
    """Capture fn() into a CUDA graph on `device` (warm-up on a side stream first, as torch
    requires: allocations, lazy initialization and Triton autotuning happen there, never
    inside the capture), on its pool's own capture stream."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(pool, device)):
            fn()
    return graph


class GraphRunner:
    """Replays captured forwards of one model; `usable` says when a step has a graph.

    forward(tokens [b, qb], rows b, attn_len, tree_mask=None, return_hidden=False) -> logits
    [b, qb, V] (and hidden states) is the runner's eager forward over the first b cache rows.
    `capture(fn, pool, device) -> graph with replay()` is CUDA-graph capture on a GPU; tests
    pass a stand-in with the same contract.
    """

    def __init__(self, forward, device: torch.device, vocab_size: int, max_batch: int, max_seq_len: int,
                 capture=None, q_buckets=Q_BUCKETS, memory_limit: int = 2 << 30, lazy: bool = False):
        self.forward, self.device, self.vocab_size = forward, device, vocab_size
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.capture = capture or cuda_capture
        self.q_buckets, self.memory_limit, self.lazy = q_buckets, memory_limit, lazy
        self.graphs: dict[tuple, object] = {}  # (batch, Q, length, tree, hidden) buckets
        self.skipped: list[tuple] = []
        self.replays = 0
        self.memory_bytes = 0
        self.batch_sizes, self.lengths = batch_buckets(max_batch), len_buckets(max_seq_len)
        qmax = q_buckets[-1]
        self.tokens = torch.zeros(max_batch, qmax, dtype=torch.int64, device=device)
        self.logits = torch.zeros(max_batch, qmax, vocab_size, dtype=torch.float32, device=device)
        self.mask = torch.zeros(max_batch, qmax, qmax, dtype=torch.bool, device=device)  # tree steps
        self.hidden: torch.Tensor | None = None  # [max_batch, qmax, H]: the runner allocates it
        # one memory pool for every graph of this model, however and whenever it is captured
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.forward_drafter = None  # (drafter, tokens, mask_index, tree, rows, attn_len) -> logits
        self._drafter_buffers: dict[int, dict] = {}  # static inputs/outputs per drafter width T
        self._fns: dict[tuple, object] = {}

    def capture_all(self) -> None:
        """Capture every (batch, Q, length) bucket, largest first so smaller graphs reuse the
        pool's memory; measure what the graphs hold."""
        on_cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        keys = [(b, q, n, False, False) for b in self.batch_sizes for q in self.q_buckets for n in self.lengths]
        for key in sorted(keys, key=lambda k: (k[0] * k[1], k[2]), reverse=True):
            self._capture(key)
        after = torch.cuda.memory_reserved(self.device) if on_cuda else 0
        self.memory_bytes = after - before + self.tokens.nbytes + self.logits.nbytes + self.mask.nbytes

    def _capture(self, key: tuple) -> bool:
        b, q = key[:2]
        if 2 * b * q * self.vocab_size * 4 > self.memory_limit:  # logits + their fp32 cast
            self.skipped.append(key)
            return False
        self.graphs[key] = capture_graph(self.capture, self._step(*key), self.pool, self.device)
        return True

    def _step(self, b: int, q: int, n: int, tree: bool, hidden: bool):
        tokens, logits, mask = self.tokens[:b, :q], self.logits[:b, :q], self.mask[:b, :q, :q] if tree else None

        def step():
            out = self.forward(tokens, b, n, tree_mask=mask, return_hidden=hidden)
            if hidden:
                logits.copy_(out[0])
                self.hidden[:b, :q].copy_(out[1])
            else:
                logits.copy_(out)
        return step

    def usable(self, tokens: torch.Tensor, tree_mask, return_hidden: bool, attn_len: int | None = None):
        """The key of the captured graph that runs this step (capturing a tree / hidden-state
        graph the first time one is needed), or None (run it eagerly)."""
        B, Q = tokens.shape
        qb, bb = q_bucket(Q, self.q_buckets), batch_bucket(B, self.max_batch)
        if qb is None or bb is None:
            return None
        key = (bb, qb, self._len_bucket(attn_len), tree_mask is not None, bool(return_hidden))
        first_use = self.lazy or key[3] or (key[4] and self.hidden is not None)  # captured when first needed
        if key not in self.graphs and first_use and key not in self.skipped:
            self._capture(key)
        return key if key in self.graphs else None

    def drafter(self, drafter, tokens: torch.Tensor, mask_index: torch.Tensor, tree: torch.Tensor,
                attn_len: int | None):
        """The parallel drafter's forward (tokens, mask_index [B,T], tree [B,T,T]) replayed from
        a graph per (batch bucket, T, length bucket, drafter), captured on first use; logits
        [B,T,V], or None when it does not fit (run it eagerly). Padding rows get token 0, no
        masks and a diagonal tree."""
        B, T = tokens.shape
        b = batch_bucket(B, self.max_batch)
        if b is None or 2 * b * T * self.vocab_size * 4 > self.memory_limit:
            return None
        n = self._len_bucket(attn_len)
        key = ("drafter", b, T, n, id(drafter))
        static = self._drafter_buffers.get(T)
        if static is None:
            bm, dev = self.max_batch, self.device
            static = self._drafter_buffers[T] = dict(
                tokens=torch.zeros(bm, T, dtype=torch.int64, device=dev),
                mask_index=torch.zeros(bm, T, dtype=torch.int64, device=dev),
                tree=torch.eye(T, dtype=torch.bool, device=dev).repeat(bm, 1, 1),
                logits=torch.zeros(bm, T, self.vocab_size, dtype=torch.float32, device=dev))
        eye = torch.eye(T, dtype=torch.bool, device=self.device)
        static["tokens"][B:b].zero_()
        static["mask_index"][B:b].zero_()
        static["tree"][B:b].copy_(eye)
        static["tokens"][:B].copy_(tokens)
        static["mask_index"][:B].copy_(mask_index)
        static["tree"][:B].copy_(tree.to(torch.bool).expand(B, T, T))
        if key not in self.graphs:
            self._fns[key] = step = self._drafter_step(drafter, static, b, n)  # kept alive with its graph
            self.graphs[key] = capture_graph(self.capture, step, self.pool, self.device)
        self.graphs[key].replay()
        self.replays += 1
        return static["logits"][:B]

    def _len_bucket(self, attn_len: int | None) -> int:
        return len_bucket(attn_len or self.max_seq_len, self.max_seq_len)

    def _drafter_step(self, drafter, static: dict, b: int, n: int):
        def step():
            static["logits"][:b].copy_(self.forward_drafter(drafter, static["tokens"][:b], static["mask_index"][:b],
                                                            static["tree"][:b], b, n))
        return step

    def __call__(self, tokens: torch.Tensor, key: tuple, tree_mask: torch.Tensor | None = None):
        """Replay the graph `usable` chose for these tokens; logits [B,Q,V] (views of the shared
        buffers), with the hidden states [B,Q,H] for a hidden-state key."""
        B, Q = tokens.shape
        b, q = key[:2]
        if (B, Q) != (b, q):  # padded rows / columns feed token 0
            self.tokens[:b, :q].zero_()
        self.tokens[:B, :Q].copy_(tokens)
        if key[3]:  # padded nodes and rows see only themselves
            self.mask[:b, :q, :q].copy_(torch.eye(q, dtype=torch.bool, device=self.device))
            self.mask[:B, :Q, :Q].copy_(tree_mask.to(torch.bool).expand(B, Q, Q))
        self.graphs[key].replay()
        self.replays += 1
        if key[4]:
            return self.logits[:B, :Q], self.hidden[:B, :Q]
        return self.logits[:B, :Q]
