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

`hybrid` (hybrid.py) adds the draft model's chains where they are expected to commit more
tokens per second; this class keeps its per-row bookkeeping (what the draft has read).
"""
from __future__ import annotations

import dataclasses

import torch

from .ngram_index import NgramIndex, check_sizes
from .ngram_policy import NgramGammaPolicy
from ..errors import SpecEngineError
from . import draft_prime
from .base import CallInputs, CallTotals, Method, live_rows, prediction, speculative_stats
from .context import MethodContext
from .policies import make_policy
from .round_clock import RoundClock, recall_clock
from .state import DecodeState, RoundOutput
from .steps import PlainStep, grammar_drafts, to_device, verify_proposals, verify_tree_and_commit
from .suffix_cache import SuffixIndex
from .token_tree import TokenTree, TreeShape
from ..timing import CURVES_SUFFIX, FILED

MIN_TIMED_PREFILL = 16  # prompt tokens below which the driver's prefill time is mostly overhead, not a rate


class NgramDecoding(draft_prime.DeferredRead, Method):
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
        self.n_host: list[int] = []  # per row: its committed length (prompt + what the syncs read)
        self.prefill_token_s: float | None = None  # the target's measured prefill seconds per prompt token
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
        costs = None
        if self.policy.needs_costs or (self.hybrid and self.draft_policy.needs_costs):
            costs = ctx.step_costs(call.state, self.max_width, draft=self.hybrid)
        if self.by_match and call.mode == "greedy":  # the curves earlier calls counted (sampled: none, as sd)
            key = f"{self.name}:{call.mode}{CURVES_SUFFIX}"  # else those earlier processes filed (measured costs)
            filed = ctx.acceptance.get(key + FILED) if getattr(costs, "measured", False) else None
            self.policy.recall(ctx.acceptance, key, filed)
        if costs is not None:
            if self.policy.needs_costs:  # n-gram proposals are free: only the target's cost per width
                self.policy.set_costs(costs.target_only())
            if self.by_match:
                self.calibrate, self.clock_key = recall_clock(self.clock, ctx.acceptance, self.name, call, costs)
            if self.hybrid and self.draft_policy.needs_costs:
                self.key = call.mode
                self.draft_policy.calibrate = self.key == "greedy"  # its chains' times correct its costs
                if self.key == "greedy":
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
        if self.hybrid and self._draft_wins(found, gammas, live):  # hybrid.py; never with γ auto at 0
            self._booked = None  # the draft policy books its chains
            return "draft", {}
        kind = "ngram" if any(toks for toks, _ in found.values()) else "plain"
        self._booked = self.policy.forecast(kind, len(live), gammas) if self.by_match else None
        return kind, found

    def round(self, state: DecodeState, timer) -> RoundOutput:
        ctx, live = self.ctx, live_rows(self.call.rows)
        with timer.phase("draft"):
            self.kind, found = self.plan(live)
            forced = self._grammar_drafts(state, live)
        if forced:  # the grammar's forced tokens first; rows without any keep their n-gram proposal
            self.kind, found = "grammar", {b: (forced[b], None) if b in forced else found[b]
                                           for b in set(forced) | (set() if self.kind == "draft" else set(found))}
        if self.kind == "draft":
            return self._draft_round(state, live, timer)  # hybrid.py
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
        if self.kind == "draft" and dp.needs_costs:  # a reading round: its chain's time, the read taken out
            dp.timed(self.chain_s(seconds))
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


class SuffixDecoding(NgramDecoding):
    """`suffix`: n-gram drafting from the row's own text and from what the engine's earlier
    responses wrote (SuffixCache: suffix decoding across requests), whichever matches longer."""
    name = "suffix"
    uses_cache = True
