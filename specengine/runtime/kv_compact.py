"""KV-cache compaction after tree verification: move the accepted path's K/V into
contiguous slots, every layer, K and V, in one call (docs/design.md, "Kernel contracts").

`compact_kv` runs the compiled extension `specengine._kvext` (C++ on CPU, CUDA kernel on
GPU: one launch, no allocation, no host sync) when it was built, else the torch fallback
`compact_kv_ref` (index ops: the specification). Chain rollback never needs either: it is
only lowering `cache.lens`.
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError

try:
    from .. import _kvext
except ImportError:  # not built here: the torch fallback serves
    _kvext = None

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_POSITIONS = 256


def extension_available() -> bool:
    return _kvext is not None


def compact_kv_ref(kv_buffer, src_pos, dst_start, count) -> None:
    """Gather-then-scatter with torch index ops (no host sync).

    Unused slots i >= count[b] gather and rewrite their own value at (dst_start[b] + i) % S,
    a position no used slot writes, so one index_put_ does every row at once.
    """
    B, N = src_pos.shape
    S = kv_buffer.shape[3]
    i = torch.arange(N, device=src_pos.device)[None, :]
    used = i < count.to(torch.int64)[:, None]
    dst = dst_start.to(torch.int64)[:, None] + i
    used &= (src_pos >= 0) & (src_pos < S) & (dst >= 0) & (dst < S)
    spare = dst % S
    src = torch.where(used, src_pos, spare)
    dst = torch.where(used, dst, spare)
    rows = torch.arange(B, device=src_pos.device)[:, None].expand(B, N)
    gathered = kv_buffer[:, :, rows, src]  # [L,2,B,N,H,D], a copy: overlap-safe
    kv_buffer[:, :, rows, dst] = gathered


def _validate(kv_buffer, src_pos, dst_start, count, check_values: bool) -> None:
    if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.dim() != 6 or kv_buffer.shape[1] != 2:
        raise SpecEngineError("kv_buffer must be a tensor [layers, 2, batch, max_seq_len, kv_heads, head_dim]")
    if kv_buffer.dtype not in KV_DTYPES:
        raise SpecEngineError(f"kv_buffer dtype must be float32, float16 or bfloat16, got {kv_buffer.dtype}")
    B, S = kv_buffer.shape[2], kv_buffer.shape[3]
    if src_pos.dtype != torch.int64 or src_pos.dim() != 2 or src_pos.shape[0] != B:
        raise SpecEngineError(f"src_pos must be int64 [batch={B}, N], got {src_pos.dtype} {tuple(src_pos.shape)}")
    if src_pos.shape[1] > MAX_POSITIONS:
        raise SpecEngineError(f"src_pos holds at most {MAX_POSITIONS} positions per row, got {src_pos.shape[1]}")
    for name, t in (("dst_start", dst_start), ("count", count)):
        if t.dtype != torch.int32 or t.shape != (B,):
            raise SpecEngineError(f"{name} must be int32 [batch={B}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("src_pos", src_pos), ("dst_start", dst_start), ("count", count)):
        if t.device != kv_buffer.device:
            raise SpecEngineError(f"{name} is on {t.device} but kv_buffer is on {kv_buffer.device}")
    if check_values:  # one host sync: for callers that cannot vouch for their indices
        N = src_pos.shape[1]
        c = count.to(torch.int64)
        used = torch.arange(N, device=src_pos.device)[None, :] < c[:, None]
        bad_src = used & ((src_pos < 0) | (src_pos >= S))
        problems = torch.stack([((c < 0) | (c > N)).any(), bad_src.any(),
                                ((c > 0) & ((dst_start < 0) | (dst_start.to(torch.int64) + c > S))).any()]).tolist()
        if problems[0]:
            raise SpecEngineError(f"count must be in [0, {N}] (the width of src_pos)")
        if problems[1]:
            raise SpecEngineError(f"src_pos has a used position outside [0, {S})")
        if problems[2]:
            raise SpecEngineError(f"dst_start + count runs outside [0, {S}]")


def compact_kv(kv_buffer, src_pos, dst_start, count, backend: str = "auto", check: bool = True) -> None:
    """In place: kv[:, :, b, dst_start[b] + i] = kv[:, :, b, src_pos[b, i]] for i < count[b].

    backend: "auto" (extension if built, else torch) | "ext" | "torch". check=True validates
    index values at the cost of one host sync; the engine passes check=False on its hot path
    (its indices are valid by construction, and the kernels never write out of range anyway).
    """
    _validate(kv_buffer, src_pos, dst_start, count, check)
    if backend not in ("auto", "ext", "torch"):
        raise SpecEngineError(f"unknown compact_kv backend {backend!r}; choose auto, ext or torch")
    if backend == "ext" and _kvext is None:
        raise SpecEngineError("the compiled KV extension is not built (see README: building the extension)")
    if backend == "torch" or _kvext is None or (backend == "auto" and not kv_buffer.is_contiguous()):
        compact_kv_ref(kv_buffer, src_pos, dst_start, count)  # auto: the extension needs a whole buffer
        return
    if kv_buffer.is_cuda and not _kvext.built_with_cuda():
        raise SpecEngineError("the KV extension was built without CUDA; use backend='torch'")
    if not kv_buffer.is_contiguous():
        raise SpecEngineError("kv_buffer must be contiguous for the extension")
    _kvext.compact_kv(kv_buffer, src_pos.contiguous(), dst_start, count)

