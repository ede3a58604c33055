"""ModelRunner: runs one model. It owns the model's KV buffer, its ops table (which kernel
or reference every op of a forward takes: kernels/ops.py) and its CUDA graphs; the model
itself stays a plain module (docs/design.md, "Layers").

Entry points mirror the engine's needs: `allocate` (a static buffer for a call's batch),
`prefill`, `decode`, `verify` (chain or tree); all write K/V at `cache.lens[b] + j` and
return logits; callers set `cache.lens` (rollback is lowering it). On CUDA with graphs on,
the buffer is allocated for `max_batch` rows and every (batch, Q, length) bucket is
captured when the buffer is allocated (`warmup`), never in the middle of a generation;
with `lazy=True` a bucket is captured the first time a step needs it instead (only the
shapes a workload uses: what a torch.compile'd `graph_model` wants, one compile per shape).
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError
from ..kernels.ops import Ops, resolve
from .chain_graphs import DraftChainGraphs
from .graphed_calls import GraphedCalls
from .graphs import Q_BUCKETS, GraphRunner, cuda_capture, len_buckets
from .invariance import BatchInvariance
from .kv_cache import KVCache


class ModelRunner:
    def __init__(self, model, kernels="auto", cuda_graphs: bool = True, max_batch: int = 1,
                 capture=None, graph_memory_limit: int = 2 << 30):
        self.model, self.config = model, model.config
        self.max_batch, self.graph_memory_limit = max_batch, graph_memory_limit
        self._buffer: KVCache | None = None  # the whole allocation (>= the call's rows)
        self.cache: KVCache | None = None  # the rows of the current call
        self.graphs: GraphRunner | None = None
        self._warmed: KVCache | None = None  # the buffer warm-up (autotune, graphs) last ran on
        self._chain: DraftChainGraphs | None = None
        self._calls: GraphedCalls | None = None  # a round's own device functions (graphed)
        self.chain_graph = True  # as a draft: one graph for a whole chain (False: a graph per step)
        self.use_graphs, self.capture, self.lazy_graphs = False, None, False
        self.graph_model = model  # what captured steps run (set_graph_model); prefill runs `model`
        self.invariance = BatchInvariance(self)  # batch-invariant mode: off until configured
        self.set_kernels(kernels)
        self.set_cuda_graphs(cuda_graphs, capture)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # ------------------------------------------------------------------ configuration
    def set_kernels(self, kernels="auto") -> None:
        """The `kernels` switch (kernels/ops.py; or an Ops) resolved on this runner's device into
        `normal_ops`; `ops` is what forwards run: the same table, with batch-invariant
        mode's attention when the mode is on. Captured graphs baked the old ops."""
        self.normal_ops = kernels if isinstance(kernels, Ops) else resolve(kernels, self.device)
        self.invariance.select()

    @property
    def invariant_width(self) -> int | None:
        """Batch-invariant mode's widest target forward (None: the mode is off)."""
        return self.invariance.width

    def spawn(self, model) -> "ModelRunner":
        """An eager runner of its own over `model` with this one's attention (probes and
        measurements use one, so this runner's buffer and graphs stay as they are)."""
        return ModelRunner(model, self.normal_ops, cuda_graphs=False)

    def drop_graphs(self) -> None:
        """Forget the captured graphs (the ops or the mode changed): the next
        allocation warms up and captures anew."""
        self.graphs = self._warmed = self._chain = self._calls = None

    def set_cuda_graphs(self, enabled: bool = True, capture=None, lazy: bool = False) -> None:
        """Replay captured graphs for decode/verify (CUDA; `capture` stands in on CPU in tests).
        lazy: capture each bucket when a step first needs it, not all of them at warm-up."""
        use = enabled and (self.device.type == "cuda" or capture is not None)
        if (use, capture, lazy) != (self.use_graphs, self.capture, self.lazy_graphs):
            self.drop_graphs()
        self.use_graphs, self.capture, self.lazy_graphs = use, capture, lazy
        self.invariance.select(self.invariance.choice)  # graphs replay at bucket row counts: re-probe

    def set_graph_model(self, module=None) -> None:
        """The module captured steps run: e.g. `torch.compile(model)`, the gpt-fast recipe inside
        our graphs (use with lazy graphs: one compile per shape a workload uses). It must compute
        what the model does, from the same weights; None restores the model. Prefill and steps
        that run eagerly keep the model."""
        self.graph_model = self.model if module is None else module
        self.drop_graphs()

    # ------------------------------------------------------------------ buffers and graphs
    def allocate(self, batch: int, max_seq_len: int) -> KVCache:
        """The KV buffer for a call of `batch` rows (reused when it fits), lengths reset."""
        self.invariance.ensure(batch)
        rows = max(batch, self.max_batch) if self.use_graphs else batch
        buf = self._buffer
        stale = buf is None or buf.batch < rows or buf.max_seq_len != max_seq_len or buf.kv.dtype != self.dtype \
            or buf.kv.device != self.device
        if stale or (buf.kv.is_inference() and not torch.is_inference_mode_enabled()):  # can't write those here
            self._buffer = KVCache.for_model(self.model, rows, max_seq_len)
            self.drop_graphs()  # they point at the old buffer; warm-up captures anew
        self._buffer.reset()  # every row, padded graph rows included, starts at length 0
        self.cache = self._buffer.rows(batch)
        if self._warmed is not self._buffer and (self.use_graphs or self.device.type == "cuda"):
            self.warmup()
        return self.cache

    def warmup(self) -> None:
        """Before any generation on this buffer: run every (Q, length) bucket once, so Triton
        autotunes here (its keys are shapes that never change per call), then capture every
        bucket's graph when graphs are on. Never during a capture or inside a round. Lazy graphs
        skip both: a capture's own warm-up runs autotune its shape."""
        buf, lazy = self._buffer, self.use_graphs and self.lazy_graphs
        tokens = torch.zeros(1, Q_BUCKETS[-1], dtype=torch.int64, device=self.device)
        for q in () if lazy else Q_BUCKETS:
            for n in {len_buckets(buf.max_seq_len)[0], buf.max_seq_len}:  # short: no KV split; long: split
                self._forward_rows(tokens[:, :q], 1, n)
        if self.use_graphs:
            self.graphs = GraphRunner(self._forward_rows, self.device, self.config.vocab_size, self.max_batch,
                                      buf.max_seq_len, capture=self.capture, memory_limit=self.graph_memory_limit,
                                      lazy=lazy)
            self.graphs.hidden = torch.zeros(self.max_batch, Q_BUCKETS[-1], self.config.hidden_size,
                                             dtype=self.dtype, device=self.device)
            self.graphs.forward_drafter = self._drafter_rows
            if not lazy:
                self.graphs.capture_all()
        buf.reset()
        self._warmed = buf

    def chain_graphs(self) -> DraftChainGraphs | None:
        """Whole-chain draft graphs over this buffer (None when graphs are off)."""
        if not (self.use_graphs and self.chain_graph and self.graphs is not None):
            return None
        if self._chain is None:
            self._chain = DraftChainGraphs(self, capture=self.capture)
        return self._chain

    def graphed(self, name: str, fn, *args):
        """fn(*args) for a pure device function of a round (tree acceptance, tree masks): from a
        CUDA graph when graphs are on (runtime/graphed_calls.py), else called directly."""
        if not self.use_graphs:
            return fn(*args)
        if self._calls is None:
            self._calls = GraphedCalls(self.capture or cuda_capture, self.device)
        return self._calls(name, fn, *args)

    def _forward_rows(self, tokens, rows: int, attn_len: int, tree_mask=None, return_hidden=False):
        return self.graph_model(tokens, self._buffer.rows(rows), self.ops, tree_mask=tree_mask,
                                attn_len=attn_len, return_hidden=return_hidden)

    def _drafter_rows(self, drafter, tokens, mask_index, tree, rows: int, attn_len: int):
        return drafter(tokens, mask_index, self._buffer.rows(rows), self.ops, tree, attn_len=attn_len)

    # ------------------------------------------------------------------ forwards
    def drafter_forward(self, drafter, tokens, mask_index, tree, attn_len=None):
        """A parallel drafter's forward over this (draft) runner's cache -> logits [B,T,V]:
        replayed from a graph when graphs are on, else eager (the same results)."""
        if self.graphs is not None:
            out = self.graphs.drafter(drafter, tokens, mask_index, tree, attn_len)
            if out is not None:
                return out
        return drafter(tokens, mask_index, self.cache, self.ops, tree, attn_len=attn_len)

    def forward(self, tokens, tree_mask=None, attn_len=None, logits_at=None, return_hidden=False):
        return self.model(tokens, self.cache, self.ops, tree_mask=tree_mask, attn_len=attn_len,
                          logits_at=logits_at, return_hidden=return_hidden)

    def prefill(self, tokens: torch.Tensor, lens: torch.Tensor, attn_len=None, every: bool = False,
                start: int = 0) -> torch.Tensor:
        """Right-padded prompts [B,T] with true lengths lens[B]; sets cache.lens = lens.
        Returns the logits at each row's last prompt token [B,V] (every: at every position [B,T,V],
        for prompt log-probabilities). start: every row's first `start` positions already hold
        its prompt's K/V (prefix reuse); tokens are the prompts from there on."""
        self.cache.lens.fill_(start)
        last = (lens.to(torch.int64) - 1 - start).clamp_min(0)[:, None]
        logits = self.forward(tokens, attn_len=attn_len, logits_at=None if every else last)
        self.cache.set_lens(lens.to(torch.int32))
        return logits if every else logits[:, 0]

    def prefill_row(self, row: int, tokens: torch.Tensor, length: int, every: bool = False, start: int = 0):
        """Prefill one row of the call's cache ([1,T] tokens, `length` of them real; 0 = empty)
        and leave the other rows as they are (continuous batching). start: the row's first
        `start` positions still hold these tokens' K/V (the serving core's prefix reuse), so only
        tokens[start:length] run. every: returns the logits at every position [1,length,V]
        (prompt log-probabilities; with start 0)."""
        full, self.cache = self.cache, self.cache.row(row)
        try:
            if length > start:
                logits = self.prefill(tokens[:, start:length], torch.tensor([length], device=self.device),
                                      attn_len=length, every=every, start=start)
                return logits if every else None
            self.cache.lens.fill_(length)
        finally:
            self.cache = full

    def decode(self, token: torch.Tensor, attn_len=None, return_hidden=False):
        """One new token per row [B] -> logits [B,V] (cache.lens is not advanced)."""
        out = self.verify(token[:, None], attn_len=attn_len, return_hidden=return_hidden)
        return (out[0][:, 0], out[1][:, 0]) if return_hidden else out[:, 0]

    def verify(self, tokens: torch.Tensor, tree_mask=None, attn_len=None, return_hidden=False):
        """Q new tokens per row [B,Q] (chain, or a tree with tree_mask [B|1,Q,Q]) -> [B,Q,V].
        Replays a captured graph when one fits, else runs eagerly (same results)."""
        Q, inv = tokens.shape[1], self.invariance
        if inv.width is not None and Q > inv.width:
            raise SpecEngineError(
                f"batch-invariant mode covers target forwards of up to invariant_width={inv.width} "
                f"tokens, but this round verifies {Q}; pass a larger invariant_width, a smaller gamma, "
                f"or batch_invariant=False", "invariant_width")
        if inv.pad_width is not None and Q != inv.pad_width:
            return self._padded_verify(tokens, tree_mask, attn_len, return_hidden)
        key = self.graphs.usable(tokens, tree_mask, return_hidden, attn_len) if self.graphs is not None else None
        if key is not None:
            return self.graphs(tokens, key, tree_mask)
        return self.forward(tokens, tree_mask=tree_mask, attn_len=attn_len, return_hidden=return_hidden)

    def _padded_verify(self, tokens, tree_mask, attn_len, return_hidden):
        """Batch-invariant mode: run Q tokens as a forward of pad_width (the padding writes K/V
        past the real tokens, which no real query sees; padded tree nodes see only themselves)."""
        B, Q = tokens.shape
        W = self.invariance.pad_width
        tokens = torch.nn.functional.pad(tokens, (0, W - Q))
        if tree_mask is not None:
            eye = torch.eye(W, dtype=torch.bool, device=tree_mask.device).expand(tree_mask.shape[0], W, W).clone()
            eye[:, :Q, :Q] = tree_mask.to(torch.bool)
            tree_mask = eye
        if attn_len is not None:
            attn_len = min(attn_len + W - Q, self.cache.max_seq_len)
        out = self.verify(tokens, tree_mask=tree_mask, attn_len=attn_len, return_hidden=return_hidden)
        return (out[0][:, :Q], out[1][:, :Q]) if return_hidden else out[:, :Q]

