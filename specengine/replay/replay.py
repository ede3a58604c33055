"""Replay: run a method on random weights of the real shapes, deciding as the real pair did.

The real pair's weights cannot reach a GPU machine; its decisions can (trace.py). A replayed
run does the device work of a real one (the same rounds, widths, draft steps, KV commits,
rollbacks and compactions, CUDA graphs included) while every model-dependent outcome comes
from the trace:

- the target: a forward hook on the target model replaces each query's logits by a one-hot
  on the trace's token at the next position (a chain query at cache.lens + j, a tree node at
  cache.lens + depth; on the device, so graphs capture it). Greedy verification then accepts
  exactly what the real target would have: a draft is compared with the target only while
  everything before it matched, i.e. while its prefix is the trace's.
- the draft model's chains, the parallel drafter's proposals, drafted trees and SpecDec++'s
  head: the round steps (methods/steps.py) ask `ctx.replay` for the trace's tokens in place
  of the random model's, after the random model has run (MethodContext.replay is None
  outside a replay). Every prefix a draft builds is "trace[:m] then chain[m, :d]" (m: where it
  first left the trace), so one table per position covers every method, PEARL's pending
  drafts included.
- n-gram and suffix drafting read only committed tokens, which are the trace's.

Greedy only: the trace holds the pair's greedy decisions. A replay is built by a benchmark
(bench/gpu_e2e.py, tests) around an engine over random weights; nothing else constructs one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecEngineError
from ..methods.token_tree import TokenTree, TreeShape
from .trace import TREE_PARTS, TraceSet

PENDING_MAX = 16  # the most drafted-but-unverified tokens a round may start with (PEARL's window - 1)


@dataclass
class ChainPlan:
    tokens: torch.Tensor  # [B,γ] int64
    conf: torch.Tensor  # [B,γ] float32
    head: torch.Tensor  # [B,γ] float32


class ReplayHead:
    """SpecDec++'s head under replay: P(accept) of the token just drafted, from the trace
    (set by the chain step before each observe; a static buffer, so a captured graph reads it)."""

    def __init__(self, max_batch: int, device):
        self.now = torch.zeros(max_batch, device=device)

    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.now[: hidden.shape[0]]


class Replay:
    def __init__(self, traces: TraceSet, vocab: int, device, max_batch: int = 1):
        self.set, self.vocab, self.device = traces, vocab, torch.device(device)
        ts = traces.traces
        if not ts:
            raise SpecEngineError("the trace file holds no prompts", "trace")
        P = max(t.length for t in ts)
        K, k = ts[0].chain.shape[1], ts[0].parallel.shape[1]
        B, dev = max_batch, self.device
        # static buffers (bind() copies a call's rows in): captured graphs keep reading them
        self.T = torch.zeros(B, P, dtype=torch.int64, device=dev)
        self.C = torch.full((B, P, K), -1, dtype=torch.int64, device=dev)
        self.conf = torch.zeros(B, P, K, device=dev)
        self.headp = torch.zeros(B, P, K, device=dev)
        self.par = torch.full((B, P, k), -1, dtype=torch.int64, device=dev)
        self.trees = {kind: {part: torch.zeros(B, P, shape.nodes + 1, dtype=torch.int64, device=dev)
                             for part in TREE_PARTS}
                      for kind, shape in traces.trees.items()}
        self.head = ReplayHead(B, dev)
        self.bound: list[int] = []
        self._hook = None
        self._graphed = lambda name, fn, *args: fn(*args)  # attach(): the target runner's graphed calls

    # ------------------------------------------------------------------ set-up
    def attach(self, engine) -> None:
        """Make `engine` (over random weights of the trace pair's shapes) replay this trace."""
        vocab = engine.target.config.vocab_size
        if vocab < self.vocab:
            raise SpecEngineError(f"the trace's vocabulary ({self.vocab}) is larger than the target's ({vocab})", "trace")
        if self._hook is not None:
            raise SpecEngineError("this replay is already attached to an engine")
        self._hook = engine.target.model.register_forward_hook(self._target_hook, with_kwargs=True)
        self._graphed = engine.target.graphed
        engine._replay = self

    def detach(self, engine) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        engine._replay = None

    def bind(self, indices: list[int]) -> None:
        """Rows 0..len(indices)-1 of the next generate call replay these traces."""
        if len(indices) > self.T.shape[0]:
            raise SpecEngineError(f"a replay of {len(indices)} rows needs max_batch >= {len(indices)}", "trace")
        for b, i in enumerate(indices):
            t = self.set.traces[i]
            n = t.length
            self.T[b].zero_(), self.T[b, :n].copy_(t.tokens)
            self.C[b].fill_(-1), self.C[b, :n].copy_(t.chain)
            self.conf[b].zero_(), self.conf[b, :n].copy_(t.conf)
            self.headp[b].zero_(), self.headp[b, :n].copy_(t.head)
            self.par[b].fill_(-1), self.par[b, :n].copy_(t.parallel)
            for kind, parts in self.trees.items():
                for part, buf in parts.items():
                    buf[b].zero_(), buf[b, :n].copy_(t.trees[kind][part])
        self.bound = list(indices)

    def generate(self, engine, indices: int | list[int], **options):
        """generate() over the traces' prompts, each for its trace's length, EOS ignored."""
        batched = isinstance(indices, list)
        idx = indices if batched else [indices]
        self.bind(idx)
        traces = [self.set.traces[i] for i in idx]
        new = {t.new for t in traces}
        if len(new) != 1:
            raise SpecEngineError("rows replayed together must have traces of one length", "trace")
        out = engine.generate([t.prompt for t in traces], max_new_tokens=new.pop(), ignore_eos=True, **options)
        return out if batched else out[0]

    def acceptance_head(self, mode: str = "greedy") -> ReplayHead:
        if mode != "greedy":
            raise SpecEngineError("a replay holds the pair's greedy decisions: replay with temperature 0", "temperature")
        return self.head

    # ------------------------------------------------------------------ the target
    def _target_hook(self, module, args, kwargs, output):
        tokens = args[0]
        cache = args[1] if len(args) > 1 else kwargs["cache"]
        tree_mask, logits_at = kwargs.get("tree_mask"), kwargs.get("logits_at")
        logits, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
        B, T = tokens.shape
        lens = cache.lens.to(torch.int64)[:, None]
        if tree_mask is not None:  # a node sits at its depth
            pos = lens + tree_mask.to(torch.int64).sum(-1).expand(B, T) - 1
        else:
            pos = lens + torch.arange(T, device=lens.device)[None, :]
        if logits_at is not None:
            pos = pos.gather(1, logits_at)
        nxt = self.T[:B].gather(1, (pos + 1).clamp(0, self.T.shape[1] - 1))
        fixed = torch.full_like(logits, float("-inf")).scatter_(-1, nxt[..., None], 0.0)
        return (fixed, *rest) if rest else fixed

    # ------------------------------------------------------------------ the drafts
    def _at(self, table: torch.Tensor, p: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
        """table[b, p[b, j] (, d[b, j])] for [B,J] indices (clamped inside the table)."""
        B = p.shape[0]
        P = table.shape[1]
        rows = torch.arange(B, device=p.device)[:, None]
        p = p.clamp(0, P - 1)
        return table[rows, p] if d is None else table[rows, p, d.clamp(0, table.shape[2] - 1)]

    def _sentinel(self, q: torch.Tensor) -> torch.Tensor:
        """A token that is never the target's at q [B,J] (drafts past what the trace holds)."""
        return (self._at(self.T, q) + 1) % self.vocab

    def _left(self, tokens: torch.Tensor, n: torch.Tensor, upto: torch.Tensor):
        """Where the draft's prefix tokens[:upto] first leaves the trace beyond the n committed
        tokens (PEARL's pending drafts): (left [B] bool, m [B], drafted since m [B])."""
        n, upto = n.to(torch.int64), upto.to(torch.int64)
        W = max(self.C.shape[2], PENDING_MAX)
        pos = n[:, None] + torch.arange(W, device=n.device)[None, :]
        pending = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1))
        off = (pending != self._at(self.T, pos)) & (pos < upto[:, None])
        left = off.any(1)
        m = n + off.to(torch.int8).argmax(1)
        return left, m, upto - m

    def chain(self, state, upto: torch.Tensor, gamma: int) -> ChainPlan:
        """The real draft's γ greedy tokens continuing state.tokens[:, :upto] (and their
        confidences and head outputs), from the trace: one graph replay where graphs are on (the
        ~60 small ops of `_chain` are the benchmark's own work, which a real round has not: eager
        on a GPU, ~0.7 ms of launches a round)."""
        return ChainPlan(*self._graphed("replay chain", self._chain, state.tokens, state.n, upto, gamma))

    def _chain(self, tokens: torch.Tensor, n: torch.Tensor, upto: torch.Tensor, gamma: int):
        left, m0, d0 = self._left(tokens, n, upto)
        j = torch.arange(gamma, device=upto.device)[None, :]
        q = upto.to(torch.int64)[:, None] + j  # the positions drafted
        on_trace = self._at(self.C, q, torch.zeros_like(q)) == self._at(self.T, q)
        first_off = torch.where(on_trace.all(1), gamma, (~on_trace).to(torch.int8).argmax(1))[:, None]
        following = ~left[:, None] & (j < first_off)  # still on the trace: chain[q, 0]
        m = torch.where(left[:, None], m0[:, None], q[:, :1] + first_off)
        d = torch.where(left[:, None], d0[:, None] + j, j - first_off)
        p, d = torch.where(following, q, m), torch.where(following, 0, d)
        tok = self._at(self.C, p, d)
        ok = (d < self.C.shape[2]) & (tok >= 0)
        zero = torch.zeros((), device=tok.device)
        return (torch.where(ok, tok, self._sentinel(q)), torch.where(ok, self._at(self.conf, p, d), zero),
                torch.where(ok, self._at(self.headp, p, d), zero))

    def parallel(self, state, upto: torch.Tensor, k: int) -> torch.Tensor:
        """The parallel drafter's k proposals continuing state.tokens[:, :upto] [B,k]; a prefix
        off the trace gets tokens that are never accepted (as the real ones would not be)."""
        left, _, _ = self._left(state.tokens, state.n, upto)
        j = torch.arange(k, device=upto.device)[None, :]
        p = upto.to(torch.int64)[:, None].expand(-1, k)
        tok = self._at(self.par, p, j)
        ok = ~left[:, None] & (tok >= 0)
        return torch.where(ok, tok, self._sentinel(p + j))

    def tree(self, state, kind: str, shape: TreeShape, draft_depth: int) -> TokenTree:
        """The tree the real drafter built from the committed tokens."""
        have = self.set.trees.get(kind)
        if have != shape:
            raise SpecEngineError(f"the trace holds {kind} trees of shape {have}, not {shape}: record it with "
                                  f"--{'sd' if kind == 'sd' else 'ps'}-tree matching the replayed method", "tree")
        p = state.n.to(torch.int64)[:, None]
        parts = {part: self._at(buf, p)[:, 0] for part, buf in self.trees[kind].items()}
        parts["tokens"][:, 0] = state.last_tokens()  # the root: the last committed token
        return TokenTree(parts["tokens"], parts["parent"], parts["depth"], parts["source"], draft_depth)
