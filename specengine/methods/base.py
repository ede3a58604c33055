"""The method interface: what one round of a decoding method does (docs/design.md, "Methods").

A method is one file under `methods/` and one entry in the registry (`methods/__init__.py`);
the driver (generation.py) knows nothing else about it, and it knows nothing of the Engine nor
of the driver: what it reads of the call comes in explicitly (`CallInputs`, `CallTotals`).
Per generate call:
  method = Cls(gamma, policy, threshold, tree, defaults)   validate the call's options
  method.begin(ctx, call)               after prefill: the MethodContext (runners, samplers,
                                        step costs, head / drafter, side stream) and CallInputs
  method.round(state, timer)            -> RoundOutput, device tensors only, no host sync
  method.see_tokens(committed)          each row's committed tokens, as the sync read them
  method.after_round(n_acc, num_draft)  host bookkeeping on what the round's one sync read
  method.timed(seconds)                 the round's measured wall time (cost-driven choices)
  method.stats(totals)                  method-specific numbers for GenerationResult.stats (CallTotals)
`gamma` is each method's draft length: sd's γ, PEARL's window, ParallelSpec's k (a tree
takes its depth from its shape). `defaults` carries the engine's gamma / policy / threshold,
which only methods that draft by policy (sd) read.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import SpecEngineError
from .context import MethodContext
from .state import DecodeState, RoundOutput
from .token_tree import TreeShape


@dataclass
class CallInputs:
    """What a method reads of the call it runs in, handed over at `begin`. `prompts` and `rows`
    are the driver's per-row lists themselves: the serving core replaces a row's entries when a
    request takes it, and a method reads them again at `reset_rows`."""
    state: DecodeState
    prompts: list  # per row: its prompt's token ids
    rows: list  # per row: what it may write (`max_new`), has kept (`ids`, `finish_reason`), its suffix cache key
    prefill_s: float  # the call's prefill seconds (what a deferred draft prefill is priced from)

    @property
    def mode(self) -> str:
        """"greedy" or "sampled": what SpecDec++'s head and the acceptance memory are kept per."""
        return "greedy" if self.state.params.greedy else "sampled"


@dataclass
class CallTotals:
    """What a method's `stats` reads of the finished call."""
    counters: object  # counters.Counters: forwards, proposals, acceptances, rounds
    timer: object  # timing.PhaseTimer of the call's rounds
    rows: list
    new_tokens: int
    decode_s: float  # wall seconds inside rounds (prefill and one-time measurements excluded)

    @functools.cached_property
    def times(self) -> dict:
        """The phase totals, read once and only where a method reports them (on CUDA that resolves every event)."""
        return self.timer.totals()


class Method:
    name = ""
    needs_draft = True
    takes_threshold = False
    takes_tree = False
    defers_draft_prefill = False  # the driver leaves the draft's prompt to the method (hybrid)
    # every round commits exactly one token per live row and uses nothing the host reads of the
    # previous round, so the driver may launch the next round before reading this one (ar)
    one_token_rounds = False
    uses_cache = False  # suffix decoding: drafts from the engine's earlier responses, and remembers its own

    def __init__(self, gamma=None, policy=None, threshold=None, tree=None, defaults=None):
        if threshold is not None and not self.takes_threshold:
            raise SpecEngineError(f"threshold applies to sd's confidence and specdec++ policies, not to {self.name}",
                                  "threshold")
        if tree is not None and not self.takes_tree:
            raise SpecEngineError(f"tree drafting applies to sd, parallelspec and ngram, not to {self.name}", "tree")
        self.tree = None if tree is None else TreeShape.parse(tree)
        self.ctx: MethodContext | None = None

    @property
    def rows_independent(self) -> bool:
        """No per-row state of its own, so a round may run on the first rows only (tree rounds
        keep the whole buffer: compact_kv's extension wants it contiguous)."""
        return self.tree is None

    @property
    def max_width(self) -> int:
        """The most tokens per row any forward of a round feeds (draft catch-up included);
        the driver derives the KV headroom a round needs from it."""
        return 1

    def begin(self, ctx: MethodContext, call: CallInputs) -> None:
        self.ctx = ctx

    def round(self, state: DecodeState, timer) -> RoundOutput:
        raise NotImplementedError

    def after_round(self, n_acc: list[int], num_draft: list[int]) -> None:
        pass

    def timed(self, seconds: float) -> None:
        """The wall seconds the driver measured for the round last booked (after_round): methods
        that choose by cost compare it with their model (round_clock.py)."""

    def see_tokens(self, committed: list[list[int]]) -> None:
        """Each row's tokens committed this round, read by the round's one sync (host lists;
        empty for rows that sat it out): n-gram drafting matches on them."""

    def reset_rows(self, rows: list[int]) -> None:
        """New requests took these rows (serving core): forget any per-row state."""

    def stats(self, totals: CallTotals) -> dict:
        return {}

    def tree_stats(self) -> dict:
        t = self.tree
        return {} if t is None else {"tree": f"{t.topk}x{t.depth}:{t.nodes}", "tree_nodes": t.nodes}


def tokens_left(rows) -> int:
    """The most tokens any running row may still write: the driver's rows (`CallInputs.rows`), their
    limits and the ids they kept so far."""
    return max((row.max_new - len(row.ids) for row in rows if row.finish_reason is None), default=0)


def live_rows(rows) -> list[int]:
    """The driver's rows still running (`CallInputs.rows`), by index."""
    return [b for b, row in enumerate(rows) if row.finish_reason is None]


def speculative_stats(totals: CallTotals) -> dict:
    """What every draft-and-verify method reports (docs/design.md, "Metrics")."""
    counters, times = totals.counters, totals.times
    per_draft = times.get("draft", 0.0) / max(counters.draft_forwards, 1)
    per_target = times.get("target", 0.0) / max(counters.target_forwards, 1)
    return {
        "draft_forwards": counters.draft_forwards,
        "proposed_drafts": counters.proposed,
        "accepted_drafts": counters.accepted,
        "acceptance_rate": counters.accepted / max(counters.proposed, 1),
        "mean_accepted_tokens": counters.round_tokens / max(counters.row_rounds, 1),
        "acceptance_by_position": counters.acceptance_by_position(),
        "reached_by_position": list(counters.reached),
        "accepted_by_position": list(counters.accepted_at),
        "rounds": counters.rounds,
        "draft_s": times.get("draft", 0.0),
        "draft_cost_ratio": per_draft / per_target if per_target > 0 else None,
    }


def prediction(predicted: list[float], totals: CallTotals) -> dict:
    """The plan's tokens/s for the rounds it ran (predicted: [expected tokens, expected seconds],
    summed as each round was chosen) beside the measured decode rate (rounds only: prefill and
    the one-time measurements excluded), and the error between them; {} before any round."""
    if predicted[1] <= 0 or totals.decode_s <= 0:
        return {}
    rate, measured = predicted[0] / predicted[1], totals.new_tokens / totals.decode_s
    return {"predicted_tokens_per_s": rate, "decode_tokens_per_s": measured, "prediction_error": rate / measured - 1}
