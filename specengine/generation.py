"""The decoding driver: prefill, rounds of a method until every row is done, stats.

Method-agnostic (methods/base.py is the interface). Exactly one host sync per round
(reading what the round committed and the caches' high-water marks); stopping on EOS,
stop strings and `max_new_tokens` is decided on the host from that read, and finished
rows are frozen on the device so they never grow or overflow the cache. The caches'
lengths are set here, once per round: the target holds the committed tokens but the
last, the draft what the method says it validly holds.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .counters import Counters
from .kernels.rng import row_seeds
from .detokenize import IncrementalDetokenizer, find_stop
from .errors import SpecEngineError
from .methods.base import CallInputs, CallTotals, Method
from .methods.logprobs import LogprobSpec, entries, token_logprobs
from .methods.sampling import SamplingParams
from .methods.state import DecodeState
from .runtime.graphs import captures, padded_width
from .row_state import RowState
from .runtime.runner import ModelRunner
from .structured.rows import RowConstraints
from .timing import PhaseTimer

ATTN_BUCKET = 64  # attention reads a prefix of the cache rounded up to this many positions


def attn_bound(length: int, max_seq_len: int) -> int:
    """The cache prefix a step reads: `length` rounded up to ATTN_BUCKET, within the buffer."""
    return min(-(-length // ATTN_BUCKET) * ATTN_BUCKET, max_seq_len)


def headroom(method: Method, target) -> int:
    """Positions past a row's committed length a round may write: the method's widest
    forward, padded to the graph bucket (and to the batch-invariant width), for the target
    and for a draft running ahead of it. The one place this is computed (the capacity check
    and the attention bound use it)."""
    return 2 * padded_width(max(method.max_width, target.invariant_width or 0))


@dataclass
class _Launched:
    """A round queued on the device, not yet read: its outputs and the host's copy of them."""
    out: object  # the method's RoundOutput (device tensors)
    lp_shape: tuple | None  # [B,W,F] of its log-probabilities, when read
    marks: int  # high-water marks at the payload's end
    payload: torch.Tensor  # what the sync reads (pinned host memory once `ready`)
    ready: object = None  # a CUDA event: the payload's copy has landed


class Generation:
    """One generate call over a batch of token-id prompts; iterate `rounds()` to drive it."""

    def __init__(self, engine, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 method: Method, stop_ids: set[int], stop_strings: list[str], logprobs: LogprobSpec | None = None,
                 prompt_logprobs: bool = False, overlap: bool = False, constraints: list | None = None,
                 grammar_draft: bool = True, cache_key: str | None = ""):
        self.engine, self.params, self.method = engine, params, method
        # launch round k+1 before reading round k while the method's rounds commit one token per
        # live row and read nothing the host learns from the last one (ar always; sd γ auto's plain
        # rounds); not in the serving core, which admits new requests into rows between rounds
        # (never under a constraint: a round's masks start from where the last round's tokens moved the matchers)
        constrained = constraints is not None and any(c is not None for c in constraints)
        self.overlap = overlap and not constrained
        self._pending: _Launched | None = None
        self.logprobs, self.want_prompt_logprobs = logprobs, prompt_logprobs
        self.track_text = bool(stop_strings)  # stream() turns it on too
        self.prompts = [list(p) for p in prompts]  # per row (admit replaces one): n-gram drafting reads them
        self.rows = [RowState(len(p), max_new_tokens, stop_strings, stop_ids, cache_key=cache_key) for p in prompts]
        for row in self.rows if logprobs is not None else ():
            row.logprobs = []
        self.counters = Counters()
        self.t0 = time.perf_counter()
        self.timer = PhaseTimer(engine.device)
        self.state = self._prefill(prompts)
        self.state.attn_len = attn_bound(max(r.prompt_len for r in self.rows) + 1, engine.max_seq_len)
        if constrained:
            self.state.constraints = RowConstraints(engine.grammar_compiler, constraints, grammar_draft)
            for b in range(len(self.rows)):
                self._grammar_finish(b)
        self.prefill_s = time.perf_counter() - self.t0
        self.decode_s = 0.0  # wall time inside rounds (step costs and prefill excluded)
        self.ctx = engine.method_context()
        # what the method reads of this call (may measure step costs: once per engine and batch size)
        method.begin(self.ctx, CallInputs(self.state, self.prompts, self.rows, self.prefill_s))

    # ------------------------------------------------------------------ set-up
    def _runners(self):
        return [self.engine.target] + ([self.engine.draft] if self.method.needs_draft else [])

    def _prefilled(self, runner) -> bool:
        """Does the prompt go into this runner's cache now? Not the draft's when the method reads
        it in itself on first use (hybrid γ auto: a reply carried by n-gram proposals never pays it)."""
        return runner is self.engine.target or not self.method.defers_draft_prefill

    def _prefill(self, prompts) -> DecodeState:
        eng, B, S = self.engine, len(prompts), self.engine.max_seq_len
        dev = eng.device
        tokens = torch.zeros(B, S, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.tensor(p)
        tokens = tokens.to(dev)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
        longest = max(len(p) for p in prompts)
        eng.target.invariance.ensure(B, self.method.max_width)  # batch-invariant mode: probed at this width
        temp = torch.full((B,), float(self.params.temperature), device=dev)
        if self.want_prompt_logprobs:  # the first token has none; a prefill fills in the rest
            for row in self.rows:
                row.prompt_logprobs = [None]
        for runner in self._runners():  # every cache holds the prompt but its last token
            runner.allocate(B, S)
            if longest > 1 and self._prefilled(runner):
                every = self.want_prompt_logprobs and runner is eng.target
                logits = runner.prefill(tokens[:, : longest - 1], lens - 1, attn_len=longest - 1,
                                        **({"every": True} if every else {}))
                if every:
                    self._prompt_logprobs(logits, tokens[:, 1:longest], temp)
        return DecodeState(
            tokens=tokens, n=lens.clone(), active=torch.ones(B, dtype=torch.bool, device=dev),
            params=self.params, temperature=temp, seed=row_seeds(self.params.seed, B, dev),
            offset=torch.zeros(B, dtype=torch.int64, device=dev), commit_op=eng.ops.commit_tokens,
            logprobs=self.logprobs,
        )

    def _prompt_logprobs(self, logits, following, temperature, rows=None) -> None:
        """Each row's prompt log-probabilities from the prefill's logits [B,T,V] (position i scores
        prompt token i + 1, `following`) after its first token's None. rows: which rows B stands for."""
        spec = self.logprobs or LogprobSpec(0)
        host = token_logprobs(logits, following, spec, self.params, temperature).tolist()
        for i, b in enumerate(rows if rows is not None else range(len(self.rows))):
            prompt = self.prompts[b]
            self.rows[b].prompt_logprobs += [entries(host[i][j], prompt[j + 1], spec) for j in range(len(prompt) - 1)]

    # ------------------------------------------------------------------ rounds
    def rounds(self):
        """Run rounds until every row is done; yields the ids each row kept this round."""
        while any(r.finish_reason is None for r in self.rows):
            yield self.step()

    @property
    def new_tokens(self) -> int:
        return sum(len(r.ids) for r in self.rows)

    def step(self) -> list[list[int]]:
        """One round for every active row; the ids each row kept (one host sync). With `overlap`
        the next round is launched before this one is read, so the device never waits for the
        host's reading and bookkeeping (docs/design.md, "Overlapped rounds")."""
        if self._pending is None and all(r.finish_reason is not None for r in self.rows):
            return [[] for _ in self.rows]  # every row ended before its first round (a grammar's dead end)
        t0, captured = time.perf_counter(), captures()
        pending = self._pending or self._launch(ahead=0)
        ahead = self.overlap and self.method.one_token_rounds and self._more_after_pending()
        self._pending = self._launch(ahead=1) if ahead else None
        self.counters.launched_ahead += bool(ahead)
        kept = self._read(pending)
        took = time.perf_counter() - t0
        self.decode_s += took
        if captures() == captured:  # a graph's capture is a one-time cost, not the round's (graphs.capture_graph)
            self.method.timed(took)  # with a round launched ahead: this step's share of the device's time
        return kept

    def _more_after_pending(self) -> bool:
        """Will some row still want tokens after the round in flight (one token per live row)?
        EOS and stop strings cannot be foreseen: a row they finish costs one discarded round."""
        return any(r.finish_reason is None and len(r.ids) + 1 < r.max_new for r in self.rows)

    def _launch(self, ahead: int) -> _Launched:
        """Queue one round on the device and the copy of what the host reads of it. ahead: rounds
        in flight before this one (each commits one token per live row: `one_token_rounds`)."""
        live = [b for b, r in enumerate(self.rows) if r.finish_reason is None]
        longest = max(self.rows[b].prompt_len + len(self.rows[b].ids) for b in live) + ahead
        self.state.attn_len = attn_bound(longest + headroom(self.method, self.engine.target), self.engine.max_seq_len)
        with self._first_rows(live[-1] + 1) as (state, target, draft):
            state.round_logprobs = None
            out = self.method.round(state, self.timer)
            lp = state.round_logprobs  # [B,W,F] fp32: read in the same sync, as its bits in int64s
            target.cache.set_lens(state.n - 1)
            if out.draft_lens is not None:
                draft.cache.set_lens(out.draft_lens)
            marks = torch.stack([r.cache.high_water.to(state.tokens.device) for r in self._runners()])
        bits = [] if lp is None else [lp.flatten().view(torch.int32).to(torch.int64)]
        payload = torch.cat([out.tokens.flatten(), out.n_acc.to(torch.int64), out.num_draft.to(torch.int64),
                             out.n_committed.to(torch.int64), *bits, marks])
        ready = None
        if self.overlap and payload.is_cuda:  # into pinned memory without waiting; read after the next launch
            host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            ready, payload = torch.cuda.Event(), host
            ready.record()
        return _Launched(out, None if lp is None else lp.shape, len(marks), payload, ready)

    def _read(self, r: _Launched) -> list[list[int]]:
        """The round's one sync: what it committed and the caches' high-water marks; then booking."""
        if r.ready is not None:
            r.ready.synchronize()
        out, host = r.out, r.payload.tolist()
        high_water = max(host[-r.marks:])
        if high_water > self.engine.max_seq_len:
            raise SpecEngineError(
                f"internal error: a {self.method.name} round wrote past the KV cache ({high_water} "
                f"> max_seq_len={self.engine.max_seq_len}); the capacity check missed it, please report this")
        B, width = out.tokens.shape
        toks = host[: B * width]
        n_acc, num_draft, n_new = (host[B * width + i * B: B * width + (i + 1) * B] for i in range(3))
        pad = len(self.rows) - B  # rows past the last live one sat this round out
        committed = [toks[b * width: b * width + n_new[b]] for b in range(B)] + [[]] * pad
        kept = self._book(out, committed, n_acc + [0] * pad, num_draft + [0] * pad)
        if r.lp_shape is not None:
            F = r.lp_shape[2]
            at = B * width + 3 * B
            values = np.array(host[at: at + B * width * F], dtype=np.int64).astype(np.int32).view(np.float32)
            values = values.reshape(B, width, F).tolist()
            for b, ids in enumerate(kept[:B]):
                if self.rows[b].logprobs is not None:  # the serving core's rows ask one by one
                    self.rows[b].logprobs.extend(entries(v, t, self.logprobs) for v, t in zip(values[b], ids))
        return kept

    @contextmanager
    def _first_rows(self, hi: int):
        """The round's view: rows [0, hi) when every row from hi on is finished or free (the
        serving core's free slots) and the method keeps no per-row state, else every row (also
        in batch-invariant mode, which probed forwards at the call's row count).
        Views share storage, so commits and cache lengths land in the full buffers."""
        state, target, draft = self.state, self.engine.target, self.engine.draft
        runners = self._runners()
        if hi == state.batch or not self.method.rows_independent or target.invariant_width is not None or \
                not all(isinstance(r, ModelRunner) for r in runners):
            yield state, target, draft
            return
        saved = [r.cache for r in runners]
        for r in runners:
            r.cache = r.cache.rows(hi)
        view = dataclasses.replace(state, tokens=state.tokens[:hi], n=state.n[:hi], active=state.active[:hi],
                                   temperature=state.temperature[:hi], seed=state.seed[:hi],
                                   offset=state.offset[:hi])
        try:
            yield view, target, draft
        finally:
            for r, c in zip(runners, saved):
                r.cache = c

    def admit(self, slot: int, prompt: list[int], seed: int, max_new: int, stops: list[str],
              stop_ids: set[int], logprobs: bool = False, prompt_logprobs: bool = False, reuse: int = 0,
              constraint=None, cache_key: str | None = "") -> int:
        """Put a new request into a free row (continuous batching, serve/core.py): its prompt is
        prefilled into that row of every cache while the other rows keep their state. logprobs:
        the row collects its tokens' log-probabilities (under `self.logprobs`, which the caller
        sets while some row wants them); prompt_logprobs: its prompt's, from this prefill.
        reuse: the row's previous occupant and this prompt share their first `reuse` tokens, so
        each cache keeps what K/V of them it still validly holds (its length, read here: the
        admission's one sync) and prefills only the rest. Returns the target positions reused."""
        if self._pending is not None:
            raise SpecEngineError("internal error: admit() while a round is in flight (overlap is for generate "
                                  "and stream calls, not the serving core)")
        state, dev = self.state, self.state.tokens.device
        n = len(prompt)
        runners = [r for r in self._runners() if self._prefilled(r)]
        held = [0] * len(runners)
        if reuse > 0 and not prompt_logprobs:  # prompt log-probabilities need every position's logits
            held = torch.stack([r.cache.lens[slot].to(dev) for r in runners]).tolist()
        starts = [min(reuse, h, n - 1) if n > 1 else 0 for h in held]
        state.tokens[slot, :n] = torch.tensor(prompt, device=dev)
        state.n[slot] = n
        state.seed[slot] = seed  # the request's own stream: its tokens are those of decoding it alone
        state.offset[slot] = 0
        self.rows[slot] = RowState(n, max_new, stops, stop_ids, logprobs=[] if logprobs else None,
                                   prompt_logprobs=[None] if prompt_logprobs else None, cache_key=cache_key)
        self.prompts[slot] = list(prompt)
        for runner, start in zip(runners, starts):
            every = prompt_logprobs and runner is self.engine.target and n > 1
            logits = runner.prefill_row(slot, state.tokens[slot:slot + 1, : max(n - 1, 1)], n - 1,
                                        **({"every": True} if every else {}), **({"start": start} if start else {}))
            if every:
                self._prompt_logprobs(logits, state.tokens[slot:slot + 1, 1:n], state.temperature[slot:slot + 1],
                                      [slot])
        self.method.reset_rows([slot])
        state.active[slot] = True
        state.constraints = RowConstraints.admit(state.constraints, self.engine.grammar_compiler, len(self.rows),
                                                 slot, constraint)
        self._grammar_finish(slot)
        return starts[0]

    def release(self, slot: int, reason: str = "abort") -> None:
        """Stop a row (finished or aborted): frozen on the device, its row free for `admit`."""
        if self.rows[slot].finish_reason is None:
            self.rows[slot].finish_reason = reason
        self.state.active[slot] = False

    def _book(self, out, committed, n_acc, num_draft) -> list[list[int]]:
        counters = self.counters
        counters.rounds += 1
        counters.target_forwards += out.target_forwards
        counters.draft_forwards += out.draft_forwards
        was_active = [r.finish_reason is None for r in self.rows]
        kept_all = []
        for b, row in enumerate(self.rows):
            if not was_active[b]:
                kept_all.append([])
                continue
            counters.row_target_forwards += out.target_forwards
            counters.proposed += num_draft[b]
            counters.accepted += n_acc[b]
            counters.round_tokens += n_acc[b] + 1
            counters.row_rounds += 1
            counters.count_positions(n_acc[b], num_draft[b])
            if b == 0:
                counters.log.append((num_draft[b], n_acc[b], out.draft_forwards))
            new = committed[b]
            if self.state.constraints is not None:  # nothing past the token that ended the grammar
                new = new[: self.state.constraints.advance(b, new)]
            kept = self._keep(row, new)
            row.ids.extend(kept)
            self._grammar_finish(b)
            kept_all.append(kept)
        active = [b for b in range(len(self.rows)) if was_active[b]]
        self.method.see_tokens([committed[b] if was_active[b] else [] for b in range(len(self.rows))])
        self.method.after_round([n_acc[b] for b in active], [num_draft[b] for b in active])
        now_active = [r.finish_reason is None for r in self.rows]
        for b in range(len(self.rows)) if now_active != was_active and self.method.uses_cache else ():
            if was_active[b] and not now_active[b]:  # suffix decoding's memory: what finished rows wrote
                self.engine.suffix_caches.remember(self.rows[b].cache_key, self.rows[b].ids)
        if now_active != was_active:
            self.state.active.copy_(torch.tensor(now_active))
        return kept_all

    def _grammar_finish(self, b: int) -> None:
        """A constrained row ends where its grammar ends or allows no next token (structured/rows.py)."""
        reason = None if self.state.constraints is None else self.state.constraints.finish_reason(b)
        if reason is not None and self.rows[b].finish_reason is None:
            self.rows[b].finish_reason, self.state.active[b] = reason, False

    def _keep(self, row: RowState, new: list[int]) -> list[int]:
        """Truncate a row's new tokens at EOS / max_new_tokens / a stop string."""
        kept = []
        for t in new:
            kept.append(t)
            if t in row.stop_ids:
                row.finish_reason = "eos"
                break
            if len(row.ids) + len(kept) >= row.max_new:
                row.finish_reason = "length"
                break
        if self.track_text or row.stops:
            row.detok = row.detok or IncrementalDetokenizer(self.engine.tokenizer)
            searched = len(row.detok.text)
            row.detok.push(kept)
            if row.finish_reason is not None:
                row.detok.flush()
            hit = find_stop(row.detok.text, row.stops, searched)
            if hit is not None:
                row.finish_reason, row.stop_text_end = "stop", hit
        return kept

    # ------------------------------------------------------------------ results
    def stats(self) -> dict:
        wall = time.perf_counter() - self.t0
        new_tokens = self.new_tokens
        return {
            "method": self.method.name,
            "batch": len(self.rows),
            "new_tokens": new_tokens,
            "wall_time_s": wall,
            # the draft's prefill too where the method deferred it into a round (sd, hybrid: draft_prime.py)
            "prefill_s": self.prefill_s + self.timer.totals().get("prime", 0.0),
            "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
            "target_forwards": self.counters.target_forwards,
            "tokens_per_target_forward": new_tokens / max(self.counters.row_target_forwards, 1),
            "round_log": self.counters.log,  # row 0: (proposed, accepted, draft forwards) per round
            "rounds_launched_ahead": self.counters.launched_ahead,  # overlapped with the last one's read
            **RowConstraints.stats_of(self.state.constraints),  # grammar_tokens, grammar_mask_s
            # what batch-invariant mode decided and the figures behind it (runtime/invariance.py)
            "batch_invariant": getattr(self.engine, "batch_invariant_info", None),
            **self.method.stats(CallTotals(self.counters, self.timer, self.rows, new_tokens, self.decode_s)),
        }

