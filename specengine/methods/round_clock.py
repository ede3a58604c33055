"""What rounds really cost, against what the cost model predicted (docs/design.md, "Never slower,
by measurement").

The step costs behind γ auto are a model: forwards timed alone at start-up. A round also pays
sampling, commits, the host's read and, on a drifting VM, whatever the machine does that
minute; the draft's catch-up may cost more or less than a step. So every round the driver
times is booked here by kind ("plain": no proposals; "spec": a drafted round) as (predicted
seconds, measured seconds); each kind's correction factor (measured / predicted, decayed so it
follows the machine) scales the model's cost of that kind of round. Every kind ages with every
round, whichever kind it was: a factor taken minutes (or a slow moment) ago gives way to the next
round of its kind, measured in the same moment as the rounds of the other kind it is compared with. The choice of γ then
compares what this call's rounds actually achieve, and settles on plain decoding where
speculation measures slower, whatever the model said. Factors carry over to the engine's next
call. Only measured step costs are corrected (tests pin theirs, and get the model's choices).
"""
from __future__ import annotations

from ..timing import CLOCK_SUFFIX

MIN_ROUNDS = 3  # rounds of a kind before its factor is trusted
DECAY = 0.85
STALE_FLOOR = 1e-9  # predicted seconds below which an unbooked kind stops aging (no underflow to 0)


class RoundClock:
    def __init__(self, switch_costs: bool = True):
        """switch_costs: the first round of a kind after the other pays what the model leaves out (see
        `expect`); False where the model prices the switch (sd's catch-up) or there is none (n-gram)."""
        self.switch_costs = switch_costs
        self.measured = {"plain": 0.0, "spec": 0.0}
        self.predicted = {"plain": 0.0, "spec": 0.0}
        self.count = {"plain": 0, "spec": 0}
        self.prior: dict = {}  # kind -> an earlier call's factor, until this call times a round of that kind
        self.aged: dict = {}  # kind in prior -> rounds that went by (booked or `tick`ed) before its first
        self._last, self._pending = None, None  # the kind of the round expected last; what awaits its time
        self.forecast = [0.0, 0.0]  # the plan's expected tokens and seconds of the rounds expected so far

    def expect(self, kind: str, predicted_s: float, tokens: float = 0.0) -> None:
        """The round just booked, what the model predicted it costs and the tokens it was expected
        to commit; its time comes next (`timed`). The forecast (`stats["prediction_error"]`) charges
        it the model's seconds as the corrections measured so far scale them: what the plan chose by.
        Where the model leaves out what a switch costs (PEARL's resync after plain rounds), the first
        round of a kind after the other is only an upper bound of its kind's time: it is booked only
        where it lowers the factor (else a probe would always confirm plain decoding, and a factor
        taken in a slow moment could never come down while probes are all that run of its kind)."""
        self.forecast[0] += tokens
        self.forecast[1] += predicted_s * self.factor(kind)
        self._pending = (kind, predicted_s, self.switch_costs and kind != self._last)
        self._last = kind

    def timed(self, seconds: float) -> None:
        """The driver's measured seconds of the round last expected."""
        if self._pending is not None:
            kind, predicted_s, bound = self._pending
            if not bound or seconds < self.factor(kind) * predicted_s:
                self.book(kind, predicted_s, seconds)
        self._pending = None

    def book(self, kind: str, predicted_s: float, measured_s: float) -> None:
        if kind in self.prior:  # the seed weighs MIN_ROUNDS rounds of this call's size, whatever a round lasts,
            f = self.prior.pop(kind)  # aged by the rounds this call booked before, as this call's own rounds are
            self.predicted[kind] = MIN_ROUNDS * predicted_s * DECAY ** self.aged.pop(kind, 0)
            self.measured[kind] = f * self.predicted[kind]
        self.tick(kind)
        self.measured[kind] += measured_s
        self.predicted[kind] += predicted_s
        self.count[kind] += 1

    def tick(self, kind: str | None = None) -> None:
        """A round went by, of `kind` (None: one this clock does not book, as `hybrid`'s n-gram rounds are to
        its chains' clock). Every kind ages with each round: a kind not run lately weighs less (its factor, a
        ratio, stays what it was), and so does an earlier call's factor not yet weighed in (`aged`)."""
        for k in self.prior:
            self.aged[k] = self.aged.get(k, 0) + 1
        for k in self.measured:
            if k == kind or self.predicted[k] > STALE_FLOOR:
                self.measured[k] *= DECAY
                self.predicted[k] *= DECAY

    def known(self, kind: str) -> bool:
        return self.count[kind] >= MIN_ROUNDS

    def factor(self, kind: str) -> float:
        """measured / predicted seconds of this kind of round (1 until enough rounds were timed)."""
        if kind in self.prior:
            return self.prior[kind]
        if not self.known(kind) or self.predicted[kind] <= 0:
            return 1.0
        return self.measured[kind] / self.predicted[kind]

    def factors(self) -> dict:
        return {k: self.factor(k) for k in self.count if self.known(k)}

    def seed(self, factors: dict) -> None:
        """Start from an earlier call's factors, as if MIN_ROUNDS rounds of each had been timed at
        that factor: weighed against this call's rounds when the first of its kind is booked (in
        rounds, not seconds: a seed of 1 s would outweigh ~14 rounds of 70 ms on a CPU, hundreds on
        a GPU, and one slow call's factor would then outlast the rounds that contradict it), aged by
        the rounds booked before it (`aged`): unaged, a chain factor from a slow moment outweighed the
        one probe each later call ran after its plain rounds, five calls in a row plain (docs/design.md)."""
        for kind, f in factors.items():
            self.prior[kind], self.measured[kind], self.predicted[kind], self.count[kind] = f, 0.0, 0.0, MIN_ROUNDS
            self.aged[kind] = 0

    def adopt(self, kind: str, other: "RoundClock") -> None:
        """Take `other`'s timings of one kind of round (hybrid: its draft chains' clock learns the
        plain rounds the n-gram side timed), leaving this clock's forecast alone."""
        self.measured[kind], self.predicted[kind], self.count[kind] = (other.measured[kind], other.predicted[kind],
                                                                       other.count[kind])
        self.prior.pop(kind, None)
        if kind in other.prior:
            self.prior[kind], self.aged[kind] = other.prior[kind], other.aged.get(kind, 0)

    def wants_plain(self, afresh: bool = False) -> bool:
        """Speculation has been timed but plain decoding not yet: time plain rounds to compare.
        afresh (`sd`'s and `hybrid`'s chains): also where plain decoding has only an earlier call's
        factor and this call's speculation has been timed. Where speculation wins every round plain
        decoding is never timed otherwise, and a factor filed in a slow moment stays for good (AVX2
        EPYC, MT-bench: a filed 1.66 against 1.33 timed afresh priced plain rounds dear, so `sd` drafted
        γ 2-2.5 where 1-1.7 was right, 5 of 15 calls slower than `ar`). PEARL probes by its own rules."""
        if afresh and "plain" in self.prior:
            plain_pending = self._pending is not None and self._pending[0] == "plain"  # its time will replace the prior
            return self.known("spec") and "spec" not in self.prior and not plain_pending
        return self.known("spec") and not self.known("plain")


class TokenYield:
    """Tokens a call's drafted rounds committed against what the acceptance model expected of them
    at the α it held then. The truncated-geometric model at the measured mean rate overstates
    bursty acceptance (runs of full accepts and of early rejections: hybrid's chains on HumanEval/1
    committed 0.5-0.85 of it), and with a prefill to pay that bias decides. Summed over the call,
    not decayed as the clock's times are (it is the text's, not the machine's moment), and not
    carried to the next call: it is the text's, and carried across prompts it kept the draft out of
    one where `sd` ran 1.7x `ar`."""

    def __init__(self):
        self.expected = self.committed = 0.0
        self.count = 0

    def book(self, expected: float, committed: float) -> None:
        if expected > 0:
            self.expected += expected
            self.committed += committed
            self.count += 1

    def factor(self) -> float:
        """committed / expected tokens, shrunk toward 1 by MIN_ROUNDS rounds' worth of expected tokens
        (1 until that many rounds were booked), and never above 1. Unshrunk, three early rounds at 0.73
        of a recalled rate that was itself learning kept the draft out of the rest of a first call
        (HumanEval/1, 0.90x the next call, which drafted throughout: the factor never learns from
        rounds not run). Above 1 it measures α's lag, not the text: chains accepted in full while α
        climbs from its prior commit more than the α of their time expected, and α itself corrects
        that; scaled again, the forecast of a chain of 6 at α 0.97 reached 7.3 tokens (at most 7) and
        `hybrid`'s prediction error +24% on HumanEval/0 (real pair, AMX Xeon; `sd` +14% there)."""
        if self.count < MIN_ROUNDS:
            return 1.0
        prior = MIN_ROUNDS * self.expected / self.count
        return min(1.0, (self.committed + prior) / (self.expected + prior))


def recall_clock(clock: RoundClock, store: dict, name: str, call, costs) -> tuple[bool, str]:
    """(calibrate, key) of a method's round clock for this call (PEARL's, the n-gram methods'):
    greedy calls over measured costs correct the model by their rounds' times (a seeded sampled
    call must draw the same tokens each time; pinned costs stay the model), starting from the
    factors the engine's last call, or the machine's table, left under `key`."""
    key = f"{name}:{call.mode}{CLOCK_SUFFIX}"
    calibrate = call.mode == "greedy" and getattr(costs, "measured", False)
    if calibrate:
        clock.seed(store.get(key, {}))
    return calibrate, key
