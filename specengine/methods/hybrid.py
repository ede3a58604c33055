"""`hybrid`: `ngram` (ngram.py, which keeps the rows' bookkeeping) with a draft model: each round
goes to the n-gram proposals or to the draft model's chain as `sd` drafts it (its own γ: the
call's, or auto from the draft's measured step cost and the acceptance the engine's last greedy
call learned). With γ auto, to the one
the costs and acceptances expect to commit more tokens per second (`_draft_wins`), an n-gram
round charged the draft's later reading of its tokens; with a fixed γ, to the n-gram proposals
when every live row has one. The draft sits out the n-gram rounds; before it drafts again it
reads what it missed in forwards of at most the method's width. With γ auto the draft's prefill
is deferred (one prefill of the row's text, at its first chain) until the time its chains would
have saved, projected over the rest of the reply, pays for it (priced at the draft's own
measured prefill rate, `StepCosts.draft_prefill_s`): a reply the n-gram proposals carry never
pays it. The rest of the reply is known where nothing can end it before its limit (`ignore_eos`,
no stop string or constraint); elsewhere it is projected from what it has written.
"""
from __future__ import annotations

from contextlib import nullcontext

from . import draft_prime
from .ngram import NgramDecoding
from .policies import catch_up_s, expected_tokens, read_s
from .round_clock import TokenYield
from .state import DecodeState, RoundOutput
from .steps import chain_round

# the deferred draft prefill (draft_prime.py) is paid when the savings projected exceed this many times
# its cost: the projection's α is the engine's last call's (code, 0.65-0.75) where prose accepts ~0.5,
# and the prefill is paid for good
PRIME_MARGIN = 2.0


class HybridDecoding(NgramDecoding):
    """`hybrid`: n-gram chains where every live row has a match, the draft model's chain elsewhere."""
    name = "hybrid"
    needs_draft = True
    takes_tree = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        # this call's chains: committed / expected tokens (a method object serves one call). Its
        # text's own: carried across prompts it kept the draft out of one where `sd` ran 1.7x `ar`
        self.chain_yield = TokenYield()

    def _calibrates(self) -> bool:
        dp = self.draft_policy
        return getattr(dp, "calibrate", False) and getattr(getattr(dp, "costs", None), "measured", False)

    def after_round(self, n_acc, num_draft) -> None:
        if self.kind == "draft":
            self.draft_policy.token_scale = self.chain_yield.factor()  # the forecast books it as `_draft_wins` did
            if self._calibrates():  # before the policy moves α on from this round
                drafted = [(int(a), int(d)) for a, d in zip(n_acc, num_draft) if d]
                self.chain_yield.book(sum(expected_tokens(self.draft_policy.alpha, d) for _, d in drafted),
                                      sum(a + 1 for a, _ in drafted))
        elif self.kind != "grammar" and self.draft_policy.needs_costs:
            self.draft_policy.sat_out()
            self.draft_policy.remember_rate(self.ctx.acceptance, self.key)  # toward a stale rate (probe_wait.STALE_FIRST)
        super().after_round(n_acc, num_draft)

    def _draft_wins(self, found, gammas, live: list[int]) -> bool:
        """Hybrid: does this round go to the draft model? With γ auto, to whichever of the rows'
        n-gram proposals (a row without one commits its one token; no row with one: a plain
        decode) and the draft's chain the measured costs and learned acceptances expect to commit
        more tokens per second, each charged what it adds:
        - an n-gram or plain round, while the draft is in use, the draft's later reading of the
          tokens it commits (`policies.read_s` per token: what the catch-up will cost);
        - the draft's chain nothing more: the catch-up of earlier rounds was charged to them.
        While the draft has not read the rows' text (its prefill deferred), its chain would first
        pay that prefill once (`_prime_s`). It does so when the time the draft would have saved
        so far, projected over what the reply may still write (`_ahead`), exceeds the prefill;
        being paid for good, until this call timed chains it prices them no cheaper than the plain rounds measure, and an
        acceptance the engine never learned is the prior's (an unconditional first try paid the
        prefill, 0.26-0.37 s on the default pair, on replies where drafting then lost: a first
        call at 0.77-0.88x the next). The chain's expected tokens are scaled by what the call's
        chains committed against that expectation (`TokenYield`: bursty acceptance commits less
        than the geometric model of the same mean rate). A match-length bin with too few tries
        takes its n-gram round, so that its estimate is learned. With a fixed γ: the draft unless every row matched."""
        dp = self.draft_policy
        if gammas is None or getattr(dp, "costs", None) is None:
            return not all(found.get(b, ([], []))[0] for b in live)
        pol, c = self.policy, dp.costs
        if not all(self.primed[b] for b in live) and "spec" in dp.clock.prior:  # chains not timed since it was filed
            dp.gamma = draft_prime.reading_gamma(dp)  # as the read is priced (the chain runs at it where it wins)
        if dp.gamma == 0 or (gammas and pol.unexplored(gammas)):
            return False  # the draft's own costs say plain decoding (which the n-gram round beats)
        tokens = (pol.round_tokens(gammas) if gammas else 0.0) + len(live) - len(gammas)
        seconds = pol.seconds(max(gammas.values(), default=0) + 1)  # as the measured rounds corrected it
        chain_s = dp.gamma * c.draft_s + c.verify_s(dp.gamma + 1)
        draft = len(live) * expected_tokens(dp.alpha, dp.gamma) * self.chain_yield.factor() / chain_s
        if all(self.primed[b] for b in live):
            draft /= dp.clock.factor("spec")
            return draft > tokens / (seconds + tokens * read_s(c, self.max_width, self.max_width) / self.max_width)
        # not read: priced at this call's chain factor, or the plain rounds' where an earlier call filed the chains'
        # (a seeded factor counts as known; re-timed only by a chain, it kept the prompt unread for good:
        # draft_prime.chain_factor); none timed or filed, no cheaper than the model or the plain rounds say
        draft /= draft_prime.chain_factor(dp.clock) if dp.clock.known("spec") else max(1.0, dp.clock.factor("plain"))
        if draft <= tokens / seconds:
            return False
        self.saved += seconds - tokens / draft  # what this round would have saved with the draft
        written = [self.n_host[b] - self.start[b] for b in live]
        ahead = sum(self._ahead(b, w) for w, b in zip(written, live))
        prime = self._prime_s([self.n_host[b] for b in live if not self.primed[b]], c)
        return self.saved * ahead / max(sum(written), 1) > PRIME_MARGIN * prime

    def _ahead(self, b: int, written: int) -> int:
        """What row b may still write (draft_prime.ahead)."""
        return draft_prime.ahead(self.call.rows[b], written, self.limit[b] - self.n_host[b],
                                 self.call.state.constraints is not None)

    def _prime_s(self, lengths: list[int], costs) -> float:
        """Seconds of the deferred prefill of rows of these committed lengths (draft_prime.prime_s; a
        sampled call's choices time nothing, so it never prices by the call's own prefill)."""
        return draft_prime.prime_s(costs, lengths, self.max_width, self.prefill_token_s if self.key == "greedy" else None)

    def _prime(self, state: DecodeState, live: list[int]) -> None:
        """The deferred draft prefill of live rows whose text the draft has not read (draft_prime.prime):
        each then 1 behind, as after a prefill."""
        unread = [b for b in range(state.batch) if not self.primed[b]]
        self.primes += draft_prime.prime(self.ctx.draft, state, self.primed, live, self.n_host)
        for b in unread:
            if self.primed[b]:
                self.gap[b] = 1

    def _draft_round(self, state: DecodeState, live: list[int], timer) -> RoundOutput:
        """Hybrid: the draft model's chain (sd's round), after reading what it missed."""
        self.draft_rounds += 1
        self.primed_now, dp, watch = False, self.draft_policy, None
        unread = [self.n_host[b] for b in live if not self.primed[b]]  # the rows _prime reads now
        if unread:  # (γ auto only) the forecast pays the read's price; the chain's clock books the round without it
            watch = self.reading(dp.clock, self._prime_s(unread, dp.costs), state.tokens.device)
        with timer.phase("prime"), (watch or nullcontext()):  # the call's prefill, wherever it runs (stats["prefill_s"])
            self._prime(state, live)
        # up to 2 behind the chain's own catch-up reads; more after n-gram rounds it sat out
        behind = max(self.gap[b] for b in live) - 2
        if dp.needs_costs:  # what the round holds besides the chain, for its forecast
            dp.extra_s = catch_up_s(dp.costs, behind, self.max_width)
        return chain_round(self.ctx, state, self.draft_policy, timer, behind, self.max_width)


class HybridSuffixDecoding(HybridDecoding):
    """`hybrid` with suffix decoding's memory: the cache's proposals where they match, the draft
    model's chain elsewhere."""
    name = "hybrid-suffix"
    uses_cache = True
