"""Measured step costs, the inputs of every draft-length choice that is made by cost.

`sd` with `gamma="auto"` needs the draft's one-token step and the target's forward as a
function of its width (1 … γmax+1 tokens per row: on a CPU a verify of 4 tokens can cost
anything from 1x to 3x a decode step, depending on the BLAS); PEARL needs their ratio c.
Both are timed on the real models, at the call's batch size, right after prefill.
Each timed step writes K/V at positions >= cache.lens (scratch that later steps overwrite).

On a CPU the costs are kept in the machine's table (machine.py) under the models' cost signature
(shapes, dtypes, block formats and layouts, the ops and batch-invariant mode: what a forward's
time depends on), so a second load reads them instead of timing ~100 forwards again (18 of a warm
load's 54 s on the AVX2 EPYC). The table drops an entry taken while the machine ran much slower
than now (`machine.STALE`); the rounds' measured times correct what drifts after (`measured`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools

import torch

from .. import machine
from ..timing import CLOCK_SUFFIX, CURVES_SUFFIX, FILED, LEARNED, best_seconds


@dataclasses.dataclass(frozen=True)
class StepCosts:
    batch: int
    draft_s: float  # one draft step (one token per row)
    target_s: tuple[float, ...]  # target_s[w - 1]: one target forward of w tokens per row
    measured: bool = False  # timed on this machine (not pinned): rounds' measured times may correct it
    # the draft's seconds per token of a prefill-sized forward (PRIME_CHUNK tokens a row): what
    # hybrid's deferred draft prefill costs; None where not timed (no draft, no room in the cache)
    draft_prefill_s: float | None = None
    # draft_widths_s[w - 1]: the draft's forward of w tokens per row, what a catch-up reads (policies.read_s);
    # None where not timed (pinned costs): then its step scaled by the target's width curve. On the AVX2
    # EPYC the Q4_0 draft's curve is the steeper (4 tokens 1.78x one, the target's 1.33x; 8: 3.31x / 2.28x),
    # so catch-ups priced by the target's ran 30-45% over their forecast and read as dear drafting.
    draft_widths_s: tuple[float, ...] | None = None

    @property
    def cost_ratio(self) -> float:
        """c = draft step / target decode step (PEARL's window is round(1/c))."""
        return self.draft_s / self.target_s[0]

    def verify_s(self, width: int) -> float:
        """Target forward of `width` tokens; past the measured range, extrapolated linearly."""
        return at_width(self.target_s, width)

    def target_only(self) -> "StepCosts":
        """These costs with the draft left out (n-gram rounds, a method without the draft): reads are free."""
        return dataclasses.replace(self, draft_s=0.0, draft_widths_s=None)

    def draft_read_s(self, width: int) -> float:
        """The draft's forward of `width` tokens per row: measured (past the range, extrapolated
        linearly), else the draft step scaled as the target's width."""
        if not self.draft_widths_s:
            return self.draft_s * self.verify_s(width) / self.verify_s(1)
        return at_width(self.draft_widths_s, width)


def at_width(t: tuple[float, ...], width: int) -> float:
    """t[width - 1] of a forward's seconds per width; past the measured range, extrapolated linearly."""
    if width <= len(t):
        return t[width - 1]
    return t[-1] + (t[-1] - t[0]) / max(len(t) - 1, 1) * (width - len(t))


def forward_call(runner, state, width: int):
    """One forward of `width` tokens per row on the state's cache, as a call to time."""
    tokens = state.tokens.gather(1, state.positions(state.n - 1, width))
    return lambda: runner.verify(tokens, attn_len=state.attn_len), tokens.device


# Tokens a row of the draft forward timed as its prefill rate. Scaling the target's prefill rate by
# the decode-step ratio guessed hybrid's deferred prefill 1.5-1.8x too cheap (Q4_0 draft of the
# default pair, Zen 5: 0.17 s estimated, 0.26-0.32 s measured), and a first call paid it for nothing.
PRIME_CHUNK = 64


def prefill_call(runner, state, width: int):
    """A prefill-like forward of `width` tokens a row on the state's cache (K/V written past each
    row's end: scratch), logits at the last token only, as a call to time; None without the room
    (or for a draft on another device, whose prefill is the wrapper's)."""
    if not hasattr(runner, "forward"):
        return None
    start = int(state.n.max()) - 1
    room = runner.cache.max_seq_len - start
    if room < width:
        return None
    tokens = state.tokens.gather(1, state.positions(state.n - 1, width))
    last = torch.full((state.batch, 1), width - 1, dtype=torch.int64, device=tokens.device)
    return lambda: runner.forward(tokens, attn_len=start + width, logits_at=last), tokens.device


# Forwards timed per sync on a GPU (timing.best_seconds). A round queues its forwards behind one
# another and syncs once, so there a step costs its device time, not its latency from an idle device:
# the 0.5B step ran 0.93 ms of GPU work in a 2.5 ms (profiled) round on the first H200 run, where γ
# auto decoded plainly (0.69x `ar`) while γ 4 ran 1.43x. On a CPU the calls are synchronous: one.
BACK_TO_BACK = 4


def measure_step_costs(target, draft, state, max_width: int, repeats: int = 3) -> StepCosts:
    """Each cost is the best of `repeats` times, taken in rounds over every width and the draft
    step rather than width by width: a machine whose speed drifts (a shared VM: 20-30% within
    minutes) then moves all of them alike, and their ratios, which γ is chosen by, hold.
    draft None (n-gram drafting): proposing is free, draft_s = 0."""
    calls = {w: forward_call(target, state, w) for w in range(1, max_width + 1)}
    if draft is not None:
        calls[0] = forward_call(draft, state, 1)
        calls.update({("draft", w): forward_call(draft, state, w) for w in range(2, max_width + 1)})
        prime = prefill_call(draft, state, PRIME_CHUNK)
        if prime is not None:
            calls["prime"] = prime
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for key, (fn, device) in calls.items():
            best[key] = best_seconds(fn, 1, device, best=best[key],
                                     back_to_back=BACK_TO_BACK if torch.device(device).type == "cuda" else 1)
    prime_s = best["prime"] / (state.batch * PRIME_CHUNK) if "prime" in best else None
    widths = (best[0], *(best["draft", w] for w in range(2, max_width + 1))) if draft is not None else None
    return StepCosts(state.batch, best.get(0, 0.0), tuple(best[w] for w in range(1, max_width + 1)), measured=True,
                     draft_prefill_s=prime_s, draft_widths_s=widths)


def cost_signature(runner) -> str:
    """What a forward's time depends on, as a short digest: the model's tensors (names, shapes,
    dtypes), which block segments are held interleaved, and the runner's ops and batch-invariant
    mode (its padding or one matmul path). Values are left out: they never change a kernel's time."""
    h = hashlib.sha256()
    model = runner.model
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    for name, m in model.named_modules():
        if getattr(m, "packed", None) is not None:
            h.update(f"{name}:{m.packed};".encode())
    inv = runner.invariance  # on or off, its pad width and matmul path: not the width it covers, which widening
    # an unpadded mode changes with no forward's cost (hybrid's calls widened it: a new key, the costs timed again)
    h.update(f"{sorted(runner.ops.names.items())}:{inv.width is not None}:{inv.pad_width}:{inv.path}:"
             f"{type(model).__name__}".encode())
    return h.hexdigest()[:16]


def table_key(kind: str, target, draft) -> str | None:
    """The machine table's key of what these runners measured (`kind`: "step_costs", "round_clock"),
    by their cost signatures; None unless both run on this CPU (a GPU, or a draft across devices:
    the table is a CPU's)."""
    runners = [r for r in (target, draft) if r is not None]
    if not all(r.device.type == "cpu" and hasattr(r, "invariance") for r in runners):
        return None
    return f"{kind}:{cost_signature(target)}:{cost_signature(draft) if draft is not None else 'none'}"


def recalled_or_measured(target, draft, state, max_width: int) -> StepCosts:
    """`measure_step_costs`, through the machine's table on a CPU: an entry for these runners'
    cost signatures, batch and at least `max_width` widths is read; else the costs are timed and
    filed."""
    runners_key = table_key("step_costs", target, draft)
    if state.tokens.device.type != "cpu" or runners_key is None:
        return measure_step_costs(target, draft, state, max_width)
    key = f"{runners_key}:b{state.batch}"
    entry = machine.load().get(key)
    if entry is not None and len(entry["target_s"]) >= max_width and (draft is None or "draft_widths_s" in entry):
        widths = entry.get("draft_widths_s")
        return StepCosts(state.batch, entry["draft_s"], tuple(entry["target_s"]), measured=True,
                         draft_prefill_s=entry.get("draft_prefill_s"), draft_widths_s=tuple(widths) if widths else None)
    costs = measure_step_costs(target, draft, state, max_width)
    machine.update({key: {"draft_s": costs.draft_s, "target_s": list(costs.target_s),
                          "draft_prefill_s": costs.draft_prefill_s,
                          "draft_widths_s": list(costs.draft_widths_s) if costs.draft_widths_s else None}})
    return costs


# The plain rounds' correction (methods/round_clock.py: measured / predicted seconds of a plain decode
# round), filed beside the step costs it corrects, so that an engine's first call starts from what the
# last process measured instead of from the bare costs (on the AVX2 EPYC a plain round ran 1.05-1.45x
# the best-of forward time: a first call then predicted 30-70% too fast). A call whose correction moved
# by more than REPLAN from what is filed files it again: the plan it predicted by missed. The drafted
# rounds' correction is not filed: one slow first call's (2.5x) kept the next processes' γ auto plain
# while γ 3 ran 1.4x `ar`; a call measures its own within 3 drafted rounds, a bias toward trying.
# The draft's greedy acceptance is filed too (moved by more than ALPHA_MOVED): a pair's property, so
# an engine's first hybrid call need not pay the draft's prefill only to learn it (whether to prime
# the draft is then its projected savings' call, as in later calls). Greedy only: there γ never
# changes the tokens, while a seeded sampled call must draw the same tokens whatever the table holds.
# Seeded under FILED, beside the engine's own, so that a policy applies it to measured costs only.
# The n-gram methods' greedy acceptance curves by match length (ngram_policy.py) are filed the same
# way (once CURVES_MOVED verified tries changed them): a first call in a new process explored them
# again, 4 extra rounds of 46 on HumanEval/1 x 64 (0.90x the next call). So is PEARL's greedy state
# (pearl.py `_recall`: acceptance, yield, probe wait; moved by ALPHA_MOVED or a wait that changed):
# a new process's first PEARL call started from the prior and a wait of 16, and probed 3-4 times in
# 64 tokens where the next call probed once (0.91x the next call, MT-bench, AVX2 EPYC).
# All of it is ratios and rates, not times, so it is filed without the machine's speed stamp: stamped, a
# process whose reference matvec ran 1.4x faster than the filing one's left it out (this VM: 1.4-2.15 ms
# process to process), and its first PEARL call read the prompt for two losing windows (0.92x the next).
REPLAN = 0.10
ALPHA_MOVED = 0.05
CURVES_MOVED = 8
ALPHA_KEY = "greedy"  # the store's key of the draft's greedy acceptance (sd and hybrid share it)
FILED_KINDS = ("plain",)


class FiledClocks:
    """One engine's corrections and greedy acceptance in the machine's table (None off a CPU):
    `seed` puts what is filed into the engine's acceptance store where the store has none (a new
    engine, or one whose warmup cleared it); `file` files what a call measured where it moved."""

    def __init__(self, target, draft):
        self.runners, self.off, self._key, self.filed = (target, draft), False, None, {}
        self._sync()

    def _sync(self) -> str | None:
        """The runners' key now, what is filed under it read again where it changed (a padded
        batch-invariant mode, or other kernels, since the last call: other costs, other corrections;
        the next call seeds from it)."""
        key = table_key("round_clock", *self.runners)
        if key != self._key:
            entry = machine.load().get(key, {}) if key is not None else {}
            self._key = key
            self.filed = {k: v for k, v in entry.items() if k.endswith((CLOCK_SUFFIX, CURVES_SUFFIX, LEARNED))
                          or k == ALPHA_KEY}
        return key

    @property
    def key(self) -> str | None:
        """Where this engine files (None while paused, or off a CPU)."""
        return None if self.off else self._sync()

    @contextlib.contextmanager
    def paused(self):
        """Calls made meanwhile file nothing (warmup's: what a junk prompt accepts is no pair's rate)."""
        self.off = True
        try:
            yield
        finally:
            self.off = False

    def seed(self, store: dict) -> None:  # from the key the last `file` found (a signature costs ~3 ms on 2 cores)
        for k, v in self.filed.items():
            if k.endswith(CLOCK_SUFFIX):
                store.setdefault(k, dict(v))
            else:
                store.setdefault(k + FILED, v)

    def file(self, store: dict) -> None:
        key = self.key
        now = {k: {kind: f for kind, f in v.items() if kind in FILED_KINDS} for k, v in store.items()
               if k.endswith(CLOCK_SUFFIX)}
        now = {k: v for k, v in now.items() if v}
        moved = any(abs(f / self.filed[k][kind] - 1) > REPLAN if self.filed.get(k, {}).get(kind) else True
                    for k, kinds in now.items() for kind, f in kinds.items())
        if ALPHA_KEY in store:
            now[ALPHA_KEY] = store[ALPHA_KEY]
            moved |= ALPHA_KEY not in self.filed or abs(store[ALPHA_KEY] - self.filed[ALPHA_KEY]) > ALPHA_MOVED
        curves = {k: v for k, v in store.items() if k.endswith(":greedy" + CURVES_SUFFIX)}
        for k, (seen, kept) in curves.items():
            now[k] = [[list(r) for r in seen], [list(r) for r in kept]]
            moved |= k not in self.filed or _tries_apart(now[k][0], self.filed[k][0]) >= CURVES_MOVED
        for k, v in store.items():  # PEARL's: its acceptance, yield and probe wait (not the plain rounds under way)
            if k.endswith(":greedy" + LEARNED):
                old, now[k] = self.filed.get(k), {**v, "run": 0}
                moved |= old is None or abs(v["alpha"] - old["alpha"]) > ALPHA_MOVED or v["every"] != old["every"]
        if key is not None and moved:
            self.filed = {**self.filed, **now}
            machine.update({key: dict(self.filed)}, timed=False)  # ratios and rates: no speed stamp


def _tries_apart(seen: list, filed: list) -> float:
    """How many verified tries two curves' counts differ by (any shape: another γ max is all apart)."""
    if len(seen) != len(filed) or any(len(a) != len(b) for a, b in zip(seen, filed)):
        return float("inf")
    return sum(abs(x - y) for a, b in zip(seen, filed) for x, y in zip(a, b))
