"""Draft-length policies for `sd` (docs/design.md, "Methods"): a small object the draft loop consults.

`gamma` is the number of draft steps of the next round. `num_draft` may cut a round's
proposal short per row on the device (no host sync inside the draft loop); `update`
adapts `gamma` on the host from the round's results, which the driver reads anyway.
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError
from ..timing import CLOCK_SUFFIX, FILED
from .probe_wait import (PROBE_FIRST, PROBE_MAX, PROBE_SUSTAIN, STALE_FIRST, STALE_MAX, STALE_SUFFIX,
                         STALE_SUSTAIN, ProbeWait)
from .round_clock import RoundClock
from .sampling import check_number


DEFAULT_SPECDEC_THRESHOLD = 0.1  # the held-out sweep on the dev CPU (bench/README.md, "Methods on float weights"); sweep your own


class FixedPolicy:
    name = "fixed"
    needs_costs = False
    wants_hidden = False  # True: the draft loop feeds the draft's hidden states to observe()

    def __init__(self, gamma: int = 4):
        if not isinstance(gamma, int) or gamma < 1:
            raise SpecEngineError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
        self.gamma = self.gamma_max = gamma

    def num_draft(self, conf: torch.Tensor) -> torch.Tensor:
        """conf [B,γ] = the draft's probability of each token it proposed."""
        return torch.full((conf.shape[0],), conf.shape[1], dtype=torch.int32, device=conf.device)

    def update(self, n_acc: list[int], num_draft: list[int]) -> None:
        pass


class HeuristicPolicy(FixedPolicy):
    """Hugging Face's schedule: +2 after a fully accepted round, -1 otherwise (min 1)."""
    name = "heuristic"

    def __init__(self, gamma: int = 4, gamma_max: int = 16):
        super().__init__(gamma)
        self.gamma_max = max(gamma, gamma_max)

    def update(self, n_acc, num_draft):
        if n_acc and all(a >= d for a, d in zip(n_acc, num_draft)):
            self.gamma = min(self.gamma + 2, self.gamma_max)
        else:
            self.gamma = max(1, self.gamma - 1)


class ConfidencePolicy(FixedPolicy):
    """Stop a row's proposal after the first token the draft itself gives prob < threshold.

    The round drafts `gamma` tokens for all rows (no host sync per step) and truncates on
    the device; the next round's budget follows the longest proposal + 1, so a draft that
    keeps losing confidence early stops paying for steps it does not use.
    """
    name = "confidence"

    def __init__(self, gamma: int = 8, threshold: float = 0.4):
        super().__init__(gamma)
        threshold = check_number("threshold", threshold, "a number in [0, 1]")
        if not 0 <= threshold <= 1:
            raise SpecEngineError(f"confidence threshold must be in [0, 1], got {threshold!r}", "threshold")
        self.threshold = threshold

    def num_draft(self, conf):
        low = conf < self.threshold
        first_low = torch.where(low.any(1), low.to(torch.int8).argmax(1), conf.shape[1] - 1)
        return (first_low + 1).to(torch.int32)

    def update(self, n_acc, num_draft):
        if num_draft:
            self.gamma = min(self.gamma_max, max(num_draft) + 1)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round commits when each draft is accepted with prob alpha until the first
    rejection: 1 + alpha + ... + alpha^gamma (Leviathan et al. 2023, eq. 1)."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def round_rate(alpha: float, gamma: int, costs, extra_s: float = 0.0, scale: dict | None = None) -> float:
    """Committed tokens per second of a round of γ drafts: E[tokens](α, γ) / (γ·draft +
    verify(γ+1) + extra_s); γ = 0 is a plain decode step (one token per target decode).
    extra_s: what the round pays besides (hybrid: the draft's catch-up). scale: measured /
    predicted seconds per kind of round (round_clock.py), 1 where absent; untimed drafted ones at plain's (chain_factor)."""
    factor = (scale or {}).get("spec" if gamma else "plain", (scale or {}).get("plain", 1.0))
    return expected_tokens(alpha, gamma) / ((gamma * costs.draft_s + costs.verify_s(gamma + 1) + extra_s) * factor)


def read_s(costs, tokens: int, width: int) -> float:
    """Seconds of draft forwards that read `tokens` tokens in forwards of at most `width`, at the
    draft's measured cost per width (StepCosts.draft_read_s)."""
    full, rest = divmod(max(tokens, 0), width)
    return full * costs.draft_read_s(width) + (costs.draft_read_s(rest) if rest else 0.0)


def catch_up_s(costs, behind: int, width: int) -> float:
    """Seconds a chain's first draft forward adds when the draft missed `behind` tokens (plain rounds
    it sat out): it reads them with its usual 2, in forwards of at most `width` (steps.chain_round)."""
    return read_s(costs, behind + 2, width) - read_s(costs, 2, width) if behind > 0 else 0.0


def best_gamma(alpha: float, costs, gamma_max: int, gamma_min: int = 1, scale: dict | None = None) -> int:
    """The γ in [gamma_min, gamma_max] that maximizes committed tokens per second."""
    return max(range(gamma_min, gamma_max + 1), key=lambda g: round_rate(alpha, g, costs, scale=scale))


# The pair's rate, what a new call starts from: its accepted drafts and rejections over the engine's
# greedy calls, decayed per drafted round (~50 rounds, a few calls). The last call's own rate was one
# text's: after HumanEval/1 (α 0.53) HumanEval/2 (0.87) started plain, one probe's rejection held it
# plain for the call (0.98x `ar`, where it ran 1.21x after HumanEval/0; AVX2 copy, docs/design.md).
PAIR_DECAY, PAIR_SUFFIX = 0.98, ":pair"
# The weight (tokens) the pair's rate starts a call with, at most what its decayed counts hold in steady
# state: at the prior's 4, two rejected first rounds took α from the pair's 0.83 to 0.60 (HumanEval/1) and
# the call decoded plainly to its end (also MT-bench/2: 62 plain rounds of 64, where the same call in the
# benchmark's other repeat drafted throughout at 0.63, 1.18x `ar`). Simulated on this machine's costs (docs/design.md):
# that case 1.14x -> 1.22x `ar` (lowest tenth 0.95 -> 1.12), bad text right after good ~1% slower. The
# rate earlier processes filed starts a new engine's first call the same way (at the prior's 4 that call
# ran 28 rounds where the next ran 26: HumanEval/1 x 64, AVX2 EPYC, 4 processes each; at 8, 26 and 26).
START_WEIGHT = 8.0

class AutoGammaPolicy(FixedPolicy):
    """`gamma="auto"`: each round's γ maximizes expected tokens per unit of time, from the
    measured draft step cost, the measured target cost per width (`step_costs.py`) and the
    running acceptance rate. No sweep: the best γ of each machine and prompt falls out.

    γ = 0 is a choice: when the costs and the acceptance say a speculative round would commit
    fewer tokens per second than plain decoding, the round is a plain decode step (the draft
    does not run; it catches up when drafting resumes). After `probe_every` plain rounds one
    round drafts at the best γ >= 1 anyway (`ProbeWait`: the wait doubles while probes confirm
    plain decoding).

    α is the maximum-likelihood rate of the truncated-geometric acceptance model
    (accepted / (accepted + rejections)), with a weak prior and a decay so that it follows
    the text as it changes (code vs prose accept differently).
    """
    name = "auto"
    needs_costs = True

    def __init__(self, gamma_max: int = 8, prior_alpha: float = 0.7, prior_weight: float = 4.0,
                 decay: float = 0.9, probe_every: int = PROBE_FIRST, probe_max: int = PROBE_MAX):
        super().__init__(min(4, gamma_max))
        self.gamma_max = gamma_max
        self._prior = (prior_alpha * prior_weight, (1 - prior_alpha) * prior_weight)
        self.accepted, self.rejected = self._prior
        self.decay = decay
        self.pair: tuple | None = None  # the pair's decayed (accepted, rejections) across calls (PAIR_DECAY)
        self.costs = None
        self.wait = ProbeWait(probe_every, probe_max)
        self.probing = False  # this round is a probe
        self._stretch: int | None = None  # drafted rounds since the last probe, while it is undecided (`_settle`)
        self.left: int | None = None  # tokens the call may still write (its most of any row; None: not said)
        self.clock = RoundClock(switch_costs=False)  # rounds' measured vs predicted seconds (catch-ups priced)
        self.extra_s = 0.0  # what the round about to be booked pays besides its chain (sd: the draft's catch-up)
        self.token_scale = 1.0  # the chain's expected tokens as its chooser scaled them (hybrid: its chains' yield)
        self._filed = None  # (store, key) where `remember` last filed the clock
        self._seed: dict = {}  # corrections `recall` found, applied by `set_costs` to measured costs only
        self._filed_alpha, self.learned = None, False  # the same for a filed acceptance; α known to the engine
        self.idle, self.stale_every = 0, STALE_FIRST  # rounds in a row without a chain (across calls); the wait
        self.trial: int | None = None  # rounds since the rate, gone stale, gave way to the prior (None: none under way)
        # greedy only: there γ never changes the tokens, while a seeded sampled call must draw the
        # same tokens each time, so its choices may depend on nothing the clock measures
        self.calibrate = False

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def recall(self, store: dict, key: str) -> None:
        """Start from the acceptance rate the engine's earlier greedy calls learned for this pair
        (`store[key]`: the pair's over their last drafted rounds, PAIR_DECAY, not the last text's), at
        START_WEIGHT (at most what the pair's counts hold), instead of the prior's rate, and from
        their rounds' measured cost corrections; where this engine learned none, from the rate earlier
        processes filed (step_costs.FiledClocks: measured costs only, applied in `set_costs`, also at
        START_WEIGHT). A rate gone stale has given way to the prior already (`_age`). Greedy only: the
        methods do not call it for a sampled call, whose seed must repeat its tokens whatever earlier calls
        learned."""
        alpha, self.pair = store.get(key), store.get(key + PAIR_SUFFIX)
        # rounds without a chain so far, across calls: at STALE_FIRST the rate gives way to the prior (`_age`)
        self.idle, self.stale_every, self.trial = store.get(key + STALE_SUFFIX, (0, STALE_FIRST, None))
        self.learned = alpha is not None
        if alpha is not None:
            steady = sum(self.pair) * (1 - PAIR_DECAY) / (1 - self.decay) if self.pair else 0.0
            self._set_alpha(alpha, max(self.accepted + self.rejected, min(START_WEIGHT, steady)))
        self._seed = store.get(key + CLOCK_SUFFIX, {}) if self.calibrate else {}  # for measured costs only
        self._filed_alpha = store.get(key + FILED) if self.calibrate and alpha is None else None

    def _freshen(self) -> None:
        """The pair's rate has gone stale (`stale_every` rounds in a row without a chain): the prior's, as a
        new engine's first call starts from; the next STALE_SUSTAIN rounds tell whether drafting pays again."""
        self.accepted, self.rejected = self._prior
        self.pair, self.idle, self.trial = None, 0, 0

    def _age(self, plain: bool, by_costs: bool) -> bool:
        """A round booked (plain: no chain ran; by_costs: a chain the costs chose, not a probe): the rounds
        without a chain, and what a start from the prior found. Still drafting STALE_SUSTAIN rounds after it,
        the first wait again; else the wait doubles (up to STALE_MAX). The rate gives way to the prior as soon
        as the wait is over, within a call (the serving core's lasts while requests come) or for the next
        (`remember` leaves it the prior's rate: a new engine's first call starts so, filed rate ignored).
        Returns whether it did so now."""
        self.idle = self.idle + 1 if plain else 0
        if self.trial is not None:
            self.trial += 1
            if self.trial >= STALE_SUSTAIN:
                self.stale_every = STALE_FIRST if self.idle == 0 else min(2 * self.stale_every, STALE_MAX)
                self.trial = None
        elif by_costs:
            self.stale_every = STALE_FIRST
        if self.idle < self.stale_every:
            return False
        self._freshen()
        return True

    def _set_alpha(self, alpha: float, weight: float | None = None) -> None:
        weight = self.accepted + self.rejected if weight is None else weight
        self.accepted, self.rejected = alpha * weight, (1 - alpha) * weight

    def remember(self, store: dict, key: str) -> None:
        """Leave the pair's rate and the round clock for the engine's next call (a plain round: the rate as it was)."""
        self.remember_rate(store, key)
        self._filed = (store, key + CLOCK_SUFFIX)
        store[key + CLOCK_SUFFIX] = self.clock.factors()

    def remember_rate(self, store: dict, key: str) -> None:
        """The pair's rate and the rounds without a chain, without the clock: what `hybrid` leaves after a
        round its chain sat out (its chain's clock is filed where chains run)."""
        if self.pair is not None:
            store[key], store[key + PAIR_SUFFIX] = self.pair[0] / sum(self.pair), self.pair
        else:  # (none since the rate gave way to the prior: `_freshen` dropped the pair's counts)
            store[key] = self.alpha
            store.pop(key + PAIR_SUFFIX, None)
        store[key + STALE_SUFFIX] = (self.idle, self.stale_every, self.trial)

    def timed(self, seconds: float) -> None:
        """The driver's measured seconds of the round last booked by `update` (round_clock.py):
        corrects the model's costs of that kind of round, from the next choice on, and where `remember`
        filed the clock, files it again (a call's last timed round reaches the next call too)."""
        if self.calibrate and getattr(self.costs, "measured", False):
            self.clock.timed(seconds)
            if self._filed is not None:
                store, key = self._filed
                store[key] = self.clock.factors()

    def sat_out(self) -> None:
        """A round the chain sat out by another's choice (hybrid's n-gram and plain rounds): it ages the clock, and
        while the costs hold γ at 0 it counts toward the next probe, as a plain round of its own does. Else nothing
        re-timed an earlier call's chain factor that says chains lose, and the draft sat out every later call."""
        self.clock.tick()  # a round went by that the clock does not book (RoundClock.tick)
        freshened = self._age(plain=True, by_costs=False)
        if self.costs is not None and self.gamma == 0:
            self.wait.count(True)
        if self.costs is not None and (self.gamma == 0 or freshened):  # (freshened: the prior's rate from now)
            self._choose()

    def adopt_plain(self, clock) -> None:
        """Plain rounds another clock timed (hybrid: its n-gram side runs them, never the chain's
        policy), then γ chosen again: a policy that timed chains but no plain round holds γ at 0."""
        self.clock.adopt("plain", clock)
        if self.costs is not None:
            self._choose()

    def set_costs(self, costs) -> None:
        self.costs = costs
        if getattr(costs, "measured", False):  # pinned costs stay the model
            self.clock.seed(self._seed)
            if self._filed_alpha is not None:  # the pair's rate too, filed by earlier processes: START_WEIGHT
                self._set_alpha(self._filed_alpha, max(self.accepted + self.rejected, START_WEIGHT))
                self.learned = True
        self._seed, self._filed_alpha = {}, None
        self._choose()

    def _choose(self) -> None:
        self.probing = self.wait.due(self.left)
        if self.clock.wants_plain(afresh=True) and not self.probing:  # time plain decoding once to compare
            self.gamma = 0
            return
        self.gamma = best_gamma(self.alpha, self.costs, self.gamma_max, gamma_min=1 if self.probing else 0,
                                scale=self.clock.factors())

    def update(self, n_acc, num_draft):
        # a plain round is one that proposed nothing: with rounds launched ahead (sd.one_token_rounds)
        # it may be booked after γ already moved on to a probe
        plain = not any(num_draft)
        if self.costs is not None:  # what the plan expected of this round, before it learns from it:
            c, g, kind = self.costs, 0 if plain else self.gamma, "plain" if plain else "spec"
            model_s = g * c.draft_s + c.verify_s(g + 1) + (0.0 if plain else self.extra_s)
            self.clock.expect(kind, model_s, len(n_acc) * expected_tokens(self.alpha, g) * (1.0 if plain else self.token_scale))
        self.extra_s = 0.0
        probed = self.probing
        self.wait.count(plain)
        self._age(plain, by_costs=not plain and not probed)
        if not plain:
            self.learned = True
            rejections = sum(a < d for a, d in zip(n_acc, num_draft))
            a, r = self.pair or (self.accepted, self.rejected)  # none yet: the call's start, at the prior's weight
            self.pair = (PAIR_DECAY * a + sum(n_acc), PAIR_DECAY * r + rejections)
            self.accepted = self.decay * self.accepted + sum(n_acc)
            self.rejected = self.decay * self.rejected + rejections
        if self.costs is not None:
            self._choose()
            self._settle(probed, plain)

    def _settle(self, probed: bool, plain: bool) -> None:
        """What the round just booked says of the wait: a probe, with the drafted rounds the costs chose
        right after it, that ends in plain decoding within PROBE_SUSTAIN rounds confirmed plain decoding
        (wait longer); speculation chosen by the costs alone, or lasting that long after a probe, pays
        again (the first wait)."""
        if probed:
            self._stretch = 0  # drafted rounds since the probe, itself included (None: no probe under way)
        if self._stretch is not None and not plain:
            self._stretch += 1
        if self._stretch is not None:
            if self.gamma == 0:
                self.wait.settle(plain=True)
            elif self._stretch >= PROBE_SUSTAIN:
                self.wait.settle(plain=False)
            else:
                return
            self._stretch = None
        elif self.gamma and not self.probing:
            self.wait.settle(plain=False)


def specdec_update(hidden, log_all_accept, k, j: int, head, threshold: float, k_min: int):
    """SpecDec++'s per-step update: (log P(all accepted so far) [B], each row's K [B])."""
    p = head.accept_prob(hidden).clamp_min(1e-6)
    log_all_accept = log_all_accept + torch.log(p)
    stop_now = (1 - torch.exp(log_all_accept) > threshold) & (j + 1 >= k_min)
    return log_all_accept, torch.where(stop_now & (k > j + 1), torch.full_like(k, j + 1), k)


class SpecDecPolicy(FixedPolicy):
    """SpecDec++ (arXiv 2405.19715): stop drafting once P(at least one rejection so far) =
    1 - prod_i P(accept_i) exceeds `threshold`, with P(accept_i) from a trained acceptance
    head on the draft's hidden state; K clamped to [k_min, gamma]. A row that stops keeps its
    K; the loop ends when every row has stopped.

    Where reading a flag is free (CPU: no device queue) the draft loop stops early on the
    host; on CUDA it keeps the one-sync-per-round rule instead: it drafts the round's budget
    (the previous round's longest proposal + 1, as `confidence` does) and the head truncates
    on the device.
    """
    name = "specdec++"
    wants_hidden = True

    def __init__(self, gamma: int = 8, threshold: float = DEFAULT_SPECDEC_THRESHOLD, k_min: int = 1):
        super().__init__(gamma)
        threshold = check_number("threshold", threshold, "a number in (0, 1)")
        if not 0 < threshold < 1:
            raise SpecEngineError(f"specdec++ threshold must be in (0, 1), got {threshold!r}", "threshold")
        if not isinstance(k_min, int) or not 1 <= k_min <= self.gamma_max:
            raise SpecEngineError(f"k_min must be an integer in [1, {self.gamma_max}], got {k_min!r}")
        self.threshold, self.k_min, self.head = threshold, k_min, None
        self.early_exit = True

    def attach(self, head, early_exit: bool) -> None:
        self.head, self.early_exit = head, early_exit

    def begin_round(self, batch: int, device) -> None:
        self._log_all_accept = torch.zeros(batch, device=device)
        self._k = torch.full((batch,), self.gamma_max, dtype=torch.int32, device=device)

    def observe(self, hidden: torch.Tensor, j: int, run) -> bool:
        """After draft token j (0-based) of every row: update each row's K on the device;
        True when every row has stopped and the host may end the loop (early exit only).
        run(name, fn, *args): how the update runs (the draft runner's `graphed`: one graph
        replay in place of the head's ~25 small kernels)."""
        self._log_all_accept, self._k = run("specdec++ head", specdec_update, hidden, self._log_all_accept, self._k,
                                            j, self.head, self.threshold, self.k_min)
        return self.early_exit and bool((self._k <= j + 1).all())

    def num_draft(self, conf):
        return self._k.clamp(max=conf.shape[1])

    def update(self, n_acc, num_draft):
        if not self.early_exit and num_draft:
            self.gamma = min(self.gamma_max, max(num_draft) + 1)


POLICIES = {p.name: p for p in (FixedPolicy, HeuristicPolicy, ConfidencePolicy, SpecDecPolicy)}


def make_policy(name: str, gamma: int | str | None = None, **kw) -> FixedPolicy:
    """`gamma="auto"` turns the fixed policy into AutoGammaPolicy; the adaptive policies then
    start from their own default γ."""
    if name not in POLICIES:
        raise SpecEngineError(f"unknown draft-length policy {name!r}; choose from {', '.join(POLICIES)}")
    if kw.get("threshold", 0) is None:
        kw.pop("threshold")
    elif "threshold" in kw and name not in ("confidence", "specdec++"):
        raise SpecEngineError(f"threshold applies to the confidence and specdec++ policies, not {name!r}")
    if gamma == "auto":
        return AutoGammaPolicy(**kw) if name == "fixed" else POLICIES[name](**kw)
    return POLICIES[name](gamma, **kw) if gamma is not None else POLICIES[name](**kw)
