"""The constrained rows of one generation: an xgrammar matcher per row (None: unconstrained) at
the row's committed tokens, and the masks a round's target logits get (docs/design.md,
"Structured output").

Lossless under the constraint: every target position a round scores is masked from the
matcher state after the tokens before it (a chain: the committed tokens then the drafts up to
it; a tree: the node's path), so the rejection sampler sees exactly constrained `ar`'s
distribution wherever its verdict counts. A position after a draft the grammar refuses is
left unmasked: that draft is rejected there (the target's mass on it is 0), so nothing after
it is ever read. The matcher walks the drafts and rolls back; it moves for good only when the
driver books what a round committed (`advance`).

The walk reads the round's drafts on the host, from a copy started before the verify is queued
(`HostCopy`: on a GPU the host waits for the drafts only and fills masks while the verify
runs; on a CPU the tensor itself). The first position's mask is the one `advance` filled when
it booked the last round (it also tells a dead end from a live row), so a plain round fills
nothing new.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from ..errors import SpecEngineError


def _timed(fn):
    """Adds the call's seconds to the rows' `mask_s` (the host's grammar work, in `stats`)."""
    @functools.wraps(fn)
    def run(self, *args, **kw):
        t = time.perf_counter()
        try:
            return fn(self, *args, **kw)
        finally:
            self.mask_s += time.perf_counter() - t
    return run


class RowConstraints:
    def __init__(self, compiler, constraints: list, drafting: bool = True):
        self.compiler, self.xgr, self.V = compiler, compiler.xgr, compiler.vocab_size
        self.matchers = [None] * len(constraints)
        self._next = self.xgr.allocate_token_bitmask(len(constraints), self.V)  # each row's next-token mask
        self.status = [None] * len(constraints)  # None (live), "stop" (the grammar ended), "dead_end"
        self.drafting = drafting  # sd chains, ngram and hybrid draft the grammar's forced text (forced_rows)
        self.forced_tokens = 0  # tokens the grammar forced into drafts (grammar drafting)
        self.mask_s = 0.0  # host seconds in the matchers: masks, walks, commits, forced tokens
        for b, c in enumerate(constraints):
            self.set_row(b, c)

    @staticmethod
    def admit(rows: "RowConstraints | None", compiler, batch: int, b: int, constraint) -> "RowConstraints | None":
        """The serving core put a request into row b: its constraint (made on the first one)."""
        if rows is None and constraint is not None:
            rows = RowConstraints(compiler, [None] * batch)
        if rows is not None:
            rows.set_row(b, constraint)
        return rows

    @staticmethod
    def stats_of(rows: "RowConstraints | None") -> dict:
        """A call's grammar figures: tokens the grammar forced into drafts, host seconds in the
        matchers (None without a constraint)."""
        return {"grammar_tokens": None if rows is None else rows.forced_tokens,
                "grammar_mask_s": None if rows is None else rows.mask_s}

    def finish_reason(self, b: int) -> str | None:
        """Why row b ends here: "stop" (its grammar ended), "constraint_dead_end" (the grammar allows
        no token of this vocabulary next: the row ends without a token outside it), or None."""
        return {"stop": "stop", "dead_end": "constraint_dead_end"}.get(self.status[b])

    @property
    def any(self) -> bool:
        return any(m is not None for m in self.matchers)

    def set_row(self, b: int, constraint) -> None:
        """Row b starts a new request under `constraint` (None: none)."""
        self.matchers[b] = None if constraint is None else \
            self.xgr.GrammarMatcher(self.compiler.compile(constraint))
        self.status[b] = None
        self._next[b].fill_(-1)
        if self.matchers[b] is not None:
            self._refresh(b)

    def _refresh(self, b: int) -> None:
        m = self.matchers[b]
        if m.is_terminated():
            self.status[b] = "stop"
            return
        m.fill_next_token_bitmask(self._next, b)
        if not bool(self._next[b].any()):
            self.status[b] = "dead_end"

    @_timed
    def advance(self, b: int, tokens: list[int]) -> int:
        """Row b committed `tokens`: its matcher moves past them (each was allowed, or the masking
        was wrong: an internal error, never a silent one). Returns how many count: all, or those up
        to the one that ended the grammar (the rest were verified past its end, unmasked)."""
        m = self.matchers[b]
        if m is None or not tokens:
            return len(tokens)
        used = 0
        for t in tokens:
            if m.is_terminated():
                break
            if not m.accept_token(t):
                raise SpecEngineError(f"internal error: token {t} was committed where the constraint refuses it; "
                                      f"please report this")
            used += 1
        self._refresh(b)
        return used

    # ---------------------------------------------------------------- masks
    @staticmethod
    def read_ahead(t: torch.Tensor) -> "HostCopy":
        return HostCopy(t)

    @_timed
    def mask_chain(self, logits: torch.Tensor, following) -> torch.Tensor:
        """logits [B,W,V] of positions scoring the token after the committed ones, then after each
        of following[:, :W-1] (a tensor, or a `HostCopy` of one started before the verify) -> the
        same, masked (a copy; unconstrained rows unchanged)."""
        if not self.any:
            return logits
        B, W, V = logits.shape
        masks = self.xgr.allocate_token_bitmask(B * W, self.V)
        walk = [] if W == 1 or following is None else [row[: W - 1] for row in following.tolist()]
        for b, m in enumerate(self.matchers[:B]):
            if m is None or self.status[b] is not None:  # unconstrained, or ended (frozen): unmasked
                continue
            masks[b * W] = self._next[b]
            accepted = 0
            for i, t in enumerate(walk[b] if walk else ()):
                if not m.accept_token(t):
                    break
                accepted += 1
                if m.is_terminated():  # the grammar ended: what follows is cut off at commit (advance)
                    break
                m.fill_next_token_bitmask(masks, b * W + i + 1)
            if accepted:
                m.rollback(accepted)
        return self._apply(logits, masks)

    @_timed
    def mask_tree(self, logits: torch.Tensor, tokens, parent) -> torch.Tensor:
        """logits [B,N,V] of a token tree's nodes (node 0: the root, the last committed token; each
        node's logits score its children) -> masked from each node's path, depth first."""
        if not self.any:
            return logits
        B, N, V = logits.shape
        masks = self.xgr.allocate_token_bitmask(B * N, self.V)
        toks, par = tokens.tolist(), parent.tolist()  # tensors, or HostCopy's started before the verify
        for b, m in enumerate(self.matchers[:B]):
            if m is None or self.status[b] is not None:
                continue
            children = [[] for _ in range(N)]
            for j in range(1, N):
                if par[b][j] >= 0:
                    children[par[b][j]].append(j)
            masks[b * N] = self._next[b]
            stack = [(c, False) for c in reversed(children[0])]
            while stack:  # (node, leaving): enter a node by accepting its token, leave by rolling it back
                j, leaving = stack.pop()
                if leaving:
                    m.rollback(1)
                    continue
                if m.is_terminated() or not m.accept_token(toks[b][j]):
                    continue  # refused: its subtree is never reached
                stack.append((j, True))
                if m.is_terminated():
                    continue
                m.fill_next_token_bitmask(masks, b * N + j)
                stack.extend((c, False) for c in reversed(children[j]))
        return self._apply(logits, masks)

    def _apply(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        return apply_masks(self.xgr, logits, masks, self.V)

    # ---------------------------------------------------------------- grammar drafting
    def forced_rows(self, rows, limit: int) -> dict:
        """{row: its forced tokens} for the rows that have any (grammar drafting on), counted."""
        if not self.drafting:
            return {}
        found = {b: f for b in rows if (f := self.forced(b, limit))}
        self.forced_tokens += sum(len(f) for f in found.values())
        return found

    @_timed
    def forced(self, b: int, limit: int) -> list[int]:
        """Tokens for the text the grammar forces after row b's committed ones, at most `limit`:
        xgrammar's jump-forward string (a key, the rest of an enum value, separators), tokenized
        as the tokenizer writes it, and single allowed tokens (an EOS where the grammar must end).
        Drafts the target accepts unless it spells that text with other tokens."""
        m, out = self.matchers[b], []
        if m is None or self.status[b] is not None:
            return out
        row = self._next[b: b + 1].clone()
        while len(out) < limit and not m.is_terminated():
            text = m.find_jump_forward_string()
            ids = self.compiler.encode(text)[: limit - len(out)] if text else []
            took = 0
            for t in ids:
                if not m.accept_token(t):
                    break
                out.append(t)
                took += 1
                if m.is_terminated():
                    break
            if took:
                continue
            if len(out) > 0:  # the mask after tokens the walk accepted; the row's own otherwise
                m.fill_next_token_bitmask(row, 0)
            t = _single(row[0])
            if t is None or not m.accept_token(t):
                break
            out.append(t)
        if out:
            m.rollback(len(out))
        return out


def _single(words: torch.Tensor) -> int | None:
    """The one token a bitmask row allows, or None when it allows none or several."""
    nz = words.nonzero()
    if nz.numel() != 1:
        return None
    w = int(nz[0, 0])
    v = int(words[w]) & 0xFFFFFFFF
    return 32 * w + v.bit_length() - 1 if v & (v - 1) == 0 else None


class HostCopy:
    """A device tensor's copy on the host, started now without waiting (pinned memory and an event
    on CUDA): started before the verify is queued, the mask walk then waits for the drafts only,
    and fills masks while the device runs the verify. On a CPU the tensor itself."""

    def __init__(self, t: torch.Tensor):
        self.ready = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def apply_masks(xgr, logits: torch.Tensor, masks: torch.Tensor, V: int, path: str = "auto") -> torch.Tensor:
    """logits [B,W,V] with the tokens each bitmask row [B*W, ceil(V/32)] refuses at -inf (a copy).
    Two ways, the same result (tests compare them): where most tokens are refused (JSON's
    structure) the allowed ones are kept from the unpacked bits ("sparse": ~110 us a row of the
    Qwen2.5 vocabulary on a 2-core EPYC Zen 4, xgrammar's CPU kernel ~600 us there); where most
    are allowed (inside a string) xgrammar's kernel writes the few refused ones ("dense": ~45 us)."""
    B, W, _ = logits.shape
    flat = logits.float().reshape(B * W, -1)
    host = masks.numpy()
    if path == "sparse" or (path == "auto" and 2 * np.count_nonzero(host) < host.size):
        bits = np.unpackbits(host.view(np.uint8), axis=-1, bitorder="little")[:, :V].view(bool)
        out = torch.where(torch.from_numpy(bits).to(flat.device, non_blocking=True), flat[:, :V],
                          torch.tensor(float("-inf"), device=flat.device))
        if flat.shape[1] > V:  # logits wider than the grammar's vocabulary: the rest refused too
            out = torch.cat([out, torch.full_like(flat[:, V:], float("-inf"))], 1)
    else:
        out = flat.clone(memory_format=torch.contiguous_format)  # xgrammar's CPU kernel writes rows as if contiguous: a strided
        # copy (a transposed matmul's logits, cpu_matmul "wxt") had the wrong entries refused
        xgr.apply_token_bitmask_inplace(out, masks.to(out.device, non_blocking=True), vocab_size=V)
    return out.reshape(logits.shape)
