"""The compiled CPU kernels (`specengine._quantext`, built from csrc/ at install), loaded once
for every op file here. `EXT` is the module (its Python functions: the quantized matmul, the
row attention), or None where it was not built; then every op has its torch reference and the
ops table never offers a "cpu" choice. Loading it also registers the fused step's CPU ops
with torch's dispatcher (`torch.ops.specengine.*`, csrc/fused_ops_cpu.cpp); their shapes for
tracing (torch.compile's fake tensors) are given below."""
from __future__ import annotations

import os

import torch

from ..errors import SpecEngineError

FORCE_ENV = "SPECENGINE_ISA"


def _load():
    try:
        from .. import _quantext
    except ImportError:  # not built (no compiler at install)
        return None
    return _quantext


EXT = _load()
# the compiled kernels' formats and codes, from their one table (csrc/cpu/common.h); none without them
EXT_CODES = {name: code for name, (code, _, _) in EXT.formats().items()} if EXT is not None else {}
# The AMX copy is the VNNI copy with the interleaved kernel's 16-row chunks on AMX tiles
# (csrc/cpu/amx_impl.h): the same bits, faster or not at prefill widths by machine, so the planner
# measures which runs (models/quant_plan.py, choose_tiles).
TILES, VECTOR = "avx512amx", "avx512vnni"


def forced_name() -> str | None:
    """The copy SPECENGINE_ISA names, unchecked; None when unset."""
    return os.environ.get(FORCE_ENV) or None


def forced_isa() -> str | None:
    """The copy SPECENGINE_ISA names (e.g. `avx2` on an AVX-512 machine: the AVX2 copy's speed, end to
    end), set for this process; None when unset. Called as an engine loads, before anything is
    measured: the machine table files each copy's measurements under its own key (machine.py), and
    the planner leaves a forced copy alone (quant_plan.choose_tiles)."""
    name = forced_name()
    if name is None:
        return None
    offered = EXT.isas() if EXT is not None else []
    if name not in offered:
        raise SpecEngineError(f"{FORCE_ENV}={name!r}: the compiled kernels here offer "
                              + (", ".join(offered) if offered else "nothing (not built)"), FORCE_ENV)
    EXT.set_isa(name)
    return name


def has(name: str) -> bool:
    """Whether the built module has the Python function `name` (an older build may lack newer ones)."""
    return EXT is not None and hasattr(EXT, name)


def op(name: str):
    """The dispatcher op `specengine::name` this build registered, or None."""
    if EXT is None:
        return None
    try:
        return getattr(torch.ops.specengine, name).default
    except (AttributeError, RuntimeError):
        return None


if op("add_rms_norm") is not None:
    @torch.library.register_fake("specengine::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("specengine::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("specengine::rope_kv_write")
    def _(qkv, cos, sin, wpos, k_cache, v_cache, num_heads, num_kv_heads, q_norm, k_norm, eps):
        B, T, width = qkv.shape
        return qkv.new_empty(B, T, num_heads, width // (num_heads + 2 * num_kv_heads))

if op("row_attention") is not None:
    @torch.library.register_fake("specengine::row_attention")
    def _(q, k, v, lens, tree, scale, window):
        return torch.empty_like(q, memory_format=torch.contiguous_format)
