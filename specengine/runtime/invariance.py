"""Batch-invariant mode, decided by measurement (docs/design.md, "Batch-invariant mode").

Whether a token's logits depend on how many tokens share its forward is a property of the
backend (BLAS kernel choice per row count, the CPU matmul plan, GPU split-K heuristics),
not something to assume per CPU. So the mode *probes* it: a one-layer shadow of the target
(the same Linear modules, norms, RoPE tables and ops table, hence the same kernel
per shape) decodes a few random tokens one at a time, then verifies them in blocks of every
width 1..W, and every row's logits must have the same bits. Kernel choice depends on shapes,
never on values, so random data exposes any difference in reduction order.

Three ways to be invariant, cheapest first:
- unpadded: forwards keep their own width (only the fixed-tile attention differs from the
  normal path); on CPUs whose kernels are row-count invariant this costs almost nothing;
- one matmul path (CPU, bf16): unpadded, every Linear on our `rows` kernel at every row count
  (cpu_matmul.use_path), where the measured plan mixes BLAS paths by row count. Its decode pays
  `rows` at one row (0-33% over the plan's best on the AVX2 EPYC) where padding paid the plan's
  best at W rows, which from 2 rows on is `rows` itself, at W times the work;
- padded to W: every verify/decode runs at W tokens per row, so every matmul has one shape.
GPU forwards always pad (graph buckets regroup widths, and memory-bound steps pay little).

`BatchInvariance` is the one owner of the mode: each ModelRunner holds one, and it decides
the attention and pad width, probes, and widens. The probe and the cost measurement get
runners from it; this module never imports the runner.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
from torch import nn

from .. import machine
from ..errors import SpecEngineError
from ..models import cpu_matmul
from ..models.quant_linear import quant_layers
from ..timing import best_seconds
from .graphs import batch_bucket
from .step_costs import table_key

# "refuse": every probe reports a difference, as on a machine whose kernels no padding makes
# invariant (CI runs the tests that depend on the probe this way too: Makefile, `test`)
PROBE_ENV = "SPECENGINE_INVARIANT_PROBE"
PROBE_CONTEXT = 24  # prompt tokens before the probed ones (one attention tile is enough)
INVARIANT_MAX_COST = 0.05  # mode "auto" turns on when a decode costs at most this much more with it


class BatchInvariance:
    """Batch-invariant mode of one runner: off (`width` None) or on up to `width` tokens per
    forward, with the attention and pad width the probe accepted and the batch sizes it
    passed. It sets the runner's `ops` (its normal table, or that table with the invariant
    attention) and drops its graphs when they change (they baked the old kernel)."""

    def __init__(self, runner):
        self.runner = runner
        self.width: int | None = None  # on: the widest target forward it covers
        self.pad_width: int | None = None  # ... and the width every forward pads to, if the probe needs it
        self.path: str | None = None  # ... or the one matmul path every Linear takes (cpu_matmul.use_path)
        self.choice, self.batches = 0, set()

    def candidates(self) -> list[tuple]:
        """(ops, pad width, one matmul path) to probe, cheapest first: every invariant attention the
        ops table allows (fastest first: the compiled per-row one on a CPU, the fixed-split kernel on
        CUDA); on a CPU unpadded, then with one matmul path where one exists, then padded; on CUDA
        always padded (graph buckets regroup widths)."""
        W, r = self.width, self.runner
        options = [(r.normal_ops.with_attention(fn, name)) for fn, name in r.normal_ops.invariant_attentions()]
        if r.device.type == "cuda":
            return [(ops, W, None) for ops in options]
        one = cpu_matmul.row_invariant_path(r.model)
        return ([(ops, None, None) for ops in options] + ([(ops, None, one) for ops in options] if one else [])
                + [(ops, W, None) for ops in options])

    def select(self, choice: int = 0) -> None:
        """Take candidate `choice` (mode on) or the normal ops (off) and forget which batch
        sizes the probe passed (kernels, matmul plans or attention changed)."""
        self.choice, self.batches = choice, set()
        self.apply(self.candidates()[choice] if self.width else (self.runner.normal_ops, None, None))
        self.runner.drop_graphs()

    def apply(self, setting: tuple) -> None:
        """The runner forwards as `setting` (ops, pad width, one matmul path or None: the plan's)."""
        self.runner.ops, self.pad_width, self.path = setting
        cpu_matmul.use_path(self.runner.model, self.path)

    def set_width(self, width: int | None) -> None:
        """On up to `width` tokens per forward, or off (None)."""
        if width is not None:
            check_width(width)
        self.width = width
        self.select()

    def ensure(self, batch: int, width: int | None = None) -> None:
        """Probe (once per batch size) that forwards of `batch` rows give each token the bits
        of decoding it alone, trying the candidates from the current one on (never back to a
        cheaper one). `width`: a method's widest forward, which widens the mode (re-probed).
        Raises when none holds: the mode cannot promise exactness on this backend."""
        if self.width is None:
            return
        if width is not None and width > self.width:
            self.width = width
            self.select()
        if batch in self.batches:
            return
        r = self.runner
        rows = (batch_bucket(batch, r.max_batch) if r.use_graphs and batch <= r.max_batch else None) or batch
        shadow = r.spawn(one_layer(r.model))  # the graphs replay at the bucket's row count
        candidates = self.candidates()
        for i in range(self.choice, len(candidates)):
            failure = probe(shadow, candidates[i], rows, self.width)
            if failure is None:
                if i != self.choice:
                    self.select(i)
                self.batches.add(batch)
                return
        self.apply(candidates[self.choice])  # the shared Linears as the mode left them, not as the probe did
        raise SpecEngineError(
            f"batch-invariant mode: on this backend the {failure}, even with every forward padded to "
            f"{self.width} tokens; pass batch_invariant=False (16-bit speculation may then "
            f"flip near-ties)", "batch_invariant")

    def configure(self, mode="auto", width: int = 9) -> dict:
        """True | False | "auto". "auto" turns the mode on for a 16-bit model when the probe
        passes and either no padding is needed (the only change is the fixed-tile attention:
        no timing, so no noisy timer decides exactness) or one decode with the padding costs at
        most INVARIANT_MAX_COST more than without it, timed until stable (`stable_cost`).
        Returns what was found: mode, on, pad_width, cost (None: not timed), costs (every
        timing), why, and refused (the probe's finding) when the probe refused."""
        check_options(mode, width)
        info = {"mode": mode, "on": False, "pad_width": None, "cost": None, "costs": [], "why": "off"}
        reason = auto_reason(self.runner)
        if mode is True or (mode == "auto" and reason):
            self.set_width(width)
            info["why"] = "asked for" if mode is True else reason
            try:
                self.ensure(1)
            except SpecEngineError as e:
                if mode is True:
                    raise
                self.set_width(None)
                info.update(refused=str(e), why="the probe refused")
            if mode == "auto" and self.width is not None:
                if self.pad_width is None and self.path is None:
                    info["why"] = "no padding needed: on without a timing"
                else:
                    info["cost"], info["costs"] = self.recalled_cost()
                    over = info["cost"] > INVARIANT_MAX_COST
                    how = f"padding to {self.pad_width}" if self.path is None else f"one matmul path ({self.path})"
                    info["why"] = (f"{how} costs {info['cost']:+.1%} per decode "
                                   f"({'over' if over else 'within'} {INVARIANT_MAX_COST:.0%})")
                    if over:
                        self.set_width(None)
        else:
            self.set_width(None)
            info["why"] = "asked off" if mode is False else "not a 16-bit or quantized target"
        info.update(on=self.width is not None, pad_width=self.pad_width, path=self.path)
        return info

    def recalled_cost(self) -> tuple[float, list[float]]:
        """`stable_cost(self.cost)` through the machine's table on a CPU, under the runner's cost
        signature as the mode sets it (its ops, pad width): a second load reads it (up to 7 timings
        of 12 decodes each, ~15 s of a SmolLM2 load on the AVX2 EPYC). Only the cost: the probe
        above, the mode's exactness guard, runs at every load."""
        key = table_key("invariant_cost", self.runner, None)
        entry = machine.load().get(key) if key is not None else None
        if entry is not None:
            return entry["cost"], list(entry["costs"])
        cost, costs = stable_cost(self.cost)
        if key is not None:
            machine.update({key: {"cost": cost, "costs": costs}})
        return cost, costs

    def cost(self) -> float:
        """Extra time of one decode with the mode (its attention, padding or one path) over without it."""
        r = self.runner
        mode = (r.ops, self.pad_width, self.path)
        shadow = r.spawn(r.model)
        try:
            off, on = decode_seconds(shadow, [(r.normal_ops, None, None), mode], shadow.invariance.apply)
        finally:
            self.apply(mode)  # the shared Linears' plans back to the mode's
        return on / off - 1


def auto_reason(runner) -> str | None:
    """Why mode "auto" should turn on for this target, or None: a 16-bit target (its rounding
    follows the kernel per row count), or one with GGUF-block layers, whose int8 activations turn
    the last bit of any row-count-dependent sum (attention, say) into a flipped rounding step,
    large enough to flip greedy near-ties even in fp32."""
    if runner.dtype in (torch.float16, torch.bfloat16):
        return "16-bit target"
    if quant_layers(runner.model):
        return "quantized weights (int8 activations)"
    return None


def stable_cost(measure, spread: float = 0.02, tries: int = 7) -> tuple[float, list[float]]:
    """(median of the last three, every value) of `measure()`, repeated until three in a row
    lie within `spread` of each other (or `tries` are spent): one noisy timing never decides."""
    costs = []
    while len(costs) < tries:
        costs.append(measure())
        last = sorted(costs[-3:])
        if len(last) == 3 and last[-1] - last[0] <= spread:
            break
    last = sorted(costs[-3:])
    return last[len(last) // 2], costs


def check_width(width) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise SpecEngineError(f"invariant_width must be an integer >= 1, got {width!r}", "invariant_width")


def check_options(mode, width) -> None:
    """The mode's options as the Engine (EngineConfig) and `configure` accept them."""
    if mode not in (True, False, "auto"):
        raise SpecEngineError(f"batch_invariant must be True, False or 'auto', got {mode!r}", "batch_invariant")
    check_width(width)


def one_layer(model) -> nn.Module:
    """The model with only its first decoder layer: same modules, a 1-layer KV cache."""
    shadow = copy.copy(model)
    shadow._modules = dict(model._modules)  # noqa: SLF001 - a shallow module copy
    shadow.layers = nn.ModuleList([model.layers[0]])
    shadow.config = dataclasses.replace(model.config, num_layers=1)
    return shadow


@torch.inference_mode()
def probe(runner, setting: tuple, rows: int, width: int, seed: int = 0) -> str | None:
    """None when every row's logits (and so its K/V) are bit-identical decoded alone (one
    row, one token; padded to `pad` if set) and verified in blocks of 1..width tokens with
    `rows` rows, on `runner` (an eager runner of its own, the model's first layer); else
    what differed."""
    forced = os.environ.get(PROBE_ENV, "")
    if forced not in ("", "measure", "refuse"):
        raise SpecEngineError(f"{PROBE_ENV} must be 'measure' or 'refuse', got {forced!r}", PROBE_ENV)
    if forced == "refuse":
        return f"probe was told to refuse ({PROBE_ENV}=refuse)"
    runner.invariance.apply(setting)
    pad = setting[1]
    model = runner.model
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, model.config.vocab_size, (rows, PROBE_CONTEXT + width), generator=g).to(runner.device)
    lens = torch.arange(PROBE_CONTEXT, PROBE_CONTEXT - rows, -1).clamp_min(1).to(runner.device)
    step = torch.arange(width, device=runner.device)
    new = seq.gather(1, lens[:, None] + step)  # each row's probed tokens, right after its prompt
    cache = runner.allocate(rows, PROBE_CONTEXT + 2 * max(width, pad or 0))

    def reset():
        runner.cache = cache
        runner.prefill(seq[:, :PROBE_CONTEXT], lens)

    reset()
    alone = []
    for r in range(rows):  # one row, one token per forward: what `ar` computes at batch 1
        runner.cache = cache.row(r)
        alone.append(torch.stack([_decode_next(runner, new[r:r + 1, j]) for j in range(width)]))
    for w in range(1, width + 1):
        reset()
        block = runner.verify(new[:, :w])
        for r in range(rows):
            for j in range(w):
                if not torch.equal(block[r, j], alone[r][j]):
                    err = (block[r, j] - alone[r][j]).abs().max().item()
                    return (f"logits of a token verified at position {j} of {w} (batch {rows}) differ from "
                            f"decoding it alone by up to {err:.3g}")
    return None


def _decode_next(runner, token):
    logits = runner.decode(token)[0]
    runner.cache.set_lens(runner.cache.lens + 1)
    return logits


@torch.inference_mode()
def decode_seconds(runner, settings, apply, context: int = 128, rounds: int = 2, reps: int = 3) -> list[float]:
    """Best time of one single-row decode at `context` on `runner` (an eager runner of its
    own: the engine's buffers stay as they are) for each setting, taken by `apply(setting)`,
    interleaved round by round so a noisy machine biases no setting."""
    runner.allocate(1, context + 2 * max(s[1] or 1 for s in settings))
    lens = torch.tensor([context], dtype=torch.int32, device=runner.device)  # K/V values: any
    token = torch.zeros(1, dtype=torch.int64, device=runner.device)
    best = [float("inf")] * len(settings)
    for _ in range(rounds):
        for i, setting in enumerate(settings):
            apply(setting)
            best[i] = best_seconds(lambda: runner.decode(token), reps, runner.device,
                                   setup=lambda: runner.cache.set_lens(lens), best=best[i])
    return best
