"""Matmul with GGUF-quantized weights: y = x @ dequantize(W).T, W kept as its blocks.

A quantized weight is a uint8 tensor [N, row_bytes]: each of its N rows is the row's GGUF
blocks back to back (llama.cpp's layout, as read from the file). Formats (values per block,
bytes per block): Q4_0 (32, 18), Q4_1 (32, 20), Q5_0 (32, 22), Q8_0 (32, 34), Q4_K (256, 144), Q5_K (256,
176), Q6_K (256, 210). The torch dequantizers below are the specification (ggml-quants.c's
`dequantize_row_*`, the same float operations in the same order) and the CPU fallback; they
are checked against the `gguf` package's dequantizer on every tensor of the real files. The
CPU kernel (csrc/quant_matmul.cpp) quantizes the activations per block to int8 and multiplies
them with each weight block as integers, as llama.cpp does (`quant_matmul_q8_ref` is its spec),
so a verify of k rows reads the weights once.

On a GPU (`quant_matmul_triton`, Q4_K / Q6_K / Q5_0 / Q8_0: what the default pair's files hold):
one program per tile of BLOCK_N weight rows and BLOCK_M activation rows (a decode's single row
padded to BLOCK_M, the tensor-core minimum) walks K in chunks of BK columns; each column's bytes,
shift and scale are gathered per element (any chunk of any format), dequantized in registers with
the reference's float operations, and multiplied on tensor cores in the activations' dtype (fp32:
IEEE, no TF32), accumulated in fp32. No host sync, fixed shapes: CUDA graphs capture it.
"""
from __future__ import annotations

import torch

from .jit import needs_triton, tl, triton

QK_K = 256
FORMATS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
           "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random `qtype` blocks whose fp16 scales are a small finite value (random
    bytes could be inf / NaN). What a kernel's speed depends on is the bytes: for timing, not numerics."""
    values, nbytes = FORMATS[qtype]
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (rows, cols // values, nbytes), generator=g, dtype=torch.uint8)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,)):  # d (and dmin)
        b[..., at:at + 2] = torch.full((rows, cols // values, 1), 0.01).half().view(torch.uint8)
    return b.reshape(rows, -1).contiguous()


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


# ----------------------------------------------------------------------------- GPU kernel
CODES = {"Q8_0": 0, "Q5_0": 1, "Q4_K": 2, "Q6_K": 3}  # the FMT constexpr of the kernel


@triton.jit
def _f16_at(ptr, ok):
    """The little-endian fp16 at byte pointers `ptr` (any shape; 0 where not `ok`), as fp32."""
    lo = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(w_ptr, rows, cols, row_bytes, ok, FMT: tl.constexpr):
    """fp32 [BLOCK_N, BK] values of weight rows `rows` [BLOCK_N, 1] at columns `cols` [1, BK]."""
    if FMT == 0:  # Q8_0: 34 bytes per 32: d, 32 int8
        b = w_ptr + rows * row_bytes + (cols // 32) * 34
        q = tl.load(b + 2 + cols % 32, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _f16_at(b, ok) * q
    elif FMT == 1:  # Q5_0: 22 bytes per 32: d, 32 fifth bits, 16 bytes of nibbles
        b = w_ptr + rows * row_bytes + (cols // 32) * 22
        l = cols % 32
        byte = tl.load(b + 6 + l % 16, mask=ok, other=0).to(tl.int32)
        nib = tl.where(l < 16, byte & 15, byte >> 4)
        high = (tl.load(b + 2 + l // 8, mask=ok, other=0).to(tl.int32) >> (l % 8)) & 1
        return _f16_at(b, ok) * ((nib | (high << 4)) - 16).to(tl.float32)
    elif FMT == 2:  # Q4_K: 144 bytes per 256: d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
        b = w_ptr + rows * row_bytes + (cols // 256) * 144
        v = cols % 256
        j = v // 32  # sub-block: chunk c = v // 64 holds sub-blocks 2c (low nibbles) and 2c + 1 (high)
        byte = tl.load(b + 16 + 32 * (v // 64) + v % 32, mask=ok, other=0).to(tl.int32)
        q = (byte >> (4 * (j % 2))) & 15
        bj = tl.load(b + 4 + j, mask=ok, other=0).to(tl.int32)
        bj4 = tl.load(b + 8 + j, mask=ok, other=0).to(tl.int32)
        bjm4 = tl.load(b + 4 + tl.where(j >= 4, j - 4, 0), mask=ok, other=0).to(tl.int32)
        sc = tl.where(j < 4, bj & 63, (bj4 & 15) | ((bjm4 >> 6) << 4))
        mn = tl.where(j < 4, bj4 & 63, (bj4 >> 4) | ((bj >> 6) << 4))
        d = _f16_at(b, ok)
        dmin = _f16_at(b + 2, ok)
        return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    else:  # Q6_K: 210 bytes per 256: 128 low nibbles, 64 of 2 high bits, 16 int8 scales, d
        b = w_ptr + rows * row_bytes + (cols // 256) * 210
        v = cols % 256
        h = v // 128
        k = (v % 128) // 32
        l = v % 32
        lo = (tl.load(b + 64 * h + 32 * (k % 2) + l, mask=ok, other=0).to(tl.int32) >> (4 * (k // 2))) & 15
        hi = (tl.load(b + 128 + 32 * h + l, mask=ok, other=0).to(tl.int32) >> (2 * k)) & 3
        sc = tl.load(b + 192 + v // 16, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16_at(b + 208, ok) * sc) * ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, s_xm, s_ym, FMT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None].to(tl.int64)
    ms = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = (k0 + tl.arange(0, BK))[None, :]
        x = tl.load(x_ptr + ms * s_xm + cols, mask=(ms < M) & (cols < K), other=0.0)
        w = _dequant_tile(w_ptr, rows, cols, row_bytes, (rows < N) & (cols < K), FMT)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w).to(x.dtype), acc)
    ns = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    tl.store(y_ptr + ms * s_ym + ns, acc, mask=(ms < M) & (ns < N))


# spill-free on sm_80 and sm_90 in every format and dtype (make compile-check); speed not yet measured
BLOCK_M, BLOCK_N, BK, NUM_WARPS = 16, 32, 64, 8


@needs_triton
def quant_matmul_triton(x2: torch.Tensor, qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """fp32 [M, N] = x2 [M, K] (fp32 / fp16 / bf16) @ dequantize(qweight [N, row_bytes]).T."""
    if qtype not in CODES:
        raise ValueError(f"the GPU kernel reads {', '.join(CODES)} blocks; {qtype!r} is not one of them")
    values, nbytes = FORMATS[qtype]
    M, K = x2.shape
    N, row_bytes = qweight.shape
    if K % values or row_bytes != K // values * nbytes:
        raise ValueError(f"x has {K} columns but a weight row holds {row_bytes} bytes of {qtype} blocks")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(M, N, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
    _quant_matmul_kernel[grid](x2, qweight, y, M, N, K, row_bytes, x2.stride(0), y.stride(0), FMT=CODES[qtype],
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BK=BK, IEEE=x2.dtype == torch.float32,
                               num_warps=NUM_WARPS)
    return y
