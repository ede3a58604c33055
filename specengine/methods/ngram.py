"""`ngram`: speculative decoding without a draft model (prompt lookup / n-gram drafting).

Each round proposes, per row, the continuation of the row's longest recent suffix that also
occurs earlier in its own prompt + output (ngram_index.py), and the target verifies it in
one forward as one-hot drafts (the rejection sampler with q = None): greedy gives `ar`'s
tokens, sampling the target's distribution. With `tree="KxD:N"` the continuations of every
earlier occurrence are merged into a token tree, verified with the tree acceptance and KV
compaction `sd` trees use. Matching runs on the host over the tokens the round's one sync
already read; the proposal goes to the device without blocking. A round in which no row has
a match is a plain decode step, never a useless verify.

γ: an integer (the longest proposal, transformers' `prompt_lookup_num_tokens`) or "auto":
per row, from the occurrence whose preceding tokens match the history's end the longest, the
γ that maximizes expected tokens per second from the target's measured cost per verify width
and the acceptance learned for matches of that length (ngram_policy.py); γ = 0 proposes
nothing for that row.

`hybrid` (HybridDecoding, below): with a draft model, each round goes to the n-gram proposals
or to the draft model's chain as `sd` drafts it (its own γ: the call's, or auto from the draft's
measured step cost and the acceptance the engine's last call learned). With γ auto, to the one
the costs and acceptances expect to commit more tokens per second (`_draft_wins`), an n-gram
round charged the draft's later reading of its tokens; with a fixed γ, to the n-gram proposals
when every live row has one. The draft sits out the n-gram rounds; before it drafts again it
reads what it missed in forwards of at most the method's width. With γ auto the draft's prefill
is deferred (one prefill of the row's text, at its first chain) until the time its chains would
have saved, projected over the rest of the reply, pays for it: a reply the n-gram proposals
carry never pays it.
"""
from __future__ import annotations

import dataclasses

import torch

from .ngram_index import NgramIndex, check_sizes
from .ngram_policy import NgramGammaPolicy
from ..errors import SpecEngineError
from .base import CallInputs, CallTotals, Method, prediction, speculative_stats
from .context import MethodContext
from .policies import catch_up_s, expected_tokens, make_policy, read_s
from .round_clock import RoundClock, recall_clock
from .state import DecodeState, RoundOutput
from .steps import PlainStep, chain_round, grammar_drafts, to_device, verify_proposals, verify_tree_and_commit
from .suffix_cache import SuffixIndex
from .token_tree import TokenTree, TreeShape

MIN_TIMED_PREFILL = 16  # prompt tokens below which the driver's prefill time is mostly overhead, not a rate
# hybrid, draft prefill deferred: the reply is expected to write this many times what it has so far
# (chosen by host-only replays and an interleaved A/B: docs/design.md, "Experiments")
PRIME_HORIZON = 2.0


class NgramDecoding(Method):
    name = "ngram"
    needs_draft = False  # a loaded draft model sits this method out
    takes_tree = True

    def __init__(self, gamma=None, policy=None, threshold=None, tree=None, defaults=None):
        self.auto_tree = isinstance(tree, str) and tree == "auto"  # trees sized by the costs (choose_trees)
        if self.auto_tree and not self.takes_tree:
            raise SpecEngineError(f"tree drafting applies to sd, parallelspec and ngram, not to {self.name}", "tree")
        if self.auto_tree and gamma not in (None, "auto"):
            raise SpecEngineError("tree='auto' sizes each tree by the measured costs; leave gamma 'auto'", "gamma")
        super().__init__(threshold=threshold, tree=None if self.auto_tree else tree)
        if policy not in (None, "fixed"):
            raise SpecEngineError(f"ngram proposes what matches; draft-length policy {policy!r} applies to sd",
                                  "policy")
        if self.tree is not None and gamma is not None:
            raise SpecEngineError("ngram with a tree takes its shape from the tree ('KxD:N'), not gamma", "tree")
        gamma = getattr(defaults, "gamma", "auto") if gamma is None else gamma
        self.by_match = self.tree is None and (gamma == "auto" or self.auto_tree)
        self.policy = NgramGammaPolicy() if self.by_match else make_policy(
            "fixed", self.tree.depth if self.tree is not None else gamma)
        self.sizes = (getattr(defaults, "ngram_max", 3), getattr(defaults, "ngram_min", 1))
        check_sizes(*self.sizes)
        self.index: list[NgramIndex | None] = []
        self.plain = PlainStep()
        self.matched_rounds = self.plain_rounds = self.draft_rounds = self.grammar_rounds = self.tree_rounds = 0
        self.draft_policy = make_policy("fixed", gamma)  # hybrid: the draft model's chain length
        self.hybrid, self.kind = False, "plain"  # this round: "ngram", "draft" or "plain"
        self.gap: list[int] = []  # hybrid: per row, at most this many committed tokens the draft has not read
        self.key = "greedy"  # hybrid: the decoding mode the engine keeps the draft's acceptance under
        self.saved = 0.0  # hybrid: seconds the draft's chains would have saved so far while its prefill waits
        self.start: list[int] = []  # per row: its prompt length
        self.limit: list[int] = []  # per row: the committed length at which it stops (prompt + max_new)
        self.primed: list[bool] = []  # hybrid, per row: the draft's cache holds the row's text
        self.n_host: list[int] = []  # per row: its committed length (prompt + what the syncs read)
        self.prefill_token_s: float | None = None  # the target's measured prefill seconds per prompt token
        self.primes, self.primed_now = 0, False  # deferred draft prefills run; one ran in this (draft) round
        self.caches = None  # suffix decoding: the engine's SuffixCaches (methods/suffix_cache.py)
        # γ by match: n-gram and plain rounds' measured vs predicted seconds, the plan's forecast (round_clock.py)
        self.clock, self.calibrate, self.clock_key = RoundClock(switch_costs=False), False, None
        self._booked = None  # this round's (kind, tokens, model seconds)

    @property
    def rows_independent(self) -> bool:
        return super().rows_independent and not self.auto_tree

    @property
    def defers_draft_prefill(self) -> bool:
        return self.needs_draft and self.by_match

    @property
    def max_width(self) -> int:
        if self.tree is not None:
            return self.tree.nodes + 1
        return max(self.policy.gamma_max, self.draft_policy.gamma_max) + 1

    def begin(self, ctx: MethodContext, call: CallInputs) -> None:
        super().begin(ctx, call)
        self.call = call
        self.hybrid = self.needs_draft  # `hybrid`: the engine has a draft (checked before the call)
        self.caches = ctx.suffix_caches if self.uses_cache else None
        self.saved = 0.0
        self.start_rows(call.prompts, [row.max_new for row in call.rows], call.prefill_s)
        if self.by_match:  # the match-length curves the engine's earlier calls of this method counted
            self.policy.recall(ctx.acceptance, f"{self.name}:{call.mode}:by_match")
        if self.policy.needs_costs or (self.hybrid and self.draft_policy.needs_costs):
            costs = ctx.step_costs(call.state, self.max_width, draft=self.hybrid)
            if self.policy.needs_costs:  # n-gram proposals are free: only the target's cost per width
                self.policy.set_costs(dataclasses.replace(costs, draft_s=0.0))
            if self.by_match:
                self.calibrate, self.clock_key = recall_clock(self.clock, ctx.acceptance, self.name, call, costs)
            if self.hybrid and self.draft_policy.needs_costs:
                self.key = call.mode
                self.draft_policy.calibrate = self.key == "greedy"  # its chains' times correct its costs
                self.draft_policy.recall(ctx.acceptance, self.key)
                self.draft_policy.set_costs(costs)

    def start_rows(self, prompts: list[list[int]], max_new: list[int], prefill_s: float) -> None:
        """The host state of a call's rows (host-only, so a replay without the models can drive it),
        and the target's prefill rate where enough tokens were timed (the serving core's placeholders:
        none)."""
        n = len(prompts)
        self.index, self.gap, self.primed, self.n_host, self.start, self.limit = ([None] * n for _ in range(6))
        for b, (prompt, m) in enumerate(zip(prompts, max_new)):
            self._start_row(b, prompt, m)
        prefilled = sum(len(p) - 1 for p in prompts)
        self.prefill_token_s = prefill_s / prefilled if prefilled >= MIN_TIMED_PREFILL else None

    def _start_row(self, b: int, prompt: list[int], max_new: int) -> None:
        self.index[b] = NgramIndex(prompt, *self.sizes)
        if self.caches is not None:  # suffix decoding: earlier responses under the row's key too (None: opted out)
            key = self.call.rows[b].cache_key
            if key is not None:
                self.index[b] = SuffixIndex(self.index[b], self.caches.get(key))
        self.gap[b] = 1  # after a prefill the draft holds all but the last token
        self.primed[b] = not self.defers_draft_prefill  # else its prefill waits until it pays
        self.n_host[b] = self.start[b] = len(prompt)
        self.limit[b] = len(prompt) + max_new

    def reset_rows(self, rows: list[int]) -> None:
        for b in rows:  # the serving core put a new request there (prefilled: the draft 1 behind)
            self._start_row(b, self.call.prompts[b], self.call.rows[b].max_new)

    def see_tokens(self, committed: list[list[int]]) -> None:
        for b, new in enumerate(committed):
            if new and b < len(self.index):
                self.index[b].extend(new)
                self.n_host[b] += len(new)
            if b < len(self.gap):  # a draft round leaves the draft at most 2 tokens behind
                self.gap[b] = 2 if self.kind == "draft" else self.gap[b] + len(new)

    def _live(self, state: DecodeState) -> list[int]:
        rows = self.call.rows
        return [b for b in range(state.batch) if rows[b].finish_reason is None]

    def plan(self, live: list[int]) -> tuple[str, dict]:
        """This round's kind ("ngram", "draft" or "plain") and the live rows' proposals
        {row: (tokens, parents or None)}. Host-only: the indexes and the policies' estimates
        (a replay can drive it without the models)."""
        gammas = None
        if self.tree is not None:
            shape = self.tree
            found = {b: self.index[b].propose_tree(shape.topk, shape.depth, shape.nodes) for b in live}
        elif self.auto_tree:
            hits = {b: hit for b in live if (hit := self.index[b].lookup()) is not None}
            depth = self.policy.gamma_max
            found = self.policy.choose_trees({b: (m, self.index[b].continuations(h, depth, m))
                                              for b, (h, m) in hits.items()})
        elif self.by_match:
            found = {b: hit for b in live if (hit := self.index[b].lookup()) is not None}
            self.policy.scale = self.clock.factors() if self.calibrate else {}
            gammas = self.policy.choose({b: m for b, (_, m) in found.items()})
            found = {b: (self.index[b].continuation(s, gammas[b]), None) for b, (s, _) in found.items() if b in gammas}
        else:
            g = self.policy.gamma
            found = {b: (self.index[b].propose(g), None) for b in live} if g else {}
        if self.hybrid and self._draft_wins(found, gammas, live):  # never with γ auto at 0
            self._booked = None  # the draft policy books its chains
            return "draft", {}
        kind = "ngram" if any(toks for toks, _ in found.values()) else "plain"
        self._booked = self.policy.forecast(kind, len(live), gammas) if self.by_match else None
        return kind, found

    def round(self, state: DecodeState, timer) -> RoundOutput:
        ctx, live = self.ctx, self._live(state)
        with timer.phase("draft"):
            self.kind, found = self.plan(live)
            forced = self._grammar_drafts(state, live)
        if forced:  # the grammar's forced tokens first; rows without any keep their n-gram proposal
            self.kind, found = "grammar", {b: (forced[b], None) if b in forced else found[b]
                                           for b in set(forced) | (set() if self.kind == "draft" else set(found))}
        if self.kind == "draft":
            return self._draft_round(state, live, timer)
        if self.kind == "plain":
            self.plain_rounds += 1
            return self.plain(ctx, state, timer)
        self.matched_rounds += self.kind == "ngram"
        proposals = [found.get(b, ([], [])) for b in range(state.batch)]
        if self.tree is None and not any(par and par != list(range(len(par))) for _, par in proposals):
            return verify_proposals(ctx, state, [t for t, _ in proposals], timer)  # chains (trees that are paths)
        return self._tree_round(state, proposals, timer)

    def _grammar_drafts(self, state: DecodeState, live: list[int]) -> dict:
        """{row: tokens of the text its constraint forces next} (grammar drafting, structured/rows.py):
        drafts at no draft forward, accepted unless the model spells that text otherwise; chains only."""
        forced = {} if self.tree is not None else grammar_drafts(state, live, self.max_width - 1)
        self.grammar_rounds += bool(forced)
        return forced

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
        so far, projected over what the reply may still write (PRIME_HORIZON times what it has
        written, at most its limit), exceeds the prefill; being paid for good, until chains are
        timed it prices them no cheaper than the plain rounds measure. A match-length bin with too
        few tries takes its n-gram round, so that its estimate is learned. With a fixed γ: the draft
        unless every row matched."""
        dp = self.draft_policy
        if gammas is None or getattr(dp, "costs", None) is None:
            return not all(found.get(b, ([], []))[0] for b in live)
        pol, c = self.policy, dp.costs
        if dp.gamma == 0 or (gammas and pol.unexplored(gammas)):
            return False  # the draft's own costs say plain decoding (which the n-gram round beats)
        tokens = (pol.round_tokens(gammas) if gammas else 0.0) + len(live) - len(gammas)
        seconds = pol.seconds(max(gammas.values(), default=0) + 1)  # as the measured rounds corrected it
        chain_s = (dp.gamma * c.draft_s + c.verify_s(dp.gamma + 1)) * dp.clock.factor("spec")
        draft = len(live) * expected_tokens(dp.alpha, dp.gamma) / chain_s
        if all(self.primed[b] for b in live):
            return draft > tokens / (seconds + tokens * read_s(c, self.max_width, self.max_width) / self.max_width)
        draft /= 1.0 if dp.clock.known("spec") else max(1.0, dp.clock.factor("plain"))
        if draft <= tokens / seconds:
            return False
        if not dp.learned:
            return True  # neither this engine nor the machine's table knows the draft's acceptance: learn it
        self.saved += seconds - tokens / draft  # what this round would have saved with the draft
        written = [self.n_host[b] - self.start[b] for b in live]
        ahead = sum(min(PRIME_HORIZON * w, self.limit[b] - self.n_host[b]) for w, b in zip(written, live))
        prime = self._prime_s([self.n_host[b] for b in live if not self.primed[b]], c)
        return self.saved * ahead / max(sum(written), 1) > prime

    def _prime_s(self, lengths: list[int], costs) -> float:
        """Seconds of the deferred prefill of rows of these committed lengths (all but the last
        token of each): the target's measured prefill rate scaled by the draft/target step ratio,
        and never more than reading them in forwards of the method's width over the batch (a
        prefill is the widest of those), which is the estimate where no prefill was timed (the
        serving core admits rows one by one)."""
        if not lengths:
            return 0.0
        chunks = read_s(costs, max(lengths) - 1, self.max_width)
        if self.prefill_token_s is None:
            return chunks
        tokens = sum(n - 1 for n in lengths)
        return min(tokens * self.prefill_token_s * costs.draft_s / costs.verify_s(1), chunks)

    def _prime(self, state: DecodeState, live: list[int]) -> None:
        """The deferred draft prefill of live rows whose text the draft has not read: all but the
        row's last committed token, as after a prefill (the chain's own catch-up reads that one).
        One batched prefill when no row of the round's view was read yet (a generate call), else
        row by row (the serving core's rows come and go)."""
        draft, rows = self.ctx.draft, range(state.batch)
        if not any(self.primed[b] for b in rows):
            longest = max(self.n_host[b] for b in rows)  # finished rows' frozen text comes along
            draft.prefill(state.tokens[:, : max(longest - 1, 1)], state.n - 1, attn_len=max(longest - 1, 1))
            for b in rows:
                self.primed[b], self.gap[b] = True, 1
            self.primes += len(live)
            return
        for b in live:
            if not self.primed[b]:
                n = self.n_host[b]
                draft.prefill_row(b, state.tokens[b: b + 1, : max(n - 1, 1)], n - 1)
                self.primed[b], self.gap[b] = True, 1
                self.primes += 1

    def _tree_round(self, state: DecodeState, proposals, timer) -> RoundOutput:
        """Rows padded to the tree's N nodes with parentless nodes (nobody's child: never tried).
        tree="auto": N, depth and children are this round's widest (a chain is a tree too)."""
        dev, depths = state.tokens.device, []
        # a chain (the grammar's forced tokens, a path) rides in a tree round as a path
        proposals = [(toks, list(range(len(toks))) if par is None else par) for toks, par in proposals]
        for toks, par in proposals:
            depth = [0]
            for p in par:
                depth.append(depth[p] + 1)
            depths.append(depth)
        shape = self.tree
        if shape is None:
            self.tree_rounds += 1
            N, D = max(len(t) for t, _ in proposals), max(max(d) for d in depths)
            k = max(max(par.count(u) for u in set(par)) for _, par in proposals if par)
            shape = TreeShape(topk=max(k, -(-N // D)), depth=D, budget=N)  # nodes == N
        N, rows = shape.nodes, []
        for (toks, par), depth in zip(proposals, depths):  # [tokens, parents, depths] of nodes 1..N per row: one copy
            pad = N - len(toks)
            rows.append([toks + [0] * pad, par + [-1] * pad, depth[1:] + [1] * pad])
        nodes = to_device(rows, dev)
        root = state.last_tokens()[:, None]
        tree = TokenTree(torch.cat([root, nodes[:, 0]], 1), torch.cat([torch.full_like(root, -1), nodes[:, 1]], 1),
                         torch.cat([torch.zeros_like(root), nodes[:, 2]], 1))
        out = verify_tree_and_commit(self.ctx, state, tree, shape, timer, draft_forwards=0)
        if self.tree is None:  # each row proposed its own tree's depth (the policy learns per position)
            deepest = torch.where(nodes[:, 1] >= 0, nodes[:, 2], 0).amax(1)  # padding: parent -1
            out = dataclasses.replace(out, num_draft=deepest.to(out.num_draft.dtype))
        return dataclasses.replace(out, draft_lens=None)  # no draft model, no draft cache

    def _draft_round(self, state: DecodeState, live: list[int], timer) -> RoundOutput:
        """Hybrid: the draft model's chain (sd's round), after reading what it missed."""
        self.draft_rounds += 1
        primes = self.primes
        with timer.phase("draft"):
            self._prime(state, live)
        self.primed_now = self.primes > primes
        # up to 2 behind the chain's own catch-up reads; more after n-gram rounds it sat out
        behind = max(self.gap[b] for b in live) - 2
        if self.draft_policy.needs_costs:  # what the chain's time holds besides the chain, for its clock
            self.draft_policy.extra_s = catch_up_s(self.draft_policy.costs, behind, self.max_width)
        return chain_round(self.ctx, state, self.draft_policy, timer, behind, self.max_width)

    def after_round(self, n_acc, num_draft) -> None:
        if self._booked is not None and self.kind in ("ngram", "plain"):  # before the policy learns from it
            kind, tokens, model_s = self._booked
            self.clock.expect(kind, model_s, tokens)
        if self.kind == "draft":
            self.draft_policy.update(n_acc, num_draft)
            if self.draft_policy.needs_costs:
                self.draft_policy.remember(self.ctx.acceptance, self.key)
        elif self.kind == "grammar":  # forced tokens teach the n-gram policies nothing
            pass
        elif self.by_match:
            self.policy.update_rows(dict(enumerate(n_acc)), dict(enumerate(num_draft)))
        elif self.tree is None and self.policy.gamma and any(num_draft):  # rounds with proposals only
            hit = [(a, d) for a, d in zip(n_acc, num_draft) if d]
            self.policy.update([a for a, _ in hit], [d for _, d in hit])
        elif self.policy.needs_costs and self.policy.gamma == 0:
            self.policy.update(n_acc, num_draft)  # counts plain rounds: a probe follows

    def timed(self, seconds: float) -> None:
        dp = self.draft_policy
        if self.kind == "draft" and dp.needs_costs and not self.primed_now:  # a prefill's round: not a chain's time
            dp.timed(seconds)
        if self.calibrate and self._booked is not None and self.kind in ("ngram", "plain"):
            self.clock.timed(seconds)
            self.ctx.acceptance[self.clock_key] = self.clock.factors()  # the engine's next call starts here
            if self.hybrid and dp.needs_costs and self.kind == "plain":  # its γ compares its chains with them
                dp.adopt_plain(self.clock)

    def stats(self, totals: CallTotals) -> dict:
        drafted = self.draft_policy.clock.forecast if self.hybrid and self.draft_policy.needs_costs else [0.0, 0.0]
        trees = {"tree": "auto", "tree_rounds": self.tree_rounds} if self.auto_tree else self.tree_stats()
        return {"policy": self.policy.name, "gamma": self.policy.gamma, **trees, "ngram_max": self.sizes[0],
                "ngram_min": self.sizes[1], "matched_rounds": self.matched_rounds, "plain_rounds": self.plain_rounds,
                "draft_rounds": self.draft_rounds, "grammar_rounds": self.grammar_rounds, "hybrid": self.hybrid,
                "draft_prefills_deferred": self.primes,
                # proposed tokens per row and proposing round (n-gram and draft rounds)
                "gamma_mean": totals.counters.proposed / max(totals.counters.row_rounds - self.plain_rounds, 1),
                **prediction([a + b for a, b in zip(self.clock.forecast, drafted)], totals),  # hybrid: + its chains'
                "round_cost_factors": self.clock.factors(),
                **speculative_stats(totals)}


class HybridDecoding(NgramDecoding):
    """`hybrid`: n-gram chains where every live row has a match, the draft model's chain elsewhere."""
    name = "hybrid"
    needs_draft = True
    takes_tree = False


class SuffixDecoding(NgramDecoding):
    """`suffix`: n-gram drafting from the row's own text and from what the engine's earlier
    responses wrote (SuffixCache: suffix decoding across requests), whichever matches longer."""
    name = "suffix"
    uses_cache = True


class HybridSuffixDecoding(HybridDecoding):
    """`hybrid` with suffix decoding's memory: the cache's proposals where they match, the draft
    model's chain elsewhere."""
    name = "hybrid-suffix"
    uses_cache = True
