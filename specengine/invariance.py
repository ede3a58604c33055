"""Batch-invariant mode, decided by measurement (docs/design.md, "Batch-invariant mode").

Whether a token's logits depend on how many tokens share its forward is a property of the
backend (BLAS kernel choice per row count, the CPU matmul plan, GPU split-K heuristics),
not something to assume per CPU. So the mode *probes* it: a one-layer shadow of the target
(the same Linear modules, norms, RoPE tables and attention function, hence the same kernel
per shape) decodes a few random tokens one at a time, then verifies them in blocks of every
width 1..W, and every row's logits must have the same bits. Kernel choice depends on shapes,
never on values, so random data exposes any difference in reduction order.

Two ways to be invariant, cheapest first:
- unpadded: forwards keep their own width (only the fixed-tile attention differs from the
  normal path); on CPUs whose kernels are row-count invariant this costs almost nothing;
- padded to W: every verify/decode runs at W tokens per row, so every matmul has one shape.
GPU forwards always pad (graph buckets regroup widths, and memory-bound steps pay little).
"""
from __future__ import annotations

import copy
import dataclasses
import time

import torch
from torch import nn

PROBE_CONTEXT = 24  # prompt tokens before the probed ones (one attention tile is enough)


def one_layer(model) -> nn.Module:
    """The model with only its first decoder layer: same modules, a 1-layer KV cache."""
    shadow = copy.copy(model)
    shadow._modules = dict(model._modules)  # noqa: SLF001 - a shallow module copy
    shadow.layers = nn.ModuleList([model.layers[0]])
    shadow.config = dataclasses.replace(model.config, num_layers=1)
    return shadow


@torch.inference_mode()
def probe(model, attn_fn, rows: int, width: int, pad: int | None, seed: int = 0) -> str | None:
    """None when every row's logits (and so its K/V) are bit-identical decoded alone (one
    row, one token; padded to `pad` if set) and verified in blocks of 1..width tokens with
    `rows` rows; else what differed."""
    from .runner import ModelRunner  # runner imports this module

    runner = ModelRunner(one_layer(model), cuda_graphs=False)
    runner.attn_fn, runner.pad_width = attn_fn, pad
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
def decode_seconds(model, settings, context: int = 128, rounds: int = 2, reps: int = 3) -> list[float]:
    """Best time of one single-row decode at `context` on the whole model for each (attention,
    pad width) setting, interleaved round by round so a noisy machine biases no setting. One
    runner and buffer of its own (the engine's stay as they are)."""
    from .runner import ModelRunner

    runner = ModelRunner(model, cuda_graphs=False)
    runner.allocate(1, context + 2 * max(pad or 1 for _, pad in settings))
    lens = torch.tensor([context], dtype=torch.int32, device=runner.device)  # K/V values: any
    token = torch.zeros(1, dtype=torch.int64, device=runner.device)
    best = [float("inf")] * len(settings)
    for _ in range(rounds):
        for i, (attn_fn, pad) in enumerate(settings):
            runner.attn_fn, runner.pad_width = attn_fn, pad
            for _ in range(reps):
                runner.cache.set_lens(lens)
                _sync(runner.device)
                t = time.perf_counter()
                runner.decode(token)
                _sync(runner.device)
                best[i] = min(best[i], time.perf_counter() - t)
    return best


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
