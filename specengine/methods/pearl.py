"""`pearl`: parallel speculative decoding with adaptive draft length (PEARL, arXiv 2408.11850).

Each row is in one of two modes, kept on the device (pearl_round.py runs the rounds):
- pre-verify (start, and after any rejection): the draft drafts d1..dγ while the target
  runs on the last committed token, which gives p for d1; only d1 is verified. Reject:
  commit the correction, stay. Accept: commit d1, keep d2..dγ pending, go to post-verify.
- post-verify: the target verifies [last committed, pending] in one forward while the
  draft continues with e1..eγ after the last pending token; its outputs cover the pending
  tokens and e1. All accepted: commit them and e1, keep e2..eγ pending, stay. Else commit
  up to the rejection + the correction, drop e*, go back to pre-verify.
The draft length thus adapts by itself: long accepted runs keep extending a block.

This file is the host's side: the window (γ = round(1/c) by the measured costs), and with the window
chosen by cost, plain decoding wherever a PEARL round is expected to commit fewer tokens per second,
probes, flushes of pending drafts, and the draft's prompt read only once its rounds pay for that
(draft_prime.py, as `sd`'s γ auto).
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError
from ..timing import FILED, LEARNED  # store[f"pearl:greedy{LEARNED}"]: the engine's last greedy call's
from . import draft_prime
from .base import CallInputs, CallTotals, Method, live_rows, prediction, speculative_stats, tokens_left
from .context import MethodContext
from .pearl_round import PearlModes, drop_pending, flush_pending, pearl_round
from .policies import expected_tokens
from .probe_wait import ProbeWait
from .round_clock import RoundClock, recall_clock
from .state import DecodeState, RoundOutput
from .steps import PlainStep, draft_resync

GAMMA_MAX = 16  # the longest window round(1/c) may choose
PRIOR_ROUNDS = 4.0  # weight of the chain-model prior of tokens per round, as the acceptance prior's
PRIME_MARGIN = 1.0  # the draft reads the prompt where its rounds' projected savings pay this many times for it


def gamma_for(cost_ratio: float, gamma_max: int = GAMMA_MAX) -> int:
    """PEARL's window: γ = round(1 / c), so the draft's γ steps take as long as one target step."""
    return max(1, min(gamma_max, round(1.0 / max(cost_ratio, 1e-6))))


class Pearl(draft_prime.DeferredRead, Method):
    name = "pearl"
    rows_independent = False  # per-row modes sized to the whole batch

    def __init__(self, gamma=None, policy=None, threshold=None, tree=None, defaults=None):
        super().__init__(threshold=threshold, tree=tree)
        gamma = None if gamma == "auto" else gamma
        if gamma is not None and (not isinstance(gamma, int) or gamma < 1):
            raise SpecEngineError(f"pearl window gamma must be an integer >= 1, got {gamma!r}", "gamma")
        if policy not in (None, "fixed", "parallel"):
            raise SpecEngineError(f"pearl takes policy 'parallel' (the ParallelSpec drafter) or none, got {policy!r}",
                                  "policy")
        # "parallel": the window is drafted by ParallelSpec's drafter in one forward (default 4)
        self.parallel, self.drafter = policy == "parallel", None
        self.gamma = gamma = 4 if self.parallel and gamma is None else gamma  # None: round(1/c), in begin()
        self.by_cost = gamma is None  # a window chosen by cost may also choose plain decoding
        self.cost_ratio = self.costs = self.modes = None  # modes: PearlModes (begin)
        self.plain, self.behind = PlainStep(), 0  # γ = 0 rounds (see _plain_wins)
        # plain rounds, and those of them that verified pending drafts (pearl_round.flush_pending)
        self.plain_total = self.flushes = 0
        self.plain_last = False  # the last round launched was a plain step (one_token_rounds)
        self.wait, self.probed = ProbeWait(), False  # plain rounds before a probe; the last round was one
        self.rows, self.first = None, False  # the driver's rows (begin): what each may write and has kept
        self.accepted, self.proposed = 0.7 * 4, 4.0  # running acceptance: prior 0.7, weight 4, decayed
        self.yield_ = None  # committed tokens per PEARL round, running (sum, weight): not a chain's count (+30%)
        # measured vs predicted round seconds (round_clock.py): greedy, window by cost, measured costs
        # _kind: (kind, predicted seconds, expected tokens per row) of this round; _flushed: it was a flush
        self.clock, self.calibrate, self._kind, self._flushed = RoundClock(), False, None, False
        self.clock_key = self.learned_key = None  # where the engine keeps this call's corrections, and the rest (begin)

    @property
    def defers_draft_prefill(self) -> bool:
        """A window chosen by cost: the draft reads the prompt once PEARL's rounds pay for that."""
        return self.by_cost

    @property
    def max_width(self) -> int:
        if self.parallel:  # the draft forward: γ+1 real slots and γ-1 masks
            return 2 * self.gamma
        return (self.gamma or GAMMA_MAX) + 1

    def begin(self, ctx: MethodContext, call: CallInputs) -> None:
        super().begin(ctx, call)
        state = call.state
        if self.parallel:
            self.drafter = ctx.parallel_drafter()
            if self.gamma > self.drafter.meta.k_max:
                raise SpecEngineError(f"pearl window {self.gamma} exceeds the drafter's k_max={self.drafter.meta.k_max}")
        self.cost_ratio = ctx.step_costs(state, 1).cost_ratio
        self.gamma = self.gamma or gamma_for(self.cost_ratio)
        if self.by_cost:  # the verify widths the window's rounds run, for the plain-decoding check
            self.costs = ctx.step_costs(state, self.gamma + 1)
            # PEARL's rounds are its own kind of round: its own key
            self.calibrate, self.clock_key = recall_clock(self.clock, ctx.acceptance, self.name, call, self.costs)
            self.learned_key = f"{self.name}:{call.mode}{LEARNED}"
            if self.calibrate:  # this engine's last call, else what earlier processes filed (FiledClocks)
                self._recall(ctx.acceptance.get(self.learned_key) or ctx.acceptance.get(self.learned_key + FILED))
        self.modes = PearlModes(torch.zeros(state.batch, dtype=torch.bool, device=state.tokens.device))
        self.rows, self.state, self.first = call.rows, state, True  # first: the call's first round is next
        self.primed = [not self.defers_draft_prefill] * state.batch

    def _recall(self, learned: dict | None) -> None:
        """Start from what the engine's last greedy call learned (each at its prior's weight): the
        acceptance, the tokens its rounds committed against the chain model's count (so a window of
        another γ scales alike), and its probe wait with the plain rounds counted on: a probe then often
        falls on a call's first round, where the just-prefilled draft owes no catch-up. Where PEARL loses
        (AVX2 copy on the Xeon: break-even 2.1 tokens a window of 3, ~1.9 had), every call otherwise paid
        its first windows at the prior's 2.5 and a probe after 16 plain rounds (0.92x `ar`)."""
        if not learned:
            return
        alpha = learned["alpha"]
        self.accepted, self.proposed = alpha * 4.0, 4.0
        self.yield_ = (PRIOR_ROUNDS * learned["scale"] * expected_tokens(alpha, self.gamma), PRIOR_ROUNDS)
        self.wait.every, self.wait.run = learned["every"], learned["run"]

    def _remember(self) -> None:
        """What the next greedy call of this engine starts from (`_recall`)."""
        if self.learned_key is None:  # not begun by an engine
            return
        alpha = self._alpha()
        self.ctx.acceptance[self.learned_key] = {
            "alpha": alpha, "scale": self.round_tokens() / expected_tokens(alpha, self.gamma), "every": self.wait.every,
            "run": self.wait.run}

    def _plain_wins(self) -> bool:
        """Window chosen by cost only: a PEARL round is expected to commit fewer tokens per second
        than a plain decode step (`_round_s`), so the round decodes plainly instead.
        After a run of plain rounds one PEARL round runs anyway, to follow the text (`ProbeWait`,
        as sd's γ auto). With drafts pending (a round accepted its window) the next round is a
        post-verify round, whose drafts are paid for: it runs where its own expected tokens (a chain
        of γ at α without the bonus) beat a plain step (AVX2 copy, α 0.77, window 3: ~2.4 tokens at
        2.1 plain steps' cost, where a pre-verify round commits 1). So a probe lasts while its
        windows are accepted, rather than ending on its pre-verify round (1 token, always "plain
        wins") with its accepted drafts dropped."""
        plain, why = self._choice()
        if why == "pending":
            return plain
        self.first = False
        if why == "probe":
            self.probed = True
        elif why == "cost" and self.probed:  # the round after a probe: plain again doubles the wait, PEARL resets it
            self.wait.settle(plain)
            self.probed = False
        return plain

    def _choice(self) -> tuple[bool, str]:
        """The next round's (plain, why) by what the host knows now, changing nothing; why: "given"
        (the window), "pending" (drafts pending), "probe", "timing" (plain, timed once), "cost"."""
        if not self.by_cost:
            return False, "given"
        f = self.clock.factors() if self.calibrate else {}
        if self.modes.any_post:
            alpha = self._alpha()
            return not self._beats_plain(expected_tokens(alpha, self.gamma) - alpha ** self.gamma, f), "pending"
        left = None if self.rows is None else tokens_left(self.rows)
        # a wait under way (plain rounds carried from the last call) that ends within this call ends at
        # its first round, where the draft owes no catch-up; with none under way the costs choose
        early = self.first and self.wait.run > 0 and left is not None and self.wait.run + left >= self.wait.every
        if early or (self._probes_mid_call() and self.wait.due(left, owed=self.behind)):
            return False, "probe"
        if self.calibrate and self.clock.wants_plain():  # time plain decoding once to compare
            return True, "timing"
        return not self._beats_plain(self.round_tokens(), f), "cost"

    @property
    def concurrent(self) -> bool:
        """Draft and target run at once (two CUDA streams), else in turn: a round's cost, probes, stats."""
        return self.ctx.device.type == "cuda"

    def _probes_mid_call(self) -> bool:
        """A probe later in a call first catches the draft up on each token it sat out: run in turn that is
        ~0.13 of a target step a token, so a plain stretch paid >= 13% for its probes however the wait
        grew (docs/design.md, "Never slower"). There probes fall on a call's first round only."""
        return self.concurrent

    @property
    def one_token_rounds(self) -> bool:
        """A plain step, and the next one plain too by what the host knows before reading it: the driver
        may launch it ahead, as for `ar` (a GPU PEARL whose windows lose pays no host gap a round); also
        while the draft's read of the prompt does not pay (decided on the same host view as `round`)."""
        return self.plain_last and (self._unread_sits_out() or self._choice()[0])

    def _beats_plain(self, tokens: float, factors: dict) -> bool:
        """A PEARL round of `tokens` per row beats a plain step (seconds as the clock corrected them)."""
        return tokens / (self._round_s() * factors.get("spec", 1.0)) > 1.0 / (self.costs.verify_s(1) * factors.get("plain", 1.0))

    def round_tokens(self) -> float:
        """Expected committed tokens per row of a PEARL round: the running mean of this call's rounds,
        from the chain model's count at the prior acceptance (PRIOR_ROUNDS rounds' weight, as α's)."""
        if self.yield_ is None:
            return expected_tokens(self._alpha(), self.gamma)
        return self.yield_[0] / self.yield_[1]

    def _round_s(self) -> float:
        """A PEARL round's model seconds: window and verify, overlapped or in turn."""
        parts = (self.gamma * self.costs.draft_s, self.costs.verify_s(self.gamma + 1))
        return max(parts) if self.concurrent else sum(parts)

    def round(self, state: DecodeState, timer) -> RoundOutput:
        self.primed_now = False
        plain = self._unread_sits_out() or self._plain_wins()  # an unread prompt: no probe either
        flush = plain and self._flush_pays()
        self._book(plain, flush)
        self.wait.count(plain)
        self.plain_last = plain and not flush
        if plain:
            self.plain_total += 1
            if flush:
                self.flushes += 1
                return flush_pending(self.ctx, self.modes, state, self.gamma, timer)
            self.behind += 1
            drop_pending(self.modes)
            draft = self.ctx.draft.cache  # the draft keeps what it saw of the committed tokens only
            draft.set_lens(torch.minimum(draft.lens.to(torch.int64), state.n - 1))
            return self.plain(self.ctx, state, timer)
        live = live_rows(self.rows)
        read = self.read_in_round(self.rows, state, live, timer, self, self.max_width)
        if read and read == len(live):  # every live row read now: 1 behind, as after a prefill (a serving core's others may lag)
            self.behind = 0
        if self.behind:
            draft_resync(self.ctx.draft, state, self.behind)
            self.behind = 0
        with timer.phase("round"):
            return pearl_round(self.ctx, self.modes, state, self.gamma, timer, self.drafter)

    def _unread_sits_out(self) -> bool:
        """The draft has not read some live row's text and reading it would not pay (draft_prime.pays,
        PRIME_MARGIN): a plain step. A PEARL round saves a plain step's seconds a token less its own,
        as the clock corrected them (a PEARL round's factor this call's, else the plain rounds':
        draft_prime.chain_factor); where PEARL loses (most rounds on a CPU) the draft never reads."""
        if all(self.primed):  # (a stub call never begun: nothing deferred)
            return False
        live = live_rows(self.rows)
        if all(self.primed[b] for b in live):
            return False
        plain_f, spec_f = (self.clock.factor("plain"), draft_prime.chain_factor(self.clock)) if self.calibrate else (1, 1)
        saved = self.costs.verify_s(1) * plain_f - self._round_s() * spec_f / self.round_tokens()
        return not draft_prime.pays(self.rows, live, self.primed, self.costs, self.max_width, saved,
                                    self.state.constraints is not None, PRIME_MARGIN)

    def _book(self, plain: bool, flush: bool = False) -> None:
        """What the round about to run is predicted to cost and commit per row, booked against its
        measured time (`after_round`, `timed`): a flush and a plain step are target forwards alone."""
        self._flushed = flush
        if not self.by_cost:
            return
        if flush:
            self._kind = ("plain", self.costs.verify_s(self.gamma), expected_tokens(self._alpha(), self.gamma - 1))
        else:
            self._kind = ("plain", self.costs.verify_s(1), 1.0) if plain else ("spec", self._round_s(), self.round_tokens())

    def _alpha(self) -> float:
        return self.accepted / self.proposed

    def _flush_pays(self) -> bool:
        """Plain decoding chosen while a round's accepted window left drafts pending: the target
        verifies them in one forward, without a new window (`pearl_round.flush_pending`), where the tokens
        that commits (a chain of γ - 1 at α, bonus included) beat a plain step's one at their cost. Drafted already,
        they were dropped before: a probe whose first window was accepted paid two plain steps' cost
        for 1 token (AVX2 copy, window 4) and threw away 3 drafts that a forward of 4 tokens (1.1-1.3
        steps) verifies."""
        if not self.modes.any_post or self.gamma < 2:  # (plain rounds are chosen by cost: costs are set)
            return False
        return expected_tokens(self._alpha(), self.gamma - 1) * self.costs.verify_s(1) > self.costs.verify_s(self.gamma)


    def after_round(self, n_acc, num_draft) -> None:
        """Host bookkeeping after the round's sync (the modes themselves moved on the device)."""
        if self._kind is not None:
            kind, model_s, tokens = self._kind  # booked with the tokens the plan expected of it
            self.clock.expect(kind, model_s, len(n_acc) * tokens)
        if self._flushed:  # the drafts' acceptance counts; a flush is not a PEARL round (its yield) nor a window
            self.accepted, self.proposed = 0.9 * self.accepted + sum(n_acc), 0.9 * self.proposed + sum(num_draft)
            if len(n_acc) == 1:
                self.modes.trace.append(("flush", num_draft[0], n_acc[0]))
        if self._flushed or not any(num_draft):  # a plain round: nothing was proposed (its wait still counts)
            if self.calibrate:
                self._remember()
            return
        total, weight = self.yield_ or (PRIOR_ROUNDS * self.round_tokens(), PRIOR_ROUNDS)  # the prior: α's, as a chain
        # committed: the accepted tokens, plus the correction where one was rejected; a round that
        # accepted all commits no bonus (the draft's next tokens stay pending for the next verify)
        committed = sum(a + (a < d) for a, d in zip(n_acc, num_draft))
        self.yield_ = (0.9 * total + committed, 0.9 * weight + len(n_acc))
        self.accepted, self.proposed = 0.9 * self.accepted + sum(n_acc), 0.9 * self.proposed + sum(num_draft)
        full = [a >= d for a, d in zip(n_acc, num_draft)]
        self.modes.rejections += sum(not f for f in full)
        self.modes.any_post = any(full)
        if len(n_acc) == 1:  # num_draft is γ in post-verify, 1 in pre-verify
            self.modes.trace.append(("post" if num_draft[0] > 1 else "pre", num_draft[0], n_acc[0]))
        if self.calibrate:
            self._remember()

    def timed(self, seconds: float) -> None:
        if self.calibrate:  # a reading round: its PEARL round's time, the read taken out
            self.clock.timed(self.chain_s(seconds))
            if self.clock_key is not None:  # the engine's next call starts from these corrections
                self.ctx.acceptance[self.clock_key] = self.clock.factors()

    def reset_rows(self, rows: list[int]) -> None:
        """A new request starts in pre-verify with nothing pending, its text prefilled into the draft or
        read at its first PEARL round."""
        if self.modes is not None:
            self.modes.post[rows] = False
        self.unread_again(rows)

    def stats(self, totals: CallTotals) -> dict:
        """MAT: mean run length between rejections (PEARL's definition), and per-round times."""
        rows, rounds, times = totals.rows, max(totals.counters.rounds, 1), totals.times
        new_tokens = sum(len(r.ids) for r in rows)
        runs = self.modes.rejections + sum(1 for r in rows if r.ids)
        return {
            "policy": "pearl+parallel" if self.parallel else "pearl", "gamma": self.gamma, "gamma_mean": float(self.gamma),
            **speculative_stats(totals),
            "mean_accepted_tokens": new_tokens / max(runs, 1),
            "measured_cost_ratio": self.cost_ratio,
            "round_draft_s": times.get("draft", 0.0) / rounds, "round_target_s": times.get("target", 0.0) / rounds,
            "round_wall_s": times.get("round", 0.0) / rounds,
            "concurrent": self.concurrent,
            "plain_rounds": self.plain_total,
            "flush_rounds": self.flushes,
            "draft_prefills_deferred": self.primes,
            "round_cost_factors": self.clock.factors(),  # measured / predicted round seconds
            **prediction(self.clock.forecast, totals),
        }
