"""`sd`: chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

One round: the draft proposes γ tokens autoregressively; the target scores
[last committed, d1..dγ] in one forward; the rejection sampler accepts a prefix and adds
one corrected or bonus token; the driver rolls both caches back by setting their lengths.
γ comes from a draft-length policy (`policies.py`), `auto` by default. With `tree="KxD:N"`
the draft proposes a token tree instead (steps.draft_tree). The draft's bookkeeping (1 or 2
tokens behind after a round) is in steps.py. With γ auto the draft reads the prompt at the first
chain whose projected savings over the rest of the reply pay for that prefill (draft_prime.py).
"""
from __future__ import annotations

from ..errors import SpecEngineError
from . import draft_prime
from .base import CallInputs, CallTotals, Method, live_rows, prediction, speculative_stats, tokens_left
from .context import MethodContext
from .policies import catch_up_s, expected_tokens, make_policy
from .state import DecodeState, RoundOutput
from .steps import PlainStep, chain_round, draft_tree, grammar_drafts, verify_proposals, verify_tree_and_commit

# The deferred draft prefill is paid where the chains' projected savings exceed this many times its cost:
# the savings come from the pair's acceptance the engine learned over its calls (hybrid's n-gram
# rounds, which win without the draft, ask twice: hybrid.PRIME_MARGIN).
PRIME_MARGIN = 1.0


class SpeculativeDecoding(draft_prime.DeferredRead, Method):
    name = "sd"

    takes_threshold = True
    takes_tree = True

    def __init__(self, gamma=None, policy=None, threshold=None, tree=None, defaults=None):
        super().__init__(tree=tree)
        if self.tree is not None and (gamma is not None or policy not in (None, "fixed") or threshold is not None):
            raise SpecEngineError("sd with a tree takes its shape from the tree ('KxD:N'), not gamma/policy/threshold",
                                  "tree")
        if self.tree is not None:
            gamma, policy = self.tree.depth, "fixed"
        gamma = getattr(defaults, "gamma", "auto") if gamma is None else gamma  # the engine's, where the call has none
        policy = policy or getattr(defaults, "policy", "fixed")
        threshold = getattr(defaults, "threshold", None) if threshold is None else threshold
        self.policy = make_policy(policy, gamma, threshold=threshold)
        self.gammas: list[int] = []  # γ of every round (0: a plain decode round)
        self.plain, self.behind = PlainStep(), 0  # tokens committed since the draft last ran (at most)
        self.grammar_round, self.grammar_rounds = False, 0  # this round verified the grammar's forced tokens

    @property
    def defers_draft_prefill(self) -> bool:
        """γ auto chains: the draft reads the prompt once its chains pay for that (draft_prime.py)."""
        return self.tree is None and self.policy.needs_costs

    @property
    def one_token_rounds(self) -> bool:
        """γ auto decoding plainly: the next round is a plain step too (γ changes only when the host
        books a round), so the driver may launch it before reading this one, as for `ar`; also while the
        draft's deferred prefill does not pay (decided on the same host view as that round's `round`)."""
        if self.tree is not None or not self.policy.needs_costs:
            return False
        if self.policy.gamma == 0:
            return True
        return self._unread_sits_out(live_rows(self.rows))

    @property
    def max_width(self) -> int:
        if self.tree is not None:  # the verify forward, or the last draft forward over D-1 levels
            return max(self.tree.nodes + 1, (self.tree.depth - 1) * self.tree.topk, 2)
        return self.policy.gamma_max + 1

    def begin(self, ctx: MethodContext, call: CallInputs) -> None:
        super().begin(ctx, call)
        self.rows, self.state = call.rows, call.state  # the driver's: what each row may write and has kept
        self.primed = [not self.defers_draft_prefill] * call.state.batch
        if self.tree is not None:
            return
        if self.policy.wants_hidden:  # specdec++: the acceptance head for this draft and mode
            mode = call.mode
            # reading a flag per draft step is free only without an asynchronous device queue
            self.policy.attach(ctx.acceptance_head(mode), early_exit=ctx.device.type == "cpu")
        if self.policy.needs_costs:  # gamma="auto": γ from measured step costs and the pair's acceptance so far
            self.key = call.mode
            self.policy.calibrate = self.key == "greedy"
            if self.key == "greedy":  # a seeded sampled call repeats its tokens: no state of earlier calls
                self.policy.recall(ctx.acceptance, self.key)
            self.policy.set_costs(ctx.step_costs(call.state, self.max_width))

    def round(self, state: DecodeState, timer) -> RoundOutput:
        ctx, self.primed_now = self.ctx, False
        if self.tree is not None:
            with timer.phase("draft"):
                tree = draft_tree(ctx, state, self.tree)
            return verify_tree_and_commit(ctx, state, tree, self.tree, timer, draft_forwards=self.tree.depth)
        forced = grammar_drafts(state, range(state.batch), self.policy.gamma_max)  # finished rows: frozen
        self.grammar_round = bool(forced)
        if forced:  # the constraint's forced tokens, verified at no draft forward; the draft sits out
            self.grammar_rounds += 1
            self.behind += max(len(f) for f in forced.values()) + 1
            return verify_proposals(ctx, state, [forced.get(b, []) for b in range(state.batch)], timer)
        if self.policy.gamma == 0:  # γ auto: speculation would lose here; the draft sits out
            self.gammas.append(0)
            self.behind += 1
            return self.plain(ctx, state, timer)
        live = live_rows(self.rows)
        if self._unread_sits_out(live):  # the draft sits out, its prompt unread
            self.gammas.append(0)
            self.behind += 1
            return self.plain(ctx, state, timer)
        # the draft reads unread rows' text now (γ auto only): 1 behind after, as after a prefill
        if self.read_in_round(self.rows, state, live, timer, self.policy, self.max_width):
            self.behind = 0
        if self.policy.needs_costs:  # the catch-up this round pays, priced where the clock books it
            self.policy.extra_s = catch_up_s(self.policy.costs, self.behind, self.max_width)
        out = chain_round(ctx, state, self.policy, timer, self.behind)
        self.behind = 0
        self.gammas.append(out.draft_forwards)  # a policy may have ended the loop early
        return out

    def _unread_sits_out(self, live: list[int]) -> bool:
        """The draft has not read some live row's text and reading it would not pay: a plain step."""
        return not all(self.primed[b] for b in live) and not self._prime_pays(live)

    def _prime_pays(self, live: list[int]) -> bool:
        """Would chains pay PRIME_MARGIN times for the draft's read of the prompt (draft_prime.pays)? A
        chain saves a plain step's seconds less its own over its expected tokens, as the clock corrected them
        (a chain's factor this call's, else the plain rounds': draft_prime.chain_factor)."""
        pol, c = self.policy, self.policy.costs
        plain_s = c.verify_s(1) * pol.clock.factor("plain")
        chain_s = (pol.gamma * c.draft_s + c.verify_s(pol.gamma + 1)) * draft_prime.chain_factor(pol.clock)
        saved = plain_s - chain_s / expected_tokens(pol.alpha, pol.gamma)
        return draft_prime.pays(self.rows, live, self.primed, c, self.max_width, saved,
                                self.state.constraints is not None, PRIME_MARGIN)

    def reset_rows(self, rows: list[int]) -> None:
        self.unread_again(rows)  # the serving core put a new request there: prefilled, or read at its first chain

    def after_round(self, n_acc, num_draft) -> None:
        if self.grammar_round:  # forced tokens say nothing of the draft's acceptance or costs
            return
        if self.policy.needs_costs:  # γ auto: no probe catches up more tokens than are left (ProbeWait.due)
            self.policy.left = tokens_left(self.rows)
        if self.tree is None:
            self.policy.update(n_acc, num_draft)
        if self.policy.needs_costs:
            self.policy.remember(self.ctx.acceptance, self.key)

    def timed(self, seconds: float) -> None:
        if self.tree is None and self.policy.needs_costs:  # a reading round: its chain's time, the read taken out
            self.policy.timed(self.chain_s(seconds))

    def prediction(self, totals: CallTotals) -> dict:
        """γ auto: the plan's tokens/s for the rounds it chose beside the measured decode rate."""
        if not self.policy.needs_costs:
            return {}
        found = prediction(self.policy.clock.forecast, totals)
        return found and {**found, "round_cost_factors": self.policy.clock.factors()}  # measured / predicted s

    def stats(self, totals: CallTotals) -> dict:
        drafted = [g for g in self.gammas if g]
        return {"policy": self.policy.name, "gamma": self.policy.gamma, **self.tree_stats(),
                "gamma_mean": sum(drafted) / max(len(drafted), 1),  # over the rounds that drafted
                "plain_rounds": len(self.gammas) - len(drafted), "grammar_rounds": self.grammar_rounds,
                "draft_prefills_deferred": self.primes,
                **self.prediction(totals), **speculative_stats(totals)}
