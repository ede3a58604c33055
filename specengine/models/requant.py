"""A draft's GGUF blocks requantized for its role (docs/design.md, "A draft in fewer bits").

A draft's numerics never change the output: the target verifies every proposal, so greedy output
is `ar`'s and sampling keeps the target's distribution whatever the draft computes. Its cost per
step does matter, and on a CPU a step streams the weights: the default 0.5B draft's Q5_0/Q8_0
layers in Q4_0 read 25% fewer bytes. It also agrees with its target less often. So the choice is
measured, not assumed: the precision grid (precision.py) offers the setting "gguf-q4_0" for a
draft whose blocks hold more than 4.5 bits a weight, priced with the Q4_0 kernels' measured costs
and with its acceptance scaled by how often each draft's greedy token equals the target's over a
calibration text (teacher-forced, once per pair of files and machine, cached in the machine table:
draft_requant.py, where the grid's option lives).

Q4_0 is the format with a reference quantizer (ggml's `quantize_row_q4_0_ref`, which the `gguf`
package implements too: the tests compare the two); the K-quants' quantizers search per block and
the package has none. `SPECENGINE_DRAFT_REQUANT=off` takes the setting out of the grid,
`=Q4_0` makes it the draft's setting whenever it can be offered.
"""
from __future__ import annotations

import copy
import hashlib
import os

import torch
from tqdm.auto import tqdm

from ..errors import SpecEngineError
from .quant_linear import EXT_CODES, QuantLinear, _quantext, dequantize_ref, quant_layers, unpack_x8

FORMAT = "Q4_0"
SETTING = "gguf-q4_0"  # the grid's name for "the draft's blocks requantized to Q4_0"
ENV = "SPECENGINE_DRAFT_REQUANT"
BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}
CALIBRATION_TOKENS = 192


def mode() -> str:
    """"auto" (the grid decides), "off" or "Q4_0" (forced), from SPECENGINE_DRAFT_REQUANT."""
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in ("auto", "off", FORMAT):
        raise SpecEngineError(f"{ENV} must be one of auto, off, {FORMAT}; got {value!r}", ENV)
    return value


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n, K] -> Q4_0 blocks uint8 [n, K / 32 * 18]: the extension's loop where it is built (the
    torch reference's 2 s of a default pair's load on the 2-vCPU EPYC VM, ~0.1 s), the same bytes."""
    if x.shape[-1] % 32:
        raise ValueError(f"Q4_0 rows hold whole blocks of 32 values; {x.shape[-1]} is not a multiple")
    if _quantext is not None and x.device.type == "cpu":
        return _quantext.quantize_q4_0(x.float().contiguous())
    return quantize_q4_0_ref(x)


def quantize_q4_0_ref(x: torch.Tensor) -> torch.Tensor:
    """The spec: ggml's reference rule (quantize_row_q4_0_ref): per 32 values the one of largest
    magnitude, signed, is -8 d; q = min(15, trunc(x / d + 8.5))."""
    n, k = x.shape
    if k % 32:
        raise ValueError(f"Q4_0 rows hold whole blocks of 32 values; {k} is not a multiple")
    b = x.float().reshape(n, k // 32, 32)
    hi, lo = b.amax(-1, keepdim=True), b.amin(-1, keepdim=True)  # (half the time of an argmax over |b|)
    peak = torch.where(hi >= -lo, hi, lo)
    tie = (hi == -lo).squeeze(-1).nonzero(as_tuple=True)
    if tie[0].numel():  # both signs at the largest magnitude (or all zeros, signed): the first one wins
        tied = b[tie]
        peak[tie] = tied.gather(-1, tied.abs().argmax(-1, keepdim=True))
    d = peak / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = (b * inv + 8.5).to(torch.int8).clamp_(max=15).to(torch.uint8)  # trunc toward zero, as (int8_t) does
    packed = q[..., :16] | (q[..., 16:] << 4)
    scale = d.to(torch.float16).view(torch.uint8).reshape(n, k // 32, 2)
    return torch.cat([scale, packed], -1).reshape(n, -1).contiguous()


def _dequantized(q: str, w: torch.Tensor, cols: int) -> torch.Tensor:
    if _quantext is not None and q in EXT_CODES:
        return _quantext.dequantize(w, EXT_CODES[q], cols)
    return dequantize_ref(w, q)


def wide(layer: QuantLinear) -> bool:
    """Whether the layer holds a format of more bits than Q4_0 (and whole Q4_0 blocks per row)."""
    return layer.in_features % 32 == 0 and any(BITS.get(q, 0) > BITS[FORMAT] for q in layer.qtypes)


def formats_after(layer: QuantLinear) -> list[str]:
    """The layer's segment formats once requantized: Q4_0 for each of more bits in a wide layer."""
    return [FORMAT if wide(layer) and BITS.get(q, 0) > BITS[FORMAT] else q for q in layer.qtypes]


def offered(blocks) -> bool:
    """Whether the grid may offer the setting for this draft: blocks of more than Q4_0's bits, and
    the switch not off."""
    return blocks is not None and mode() != "off" and any(wide(layer) for layer in quant_layers(blocks))


def requantized(blocks, progress: bool = True):
    """A copy of `blocks` (a model of QuantLinear layers) whose layers of more than 4.5 bits a weight
    hold Q4_0 blocks; everything else (norms, the embedding's lookups, float layers) is shared, not
    copied. The layers keep the layout the machine reads faster (quant_plan.choose_layouts)."""
    from .quant_plan import choose_layouts

    shared = {id(t): t for t in [*blocks.parameters(), *blocks.buffers()]}
    model = copy.deepcopy(blocks, memo=shared)  # new modules over the same tensors
    layers = [layer for layer in quant_layers(model) if wide(layer)]
    for layer in tqdm(layers, desc=f"requantizing the draft to {FORMAT}", disable=not progress, leave=False):
        segments = [(after, w if after == q else quantize_q4_0(_dequantized(q, w, layer.in_features)))
                    for after, (q, w) in zip(formats_after(layer), layer.segments())]
        fresh = QuantLinear(segments, None, layer.parts)
        layer.qtypes, layer.packed = fresh.qtypes, fresh.packed
        for i, (_, w) in enumerate(segments):
            setattr(layer, f"qweight{i}", w)
    model.requantized = FORMAT
    choose_layouts(model, progress=progress)
    return model


def fingerprint(model) -> str:
    """A model's blocks, identified cheaply: formats, shapes and the first bytes of every layer."""
    h = hashlib.sha256()
    for layer in quant_layers(model):
        (q, w), n = layer.stored()[0], layer.packed[0]
        first = w if n is None else unpack_x8(w[:1], q, min(n, 8))  # held interleaved: its first group only
        h.update(f"{q}:{(w.shape[0] if n is None else n, first.shape[1])}".encode())
        h.update(first.reshape(-1)[:256].numpy().tobytes())
    return h.hexdigest()[:16]
