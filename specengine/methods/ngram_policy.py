"""γ for n-gram proposals (`ngram` and `hybrid` with gamma="auto"), per row and round.

A proposal found in the row's own text is right or wrong as a whole far more than a draft
model's chain is. Inside a span the output copies, the match behind a proposal is long and
nearly every proposed token is accepted. After a match of one or two tokens, hardly any is.
AutoGammaPolicy's one running acceptance rate averages the two: it proposes too much where
the match is weak and too little inside a copied span.

So acceptance is learned per match length: how many tokens before the proposal agree with the
end of the history (NgramIndex.lookup), binned. Each bin keeps a survival curve,
q[k] = P(token k accepted | tokens 1..k-1 were), counted from the verified rounds. Position 1
starts from a prior of 1/2; position k > 1 from position k - 1's estimate (PRIOR_WEIGHT
pseudo-counts), so a bin whose first tokens are always accepted expects the same further out
and lengthens its proposals to learn it, where a fixed prior would stop it at the first
unexplored position.
A row's γ maximizes its expected committed tokens per second, using the target's measured cost
per verify width (step_costs.py):

    (1 + sum_{j<=γ} prod_{k<=j} q[k]) / verify_s(γ + 1),  against 1 / verify_s(1) with no proposal.

The curves outlive the call: `recall` starts a call from what the engine's earlier calls counted
for the method and decoding mode (MethodContext.acceptance), so a server's tenth request does not
relearn at the prior what its first nine taught; counts are halved past MEMORY tries of a
position, so the curve follows text that changes. Greedy curves are filed in the machine's table
too (as the draft's acceptance is: step_costs.FiledClocks), so a new process's first call starts
from them rather than exploring again (4 extra rounds of 46 on HumanEval/1 x 64: 0.90x the next).
A bin whose curve says "no proposal" is probed with its best γ >= 1 every PROBE_EVERY rows
it declines, so that the bin's estimate can change as the text does.

The carried curves are the pair's and the texts' of earlier calls, hundreds of tries deep, so one
call's few proposals barely move them, while a text's kind moves every bin at once: on MT-bench's
prose (AVX2 copy) one call's proposals were accepted 1 time in 21 where the curves learned on code
expected about a third, and `ngram` ran 0.935x `ar`. So each call also keeps its own text factor,
its verified tokens accepted over what the curves expected of them (`text_factor`, shrunk toward 1
by TEXT_WEIGHT tokens), which scales every bin's odds of acceptance; it is the text's, not carried.
"""
from __future__ import annotations

from .ngram_index import layout, trie_of

MATCH_BINS = (1, 2, 3, 4, 6, 9, 13, 21)  # lower bounds of the match-length bins
PRIOR_Q1, PRIOR_WEIGHT = 0.5, 2.0  # position 1's prior, and the pseudo-counts of every prior
PROBE_EVERY = 8
MEMORY = 256  # tries of a position past which a bin's counts are halved: recent rounds weigh more
EXPLORE_TRIES = 4  # hybrid: a bin tried fewer times than this gets its n-gram round whatever the estimate
TEXT_WEIGHT = 3.0  # the text factor's prior: this many expected tokens accepted as the curves say


def match_bin(m: int) -> int:
    """Index of the bin that holds match length m (>= 1)."""
    return sum(m >= lo for lo in MATCH_BINS[1:])


class NgramGammaPolicy:
    """Per-row γ from each row's match length, the bin's learned acceptance curve and the
    target's cost per width. Drop-in for the fields NgramDecoding reads of a policy."""
    name = "auto"
    needs_costs = True

    def __init__(self, gamma_max: int = 12):
        self.gamma_max = gamma_max
        self.gamma = 0  # the widest proposal of the last round (stats)
        self.seen = [[0.0] * (gamma_max + 1) for _ in MATCH_BINS]  # verified tries of position k, per bin
        self.kept = [[0.0] * (gamma_max + 1) for _ in MATCH_BINS]  # ... accepted
        self.declined = [0] * len(MATCH_BINS)
        self.costs = None
        self.scale: dict = {}  # measured / predicted seconds per kind of round ("plain", "spec": round_clock.py)
        self.last_bins: dict[int, int] = {}  # row -> bin of its proposal this round
        self.text_expected = self.text_kept = 0.0  # this call's verified tokens: the curves' chances, those accepted

    def set_costs(self, costs) -> None:
        self.costs = costs

    def recall(self, store: dict, key: str, filed=None) -> None:
        """Continue the curves the engine's earlier calls counted under `key`; where it has none,
        those earlier processes filed (`filed`: the machine's table, step_costs.FiledClocks); else
        the priors. The store then holds this policy's counts, so the next call continues from them."""
        seen, kept = store.get(key, filed or (None, None))
        if seen is not None and len(seen[0]) == self.gamma_max + 1:
            self.seen, self.kept = [list(r) for r in seen], [list(r) for r in kept]
        store[key] = (self.seen, self.kept)

    def curve(self, b: int) -> list[float]:
        """q[k]: bin b's learned P(token k accepted | tokens 1..k-1 were), k = 1..gamma_max (q[0] unused)."""
        q = [PRIOR_Q1]
        for k in range(1, self.gamma_max + 1):
            q.append((self.kept[b][k] + PRIOR_WEIGHT * q[-1]) / (self.seen[b][k] + PRIOR_WEIGHT))
        return q

    def text_factor(self) -> float:
        """This call's verified tokens accepted over what the curves expected of them, shrunk toward 1."""
        return (self.text_kept + TEXT_WEIGHT) / (self.text_expected + TEXT_WEIGHT)

    def survival(self, b: int) -> list[float]:
        """s[γ]: P(the first γ tokens of a proposal from bin b are all accepted), γ = 0..gamma_max: the
        bin's curve with its odds scaled by the call's text factor."""
        s, f = [1.0], self.text_factor()
        for q in self.curve(b)[1:]:
            s.append(s[-1] * q * f / (1.0 - q + q * f))
        return s

    def expected(self, b: int) -> list[float]:
        """e[γ]: expected accepted tokens of a γ-token proposal from bin b, γ = 0..gamma_max."""
        e = [0.0]
        for p in self.survival(b)[1:]:
            e.append(e[-1] + p)
        return e

    def seconds(self, width: int) -> float:
        """A round's seconds at this verify width (1: a plain step), as the measured rounds corrected them."""
        return self.costs.verify_s(width) * self.scale.get("plain" if width == 1 else "spec", 1.0)

    def best(self, b: int, gamma_min: int = 0) -> int:
        e = self.expected(b)
        return max(range(gamma_min, self.gamma_max + 1), key=lambda g: (1 + e[g]) / self.seconds(g + 1))

    def choose(self, matches: dict[int, int]) -> dict[int, int]:
        """{row: γ} for rows with a match of length m ({row: m}); rows left out propose nothing."""
        out, self.last_bins = {}, {}
        for row, m in matches.items():
            b = match_bin(m)
            g = self.best(b)
            if g == 0:
                self.declined[b] += 1
                if self.declined[b] % PROBE_EVERY:
                    continue
                g = self.best(b, gamma_min=1)
            out[row], self.last_bins[row] = g, b
        self.gamma = max(out.values(), default=0)
        return out

    def update_rows(self, n_acc: dict[int, int], proposed: dict[int, int]) -> None:
        """Rows' accepted counts of their `proposed` token counts (the round's proposals)."""
        for row, d in proposed.items():
            b, a = self.last_bins.get(row), n_acc[row]
            if b is None or not d:
                continue
            seen, kept, q = self.seen[b], self.kept[b], self.curve(b)
            for k in range(1, min(a + 1, d) + 1):  # positions 1..a accepted, position a + 1 rejected
                seen[k] += 1
                kept[k] += k <= a
                self.text_expected += q[k]
                self.text_kept += k <= a
            if seen[1] > MEMORY:
                seen[:], kept[:] = [x / 2 for x in seen], [x / 2 for x in kept]

    def choose_trees(self, rows: dict[int, tuple[int, list]]) -> dict[int, tuple[list[int], list[int]]]:
        """tree="auto": {row: (tokens, parents)} for rows with a match of length m and the
        continuations of the occurrences that agree as far ({row: (m, continuations)}); rows left
        out propose nothing. Arctic's speculation tree, priced by our costs: a node's chance of
        being accepted is the bin's survival to its depth (what chains from matches this long
        kept) times the share of the occurrences that pass through it; nodes are taken most
        probable first (a parent is never less probable than its child), as many as maximize
        (1 + their summed chances) / verify_s(nodes + 1), at most γ max. One occurrence, or
        occurrences that agree: a chain, as choose() would size it."""
        out, self.last_bins = {}, {}
        for row, (m, conts) in rows.items():
            b = match_bin(m)
            nodes, picked = self._tree(b, conts, 0)
            if not picked:
                self.declined[b] += 1
                if self.declined[b] % PROBE_EVERY:
                    continue
                nodes, picked = self._tree(b, conts, 1)
            out[row], self.last_bins[row] = layout(nodes, picked), b
        self.gamma = max((len(t) for t, _ in out.values()), default=0)
        return out

    def _tree(self, b: int, conts: list, n_min: int) -> tuple[list, list[int]]:
        nodes, survive = trie_of(conts), self.survival(b)
        chance = {i: survive[n[2]] * n[3] / max(len(conts), 1) for i, n in enumerate(nodes, 1)}
        order = sorted(chance, key=lambda i: (-chance[i], nodes[i - 1][2], -nodes[i - 1][4]))[: self.gamma_max]
        rate, gain = [1.0 / self.seconds(1)], 1.0  # expected tokens per second with the first n nodes
        for n, i in enumerate(order, 1):
            gain += chance[i]
            rate.append(gain / self.seconds(n + 1))
        return nodes, order[:max(range(min(n_min, len(order)), len(order) + 1), key=rate.__getitem__)]

    def round_tokens(self, gammas: dict[int, int]) -> float:
        """Expected committed tokens of the rows in `gammas` (this round's choice) if they verify
        their proposals: 1 + e[γ] per row, from the bins choose() put them in."""
        return sum(1.0 + self.expected(self.last_bins[row])[g] for row, g in gammas.items())

    def forecast(self, kind: str, live: int, gammas: dict | None) -> tuple | None:
        """What the plan expects of an n-gram or plain round of `live` rows: (kind of round,
        tokens, the model's seconds); None for trees (no per-round token count is kept for those)."""
        if kind == "plain":
            return "plain", float(live), self.costs.verify_s(1)
        if gammas is None:
            return None
        tokens = self.round_tokens(gammas) + live - len(gammas)  # a row without a match: its one token
        return "spec", tokens, self.costs.verify_s(max(gammas.values()) + 1)

    def unexplored(self, gammas: dict[int, int]) -> bool:
        """Some row's bin has too few verified tries to be trusted against a draft model."""
        return any(self.seen[self.last_bins[row]][1] < EXPLORE_TRIES for row in gammas)
