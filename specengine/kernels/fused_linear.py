"""A few-row linear fused with the step before it: one launch where a decode step had two or three.

    linear:       y = x @ W.T (+ b)
    norm_linear:  s = x + residual; y = rmsnorm(s) * w_norm @ W.T (+ b)     -> (y, s)
    silu_linear:  y = (silu(gate) * up) @ W.T                              with [gate | up] = x

A 0.5B draft step on a GPU is ~290 launches of a few microseconds (docs/design.md, "GPU run"):
its matrices are too small for the launch to hide. Fused, a Llama layer is six launches (norm +
qkv, RoPE + KV write, attention (+ its merge), o, norm + gate/up, silu-mul + down) where it was
nine plus cuBLAS's split-K reduce.

The kernel serves rows <= BLOCK_M (16, the tensor-core minimum; a decode's one row is padded):
one program per BLOCK_N weight rows walks K in BK columns, builds the activation tile in
registers from its inputs (for the norm, its fp32 statistics in a first pass over the row) and
accumulates in fp32 (IEEE for fp32 inputs, no TF32). The rows beside a row (how many, what they
hold) change none of its sums; whether its place in the tile does is the GPU's dot's business (the
interpreter's numpy matmul moves a bit), so batch-invariant mode does not lean on it. The first
program also writes the new residual s.

Roundings: the input is `add_rms_norm_ref`'s / `silu_and_mul_ref`'s (kernels/add_rms_norm.py,
silu_and_mul.py), the product F.linear's (an fp32 sum and bias, rounded once); the sums' order is
the kernel's. The `*_ref` functions below compose those references: the spec. Whether a forward
runs the fused layer program on these is the ops table's `gemv` choice (kernels/ops.py: "triton";
its reference is the unfused program); "auto" keeps cuBLAS until a GPU measures this kernel.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .add_rms_norm import add_rms_norm_ref
from .jit import needs_triton, rms_scaled, silu_mul, tl, triton
from .silu_and_mul import silu_and_mul_ref

BLOCK_M = 16  # the widest input the kernel takes; wider steps (prefill) keep the unfused path
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NONE, NORM, SILU = 0, 1, 2  # the PRO constexpr: what is built before the product


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def norm_linear_ref(x, residual, norm_weight, eps, weight, bias=None):
    """(linear(add_rms_norm(x, residual)), the new residual)."""
    h, s = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), s


def silu_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul_ref(gate_up), weight)


# (BLOCK_N, BK) that compile without spills on sm_80 and sm_90 for every prologue (make compile-check):
# fp32's IEEE product runs on the FMA units and holds more per thread
SPILL_FREE = {"fp32": {(16, 64)}, "half": {(16, 64), (32, 64), (32, 128), (64, 64)}}


def _configs():
    if _INTERPRET:  # one config, few programs: the interpreter runs every program in numpy
        return [triton.Config({"BLOCK_N": 64, "BK": 64}, num_warps=4)]
    return [triton.Config({"BLOCK_N": n, "BK": k}, num_warps=4, num_stages=4)
            for n, k in sorted(SPILL_FREE["fp32"] | SPILL_FREE["half"])]


def kept(configs, fp32: bool):
    """The configs that compile without spills for this dtype (all of them under the interpreter)."""
    table = SPILL_FREE["fp32" if fp32 else "half"]
    return [c for c in configs if _INTERPRET or (c.kwargs["BLOCK_N"], c.kwargs["BK"]) in table]


def _prune(configs, named_args, **kwargs):
    return kept(configs, named_args["x_ptr"].dtype == torch.float32)


@triton.jit
def _input_tile(x_ptr, r_ptr, nw_ptr, ms, ks, ok, inv, K, s_xm, s_rm, PRO: tl.constexpr, HAS_RES: tl.constexpr):
    """The activation tile [BLOCK_M, BK] at rows ms, columns ks, in the input dtype."""
    x = tl.load(x_ptr + ms * s_xm + ks, mask=ok, other=0.0)
    if PRO == 1:
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + ms * s_rm + ks, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        x = rms_scaled(x, inv, tl.load(nw_ptr + ks, mask=ks < K, other=0.0)).to(x.dtype)
    elif PRO == 2:  # x holds [gate | up]; the up half starts K columns on
        x = silu_mul(x, tl.load(x_ptr + ms * s_xm + K + ks, mask=ok, other=0.0)).to(x.dtype)
    return x


# tuned in the runner's warm-up, before any capture; Triton adds the dtypes to the key
@triton.autotune(configs=_configs(), key=["N", "K", "PRO"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fused_linear_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, s_ptr, M, N, K, eps,
                         s_xm, s_rm, s_wn, s_ym, s_sm,
                         PRO: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    ms = tl.arange(0, BLOCK_M)[:, None]
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N))[:, None].to(tl.int64)
    inv = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if PRO == 1:  # the norm's statistics: fp32 sum of squares of s = x (+ residual), rounded as stored
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = (k0 + tl.arange(0, BK))[None, :]
            ok = (ms < M) & (ks < K)
            x = tl.load(x_ptr + ms * s_xm + ks, mask=ok, other=0.0)
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(r_ptr + ms * s_rm + ks, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
                if pid == 0:  # the first program writes the new residual stream
                    tl.store(s_ptr + ms * s_sm + ks, x, mask=ok)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
        inv = (1.0 / tl.sqrt(ss / K + eps))[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = (k0 + tl.arange(0, BK))[None, :]
        a = _input_tile(x_ptr, r_ptr, nw_ptr, ms, ks, (ms < M) & (ks < K), inv, K, s_xm, s_rm, PRO, HAS_RES)
        w = tl.load(w_ptr + rows * s_wn + ks, mask=(rows < N) & (ks < K), other=0.0)
        if IEEE:  # fp32 inputs, or 16-bit ones under the interpreter (its 16-bit tl.dot is not the GPU's)
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    ns = (pid * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + ms * s_ym + ns, acc.to(y_ptr.dtype.element_ty), mask=(ms < M) & (ns < N))


def fits(rows: int) -> bool:
    """Whether a step of `rows` activation rows takes the kernel (wider: the unfused path)."""
    return rows <= BLOCK_M


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x2, weight, bias, pro, K, residual=None, norm_weight=None, eps=0.0, s=None):
    M, N = x2.shape[0], weight.shape[0]
    if M > BLOCK_M:
        raise ValueError(f"the fused linear takes at most {BLOCK_M} rows, got {M} (wider steps take the unfused path)")
    if weight.shape[1] != K or weight.stride(-1) != 1:
        raise ValueError(f"the fused linear wants a row-major [N, {K}] weight, got {tuple(weight.shape)}")
    y = torch.empty(M, N, dtype=torch.promote_types(x2.dtype, weight.dtype), device=x2.device)
    r = x2 if residual is None else residual
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _fused_linear_kernel[grid](
        x2, r, x2 if norm_weight is None else norm_weight, weight, weight if bias is None else bias, y,
        x2 if s is None else s, M, N, K, eps, x2.stride(0), r.stride(0), weight.stride(0), y.stride(0),
        x2.stride(0) if s is None else s.stride(0),
        PRO=pro, HAS_RES=residual is not None, HAS_BIAS=bias is not None, IEEE=x2.dtype == torch.float32 or _INTERPRET,
        BLOCK_M=BLOCK_M)
    return y


@needs_triton
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] -> [..., N]."""
    K = x.shape[-1]
    return _launch(_rows(x, K), weight, bias, NONE, K).view(*x.shape[:-1], weight.shape[0])


@needs_triton
def norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    """(y [..., N], s [..., K]): add_rms_norm then the linear, one launch."""
    K = x.shape[-1]
    x2 = _rows(x, K)
    if residual is None:  # no add: the residual out is x itself, as add_rms_norm returns it
        r2, s = None, x2
    else:
        r2, s = _rows(residual, K), torch.empty_like(x2)
    y = _launch(x2, weight, bias, NORM, K, r2, norm_weight, eps, None if residual is None else s)
    return y.view(*x.shape[:-1], weight.shape[0]), s.view(x.shape)


@needs_triton
def silu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., N]: silu_and_mul then the linear, one launch."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_linear wants an even last dim (gate | up), got {gate_up.shape[-1]}")
    I = gate_up.shape[-1] // 2
    return _launch(_rows(gate_up, 2 * I), weight, None, SILU, I).view(*gate_up.shape[:-1], weight.shape[0])
