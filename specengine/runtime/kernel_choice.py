"""Which few-row linears a runner's steps take, chosen by timing both on its own GPU and model.

The fused few-row linears (the ops table's `gemv`, kernels/fused_linear.py) replace cuBLAS's
linear and the norm or SiLU-mul before it in a decode, verify or draft step. Whether they beat
cuBLAS depends on the shapes and the GPU (a 0.5B draft's 896-wide rows against a 7B target's
3,584), so `auto` keeps cuBLAS until `Engine.warmup()` has timed both here: each CUDA runner's
graphed one-token step under each table, taking turns, and the runner keeps the kernel only
where it won by MARGIN. Never assumed from another GPU, never on a CPU runner (the kernel is
Triton's), never where `kernels` names gemv's choice. Either path is lossless (every method gives
`ar`'s tokens on it: tests/ops/test_fused_linear_program.py); in fp32 both give the reference's
tokens, and in bf16 they round apart as two GPUs do.
"""
from __future__ import annotations

import torch

from ..kernels.jit import HAVE_TRITON
from ..kernels.ops import parse
from ..timing import best_seconds

MARGIN = 0.97  # the kernel's step must take at most this share of cuBLAS's: a tie keeps the library
CONTEXT = 256  # positions the timed step attends to (a short reply's; the linears do not depend on it)
BACK_TO_BACK = 8  # steps queued per sync: their device time, as a round pays it (runtime/step_costs.py)


def tables(kernels) -> dict[str, dict] | None:
    """{"torch": ..., "triton": ...}: `kernels` with gemv on cuBLAS and on the kernel, or None where
    `kernels` names gemv's choice itself (then nothing is measured)."""
    choices = parse(kernels)
    if choices["gemv"] != "auto":
        return None
    return {impl: {**choices, "gemv": impl} for impl in ("torch", "triton")}


def time_steps(runner, candidates: dict[str, dict], rounds: int = 3) -> dict[str, float]:
    """{impl: seconds of one graphed decode step} under each candidate table, on runners of their own
    over this runner's model (its buffer and graphs stay as they are), taking turns `rounds` times."""
    steps = {}
    for impl, table in candidates.items():
        spawned = runner.spawn(runner.model)
        spawned.set_kernels(table)
        spawned.set_cuda_graphs(True, capture=runner.capture, lazy=True)  # the step's own graph only
        cache = spawned.allocate(1, 2 * CONTEXT)
        cache.set_lens(torch.full((1,), CONTEXT, dtype=torch.int32, device=runner.device))
        token = torch.zeros(1, dtype=torch.int64, device=runner.device)
        steps[impl] = (lambda s=spawned, t=token: s.decode(t, attn_len=2 * CONTEXT))
    best = dict.fromkeys(steps, float("inf"))
    with torch.inference_mode():
        for impl, step in steps.items():
            step()  # captures (and autotunes) outside the timing
        for _ in range(rounds):
            for impl, step in steps.items():
                best[impl] = best_seconds(step, 1, runner.device, best=best[impl], back_to_back=BACK_TO_BACK)
    return best


def choose_gemv(runner, kernels, timer=None) -> dict | None:
    """Time `runner`'s step with cuBLAS and with the fused few-row linears (`timer(runner, tables)`:
    `time_steps` unless given, tests), set the faster on the runner and return {"chosen", "ms"};
    None where nothing was measured (a CPU runner without a timer, no Triton, gemv named in
    `kernels`). A kernel that fails here (a GPU it does not compile for) leaves cuBLAS, and says why."""
    candidates = tables(kernels)
    if candidates is None or not HAVE_TRITON or (runner.device.type != "cuda" and timer is None):
        return None
    try:
        seconds = (timer or time_steps)(runner, candidates)
    except Exception as e:  # an optional fast path: its failure is reported, never raised
        return {"chosen": runner.normal_ops.names["gemv"], "ms": {}, "why": f"the timing failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}"}
    chosen = "triton" if seconds["triton"] <= MARGIN * seconds["torch"] else "torch"
    if runner.normal_ops.names["gemv"] != chosen:
        runner.set_kernels(candidates[chosen])  # drops graphs captured with the other table
    return {"chosen": chosen, "ms": {impl: s * 1e3 for impl, s in seconds.items()}}


def choose_kernels(runners, kernels, timer=None) -> dict[str, dict]:
    """`choose_gemv` for each of the engine's runners (target first, then the draft): {role: its
    choice} where one was measured."""
    chosen = {role: choose_gemv(runner, kernels, timer) for role, runner in zip(("target", "draft"), runners)}
    return {role: c for role, c in chosen.items() if c is not None}
