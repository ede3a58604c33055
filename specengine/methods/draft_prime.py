"""The draft's prompt read at its first drafted round rather than at the call's prefill (`sd` and `hybrid`
with γ auto, `pearl` by cost; `DeferredRead` keeps what they share): a row's text goes into the draft's cache only once the chains' projected savings over the rest
of the reply pay for that prefill. A short reply to a long prompt then never pays it (on the AVX2 EPYC a
~1,000-token prompt's draft prefill cost 2-5 s, and `sd` ran 0.61-0.75x `ar` end to end on 16 tokens:
docs/design.md, "Never slower")."""
from __future__ import annotations

from ..timing import Stopwatch
from .policies import best_gamma, read_s
from .state import DecodeState

# what a row may write where its end is not known: this many times what it has written so far
# (chosen by host-only replays and an interleaved A/B: docs/design.md, "Experiments")
PRIME_HORIZON = 2.0


def ahead(row, written: int, left: int, constrained: bool) -> int:
    """What a row may still write: its limit's remainder (`left`) where nothing can end it sooner (no stop
    id or string, no constraint: `ignore_eos`), else PRIME_HORIZON times what it has written (at least
    one token), at most that remainder. Known, the prime is paid in the first rounds where it pays:
    projected at 2x, a draft that won every round waited for half of a 64-token reply (real pair, Zen 5,
    HumanEval/0-3 x 64: `hybrid` 0.98x `ar`, median of 8; 1.17x)."""
    if not row.stops and not row.stop_ids and not constrained:
        return left
    return int(min(PRIME_HORIZON * max(written, 1), left))


def prime_s(costs, lengths: list[int], width: int, prefill_token_s: float | None = None) -> float:
    """Seconds of the deferred prefill of rows of these committed lengths (all but the last token of
    each): the draft's own prefill rate where the step costs timed it (`StepCosts.draft_prefill_s`);
    else the target's measured prefill rate (`prefill_token_s`, seconds a token) scaled by the
    draft/target step ratio (1.5-1.8x too cheap on a CPU), and never more than reading them in forwards
    of `width` over the batch, which is the estimate where neither was timed (the serving core admits
    rows one by one)."""
    if not lengths:
        return 0.0
    tokens = sum(n - 1 for n in lengths)
    if getattr(costs, "draft_prefill_s", None) is not None:
        return tokens * costs.draft_prefill_s
    chunks = read_s(costs, max(lengths) - 1, width)
    if prefill_token_s is None:
        return chunks
    return min(tokens * prefill_token_s * costs.draft_s / costs.verify_s(1), chunks)


def prime(draft, state: DecodeState, primed: list[bool], live: list[int], lengths: list[int]) -> int:
    """The deferred draft prefill of the live rows whose text the draft has not read (`primed[b]` False;
    `lengths[b]`: row b's committed tokens): all but each row's last committed token, as after a prefill
    (the chain's own catch-up reads that one). One batched prefill when no row was read yet (a generate
    call), else row by row (the serving core's rows come and go). Marks them read; returns how many."""
    rows = range(state.batch)
    if not any(primed[b] for b in rows):
        longest = max(lengths[b] for b in rows)  # finished rows' frozen text comes along
        draft.prefill(state.tokens[:, : max(longest - 1, 1)], state.n - 1, attn_len=max(longest - 1, 1))
        for b in rows:
            primed[b] = True
        return len(live)
    read = 0
    for b in live:
        if not primed[b]:
            n = lengths[b]
            draft.prefill_row(b, state.tokens[b: b + 1, : max(n - 1, 1)], n - 1)
            primed[b], read = True, read + 1
    return read


def chain_factor(clock) -> float:
    """The drafted rounds' correction (measured / predicted seconds) that prices the read: this call's where
    it timed them, else the plain rounds' (the same moment's). An earlier call's factor of drafted rounds is
    re-timed only by a probe, and a probe must read the prompt first: priced at it, the read never paid in
    a call that started plain, no probe ran, and the factor went on to every later call (AVX2 EPYC,
    HumanEval: 3 of 15 `sd` calls all plain at 1.65 against plain's 1.1-1.3, where drafting ran 1.2-1.4x).
    Never timed at all, not the bare model's 1 either: a plain factor under 1 (rounds faster than the step costs
    were timed) then kept a new process's `sd` from ever reading the prompt (AMX Xeon, filed plain 0.86: HumanEval/1
    64 plain rounds of 64 in 3 processes, every call, where it drafts at 1.2-1.3x)."""
    return clock.factor("plain" if "spec" in clock.prior or not clock.known("spec") else "spec")


def reading_gamma(policy) -> int:
    """γ auto's γ for a chain that would first read the prompt: chosen at the factor that prices the read
    (`chain_factor`). Chosen at an earlier call's chain factor, which only a chain re-times, γ stayed 0 but on
    probes, whose short γ lost to `hybrid`'s n-gram rounds on paper, and the read never paid: a chain factor of
    2.5 filed in a noisy hour kept `hybrid`'s draft out of 10 calls in a row (real pair, AMX Xeon, HumanEval/0-4,
    where once read it runs 1.2-1.8x `ar`)."""
    scale = {**policy.clock.factors(), "spec": chain_factor(policy.clock)}
    return best_gamma(policy.alpha, policy.costs, policy.gamma_max, gamma_min=1 if policy.probing else 0, scale=scale)


def unread_lengths(rows, live: list[int], primed: list[bool]) -> list[int]:
    """Committed tokens of the live rows whose text the draft has not read (the driver's host rows)."""
    return [rows[b].prompt_len + len(rows[b].ids) for b in live if not primed[b]]


def pays(rows, live: list[int], primed: list[bool], costs, width: int, saved: float, constrained: bool,
         margin: float = 1.0) -> bool:
    """Would `saved` seconds a round-token (drafting's over plain decoding, for the live rows together)
    over what the live rows may still write (`ahead`) pay `margin` times for the draft's prefill of the
    rows it has not read? True where it read them all."""
    unread = unread_lengths(rows, live, primed)
    if not unread:
        return True
    left = sum(ahead(rows[b], len(rows[b].ids), rows[b].max_new - len(rows[b].ids), constrained) for b in live)
    return saved / max(len(live), 1) * left > margin * prime_s(costs, unread, width)


def read_now(draft, state: DecodeState, primed: list[bool], live: list[int], timer, watch: Stopwatch) -> int:
    """The deferred prefill, run in a round (the `prime` phase: stats["prefill_s"] counts it): it reads the
    rows' lengths, the round's one extra sync, once a call. `watch` (timing.Stopwatch) times the prefill, so
    the round's clock can book the chain without it (`DeferredRead.chain_s`). Returns the rows read."""
    lengths = state.n.tolist()
    with timer.phase("prime"), watch:
        return prime(draft, state, primed, live, lengths)


class DeferredRead:
    """What a method whose draft reads the prompt at its first drafted round keeps (`sd` γ auto, `pearl` by
    cost, `hybrid` γ auto: `defers_draft_prefill`): per row whether the draft's cache holds its text
    (`primed`), the reads run (`primes`), and whether the round now running read (`primed_now`), its prefill
    timed (`watch`). That round is booked on the round clock without its prefill, whose price goes to the
    plan's forecast only: kept off the clock, a probe that read re-timed nothing, and a stale chain factor
    kept the prompt unread call after call (docs/design.md, "Never slower")."""

    defers_draft_prefill = False

    def __init__(self, *args, **kw):
        self.primed: list[bool] = []
        self.primes, self.primed_now, self.watch = 0, False, None
        super().__init__(*args, **kw)

    def unread_again(self, rows) -> None:
        """These rows start afresh (a call, or the serving core's new request): prefilled into the draft,
        or to be read at their first drafted round where the read is deferred."""
        for b in rows:
            if b < len(self.primed):
                self.primed[b] = not self.defers_draft_prefill

    def reading(self, clock, price_s: float, device) -> Stopwatch:
        """The round now running reads the prompt: the plan's forecast pays `price_s`; returns the stopwatch
        that times the prefill."""
        clock.forecast[1] += price_s
        self.watch, self.primed_now = Stopwatch(device), True
        return self.watch

    def read_in_round(self, rows, state: DecodeState, live: list[int], timer, plan, width: int) -> int:
        """`sd`'s and `pearl`'s read in a round of the live rows the draft has not read (`read_now`), the
        forecast of `plan` (what holds the round clock and step costs: sd's γ policy, PEARL itself) paying
        `prime_s`. Returns the rows read (0: none was unread; `plan` is then not read, a fixed γ has no clock)."""
        unread = unread_lengths(rows, live, self.primed)
        if not unread:
            return 0
        watch = self.reading(plan.clock, prime_s(plan.costs, unread, width), state.tokens.device)
        read = read_now(self.ctx.draft, state, self.primed, live, timer, watch)
        self.primes += read
        return read

    def chain_s(self, seconds: float) -> float:
        """A round's measured seconds as its clock books them: a reading round's less its prefill's."""
        return max(seconds - self.watch.seconds(), 0.0) if self.primed_now else seconds
