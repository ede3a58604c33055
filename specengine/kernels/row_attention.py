"""The compiled per-row CPU attention (csrc/cpu/attention_impl.h) under `verify_attention_ref`'s
contract (kernels/verify_attention.py), and the ops table's "cpu" attention built on it:
batch-invariant mode's attention on a CPU, and every CPU decode and verify step's."""
from __future__ import annotations

import torch

from . import cpu_ext
from .verify_attention import verify_attention_ref

_EXT = cpu_ext.EXT if cpu_ext.has("row_attention") else None
_ROW_OP = cpu_ext.op("row_attention")  # the dispatcher op: traced (graph stand-ins, torch.compile), not baked
if _ROW_OP is None and _EXT is not None:  # an older build: the Python function
    _ROW_OP = _EXT.row_attention


def verify_attention_rows(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, window=None):
    """`verify_attention_ref`'s contract on CPU, batch-invariant by construction (the compiled
    extension, csrc/cpu/attention_impl.h): each query's softmax runs over exactly the positions it
    sees, in position order, in fp32, so its result depends neither on the other queries of the
    call nor on how much of the cache is passed (a window: only its positions are read)."""
    if _EXT is None:
        raise RuntimeError("verify_attention_rows needs the compiled extension (make install builds it)")
    scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache))
    window = None if window is None else window.to(torch.int32).contiguous()
    return _ROW_OP(q, k_cache, v_cache, cache_lens.to(torch.int32).contiguous(), tree_mask, scale, window)


ROW_ATTENTION_WIDTH = 16  # query tokens per row up to which the "cpu" attention is the per-row one


def attention_cpu(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, window=None):
    """The ops table's "cpu" attention: `verify_attention_rows` at decode and verify widths (up to
    ROW_ATTENTION_WIDTH tokens per row: no masks to build, ~3x the reference's speed there, and
    batch-invariant), the torch reference above them (prefill: its SDPA is the faster one)."""
    fn = verify_attention_rows if q.shape[1] <= ROW_ATTENTION_WIDTH else verify_attention_ref
    return fn(q, k_cache, v_cache, cache_lens, tree_mask, sm_scale, window)
