"""Matmul with GGUF-quantized weights: y = x @ dequantize(W).T, W kept as its blocks.

A quantized weight is a uint8 tensor [N, row_bytes]: each of its N rows is the row's GGUF
blocks back to back (llama.cpp's layout, as read from the file). Formats (values per block,
bytes per block): Q4_0 (32, 18), Q4_1 (32, 20), Q5_0 (32, 22), Q8_0 (32, 34), Q4_K (256, 144), Q5_K (256,
176), Q6_K (256, 210). The torch dequantizers below are the specification (ggml-quants.c's
`dequantize_row_*`, the same float operations in the same order) and the CPU fallback; they
are checked against the `gguf` package's dequantizer on every tensor of the real files. The
CPU kernel (csrc/quant_matmul.cpp) dequantizes each weight row once into L1 and multiplies it
with every activation row, so a verify of k rows reads the weights once.
"""
from __future__ import annotations

import torch

QK_K = 256
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
           "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` values in `qtype` (cols must fill whole blocks)."""
    values, nbytes = FORMATS[qtype]
    if cols % values:
        raise ValueError(f"{qtype} rows hold whole blocks of {values} values; {cols} is not a multiple")
    return cols // values * nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [..., 1] fp32 (a block's fp16 scale)."""
    return b.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., n] bytes -> [..., count, 8n / count]: bit i of every byte, i = 0..count-1 (little endian)."""
    shifts = torch.arange(count, device=b.device, dtype=torch.uint8)[:, None]
    return (b[..., None, :] >> shifts) & 1


def _scale_min(s: torch.Tensor):
    """Q4_K / Q5_K: 12 packed bytes -> (scale [..., 8], min [..., 8]), 6 bits each."""
    s = s.to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return sc.float(), mn.float()


def _q4_0(b):
    qs = b[..., 2:]
    return _f16(b[..., :2]) * (torch.cat([qs & 15, qs >> 4], -1).float() - 8)


def _q4_1(b):
    qs = b[..., 4:]
    return _f16(b[..., :2]) * torch.cat([qs & 15, qs >> 4], -1).float() + _f16(b[..., 2:4])


def _q5_0(b):
    qs, high = b[..., 6:], _bits(b[..., 2:6], 8).transpose(-1, -2).reshape(*b.shape[:-1], 32)
    q = torch.cat([qs & 15, qs >> 4], -1) | (high << 4)
    return _f16(b[..., :2]) * (q.float() - 16)


def _q8_0(b):
    return _f16(b[..., :2]) * b[..., 2:].view(torch.int8).float()


def _k_lows(qs):
    """Q4_K / Q5_K: 128 bytes -> [..., 8, 32] 4-bit values (chunk c: sub-blocks 2c and 2c + 1)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([q & 15, q >> 4], -2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b):
    sc, mn = _scale_min(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    y = (d * sc)[..., None] * _k_lows(b[..., 16:]).float() - (dmin * mn)[..., None]
    return y.reshape(*b.shape[:-1], QK_K)


def _q5_k(b):
    sc, mn = _scale_min(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _k_lows(b[..., 48:]) | (_bits(b[..., 16:48], 8) << 4)
    y = (d * sc)[..., None] * q.float() - (dmin * mn)[..., None]
    return y.reshape(*b.shape[:-1], QK_K)


def _q6_k(b):
    lead = b.shape[:-1]
    ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    lo = ql.reshape(*lead, 2, 1, 64)
    lo = torch.cat([lo & 15, lo >> 4], -2).reshape(*lead, 8, 32)
    hi = ((qh.reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                         device=b.device)[:, None]) & 3).reshape(*lead, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int32) - 32).float().reshape(*lead, 16, 16)
    return ((d * sc.view(torch.int8).float())[..., None] * q).reshape(*lead, QK_K)


_DEQUANT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize_ref(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [N, row_bytes] -> fp32 [N, cols]."""
    if qtype not in FORMATS:
        raise ValueError(f"unsupported GGUF block format {qtype!r}; supported: {', '.join(FORMATS)}")
    values, nbytes = FORMATS[qtype]
    N, width = qweight.shape
    if width % nbytes:
        raise ValueError(f"{qtype} rows are whole blocks of {nbytes} bytes; got rows of {width} bytes")
    blocks = qweight.reshape(N, width // nbytes, nbytes)
    return _DEQUANT[qtype](blocks).reshape(N, width // nbytes * values)


def quant_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [..., K] (any float dtype) @ dequantize(qweight [N, row_bytes]).T -> [..., N] in fp32."""
    return x.float() @ dequantize_ref(qweight, qtype).T


def quantize_rows_ref(x: torch.Tensor, block: int):
    """Activations as the CPU kernel reads them: x [M, K] fp32 -> int8 values [M, K] and a scale per
    block [M, K / block] (amax / 127; values rounded half to even, |q| <= 127). The kernel takes these
    exact values: the same float operations."""
    M, K = x.shape
    xb = x.float().reshape(M, K // block, block)
    amax = xb.abs().amax(-1)
    iscale = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * iscale[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(M, K), amax / 127


def quant_matmul_q8_ref(x: torch.Tensor, qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """What the CPU kernel computes for decode and verify widths (as llama.cpp does): the activations
    quantized per block of the weight's format (`quantize_rows_ref`), times the dequantized weights.
    Summed in fp64 here; the kernel sums integer products exactly and scales them in fp32."""
    x2 = x.float().reshape(-1, x.shape[-1])
    block = FORMATS[qtype][0]
    q, d = quantize_rows_ref(x2, block)
    xq = (q.double().reshape(*d.shape, block) * d.double()[..., None]).reshape(x2.shape)
    return (xq @ dequantize_ref(qweight, qtype).double().T).float().reshape(*x.shape[:-1], -1)
