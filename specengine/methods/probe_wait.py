"""When a policy that decodes plainly tries speculation again: within a call, a probe after a wait of plain
rounds (`ProbeWait`: γ auto's and PEARL's); where no probe can run (an unread draft), a start from the prior once
the pair's rate has gone stale (`STALE_FIRST`, counted across calls: AutoGammaPolicy._age)."""
from __future__ import annotations

PROBE_FIRST, PROBE_MAX = 16, 256  # plain rounds before a probe: the first wait, the longest
# Drafted rounds in a row, the probe's included, before what a probe found counts as speculation paying
# again: one accepted probe lifts α enough for a round or two chosen by the costs, and a stretch that
# short which falls back to plain decoding confirmed plain (it used to reset the wait, and the call
# probed again 16 rounds later, each probe a ~1.3-step catch-up: MT-bench prose, AVX2 copy, 0.92x `ar`
# on one call with two probes).
PROBE_SUSTAIN = 3

# The pair's rate goes stale while chains sit out: plain rounds teach it nothing, and a draft whose prompt is
# unread never probes (the probe would pay the read: draft_prime.py). A rate learned on text where chains lost
# then kept the draft out of every later call, whatever the text (AMX Xeon, 2026-12-07: after MT-bench/0's chains
# accepted a third, HumanEval/0-4 ran 64 plain rounds of 64 in every call, where `sd` runs ~1.5x `ar`). So after
# STALE_FIRST rounds in a row without a chain, counted across calls, the rate gives way to the prior (as a new
# engine's first call starts from): at the next call's start, or within a call (the serving core's lasts as long
# as its requests keep coming). Still drafting STALE_SUSTAIN rounds later resets the wait; decoding plainly by
# then doubles it (up to STALE_MAX). Such a start costs a read and a few losing chains on text that stays bad:
# ~5 plain steps, ~4% of the first wait and less after.
STALE_FIRST, STALE_MAX, STALE_SUSTAIN, STALE_SUFFIX = 128, 2048, 16, ":stale"


class ProbeWait:
    """γ auto's and PEARL's wait: after `every` plain rounds in a row one speculative round runs
    anyway (a probe), so that a change in the text is noticed. A probe that confirms plain decoding
    doubles the wait (up to PROBE_MAX), since every probe pays the draft's catch-up and a losing
    round (every 16 rounds, PEARL settled on plain ran 0.83-0.95x `ar` on the real pair; on a CPU
    its probes now fall on a call's first round only, `Pearl._probes_mid_call`); speculation
    winning again resets it."""

    def __init__(self, first: int = PROBE_FIRST, longest: int = PROBE_MAX):
        self.first, self.longest = first, longest
        self.every, self.run = first, 0  # the current wait; consecutive plain rounds so far

    def due(self, left: int | None = None, owed: int | None = None) -> bool:
        """A probe is due after `every` plain rounds, unless it would catch up more tokens than the
        call has `left` to write (None: not known). A probe pays the draft's catch-up of the tokens it
        `owed` (None: every plain round since the last; PEARL's wait counts on across calls, and a new
        call's draft owes nothing), ~0.1-0.2 of a target step a token on a CPU (a plain stretch's
        probes cost it 10-15% however the wait grows), and only speculation over the tokens left can
        repay it, at best a similar share of a step a token: the last probe of a reply, which caught up
        32 tokens with 15 left (64 new) or 128 with 13 (256), could not (docs/design.md, "Never slower")."""
        return self.run >= self.every and (left is None or left >= (self.run if owed is None else owed))

    def count(self, plain: bool) -> None:
        self.run = self.run + 1 if plain else 0

    def settle(self, plain: bool) -> None:
        """What a probe (or a choice by the costs alone) found: plain doubles the wait, speculation resets it."""
        self.every = min(2 * self.every, self.longest) if plain else self.first
