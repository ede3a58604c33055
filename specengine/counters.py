"""What a generate call counts per round (rounds, forwards, proposals, acceptance by draft
position): booked by the driver (generation.py) from the round's one host read."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    rounds: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    row_target_forwards: int = 0  # target forwards summed over active rows
    proposed: int = 0
    accepted: int = 0
    round_tokens: int = 0  # committed per round per active row (before truncation)
    row_rounds: int = 0
    reached: list = field(default_factory=list)  # [i]: rounds whose draft i+1 was proposed and drafts 1..i accepted
    accepted_at: list = field(default_factory=list)  # [i]: rounds whose draft i+1 was accepted
    launched_ahead: int = 0  # rounds launched before the host read the round before them
    log: list = field(default_factory=list)  # row 0's (proposed, accepted, draft forwards) per round it ran

    def count_positions(self, n_acc: int, num_draft: int) -> None:
        grow = num_draft - len(self.reached)
        if grow > 0:
            self.reached += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(min(n_acc + 1, num_draft)):
            self.reached[i] += 1
            self.accepted_at[i] += i < n_acc

    def acceptance_by_position(self) -> list[float]:
        """alpha_i = P(draft i accepted | drafts 1..i-1 accepted), i = 1, 2, ..."""
        return [a / r for a, r in zip(self.accepted_at, self.reached) if r]
