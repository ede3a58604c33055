"""What rounds really cost, against what the cost model predicted (docs/design.md, "Never slower,
by measurement").

The step costs behind γ auto are a model: forwards timed alone at start-up. A round also pays
sampling, commits, the host's read and, on a drifting VM, whatever the machine does that
minute; the draft's catch-up may cost more or less than a step. So every round the driver
times is booked here by kind ("plain": no proposals; "spec": a drafted round) as (predicted
seconds, measured seconds); each kind's correction factor (measured / predicted, decayed so it
follows the machine) scales the model's cost of that kind of round. The choice of γ then
compares what this call's rounds actually achieve, and settles on plain decoding where
speculation measures slower, whatever the model said. Factors carry over to the engine's next
call. Only measured step costs are corrected (tests pin theirs, and get the model's choices).
"""
from __future__ import annotations

MIN_ROUNDS = 3  # rounds of a kind before its factor is trusted
DECAY = 0.85


class RoundClock:
    def __init__(self):
        self.measured = {"plain": 0.0, "spec": 0.0}
        self.predicted = {"plain": 0.0, "spec": 0.0}
        self.count = {"plain": 0, "spec": 0}
        self._last, self._pending = None, None  # the kind of the round expected last; what awaits its time

    def expect(self, kind: str, predicted_s: float) -> None:
        """The round just booked and what the model predicted it costs; its time comes next
        (`timed`). Steady state only: the first round of a kind after the other pays the switch (a
        drafted round after plain ones reads what the draft missed: a wider catch-up), and a probe
        booked with it would always confirm plain decoding."""
        self._pending = (kind, predicted_s) if kind == self._last else None
        self._last = kind

    def timed(self, seconds: float) -> None:
        """The driver's measured seconds of the round last expected."""
        if self._pending is not None:
            self.book(*self._pending, seconds)
        self._pending = None

    def book(self, kind: str, predicted_s: float, measured_s: float) -> None:
        for k in self.measured:
            self.measured[k] *= DECAY if k == kind else 1.0
            self.predicted[k] *= DECAY if k == kind else 1.0
        self.measured[kind] += measured_s
        self.predicted[kind] += predicted_s
        self.count[kind] += 1

    def known(self, kind: str) -> bool:
        return self.count[kind] >= MIN_ROUNDS

    def factor(self, kind: str) -> float:
        """measured / predicted seconds of this kind of round (1 until enough rounds were timed)."""
        if not self.known(kind) or self.predicted[kind] <= 0:
            return 1.0
        return self.measured[kind] / self.predicted[kind]

    def factors(self) -> dict:
        return {k: self.factor(k) for k in self.count if self.known(k)}

    def seed(self, factors: dict) -> None:
        """Start from an earlier call's factors (as if MIN_ROUNDS rounds of each had been timed)."""
        for kind, f in factors.items():
            self.predicted[kind], self.measured[kind], self.count[kind] = 1.0, f, MIN_ROUNDS

    def wants_plain(self) -> bool:
        """Speculation has been timed but plain decoding not yet: time plain rounds to compare."""
        return self.known("spec") and not self.known("plain")
