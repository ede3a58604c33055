"""The fused step's ops, and the few-row linears fused with them: torch reference vs `torch.compile`
of the reference vs our Triton kernel vs our compiled CPU op (provider axis; "cpu" on CPU only), at
the decode (1 token) and verify (8 tokens) shapes of the Qwen2.5 0.5B / 1.5B / 7B models, bf16.
Bytes counted: what each op must read and write once (its memory roofline). `make bench-kernels`
runs it with the other kernel benchmarks.
"""
import pytest
import torch
from conftest import device, timed

from specengine.kernels import cpu_ext
from specengine.kernels.add_rms_norm import add_rms_norm_ref
from specengine.kernels.rope_kv_write import rope_kv_write_ref
from specengine.kernels.silu_and_mul import silu_and_mul_ref

# (hidden, intermediate, q heads, kv heads, head_dim) of the real shapes
SHAPES = {"0.5B": (896, 4864, 14, 2, 64), "1.5B": (1536, 8960, 12, 2, 128), "7B": (3584, 18944, 28, 4, 128)}
PROVIDERS = ["torch", "torch.compile", "triton", "cpu"]
CONTEXT = 4096


def pick(provider, ref, kernel_module, kernel_name):
    if provider == "torch":
        return ref
    if provider == "torch.compile":
        return torch.compile(ref, dynamic=False)
    module = __import__(f"specengine.kernels.{kernel_module}", fromlist=[kernel_name])
    if provider == "cpu":
        if torch.cuda.is_available() or not cpu_ext.has(kernel_module):
            pytest.skip("the compiled CPU op runs on CPU tensors, where the extension is built")
        return getattr(module, f"{kernel_module}_cpu")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("triton timings need a GPU")
    return getattr(module, kernel_name)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8])
def test_add_rms_norm(benchmark, provider, model, tokens):
    dev, (H, *_) = device(), SHAPES[model]
    x, r = (torch.randn(1, tokens, H, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(H, device=dev, dtype=torch.bfloat16)
    fn = pick(provider, add_rms_norm_ref, "add_rms_norm", "add_rms_norm")
    benchmark.extra_info.update(provider=provider, model=model, tokens=tokens, op="add_rms_norm")
    timed(benchmark, lambda: fn(x, r, w, 1e-6), 4 * x.numel() * 2 + H * 2)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8])
def test_silu_and_mul(benchmark, provider, model, tokens):
    dev, (_, inter, *_) = device(), SHAPES[model]
    gu = torch.randn(1, tokens, 2 * inter, device=dev, dtype=torch.bfloat16)
    fn = pick(provider, silu_and_mul_ref, "silu_and_mul", "silu_and_mul")
    benchmark.extra_info.update(provider=provider, model=model, tokens=tokens, op="silu_and_mul")
    timed(benchmark, lambda: fn(gu), gu.numel() * 2 * 3 // 2)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8])
def test_rope_kv_write(benchmark, provider, model, tokens):
    dev, (_, _, hq, hkv, d) = device(), SHAPES[model]
    qkv = torch.randn(1, tokens, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(1, CONTEXT, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(1, tokens, d, device=dev) for _ in range(2))
    wpos = torch.arange(100, 100 + tokens, device=dev)[None]
    if provider != "triton":  # the reference's roundings: cos/sin in the model dtype (cast once per step)
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
    op = pick(provider, rope_kv_write_ref, "rope_kv_write", "rope_kv_write")
    fn = lambda: op(qkv, cos, sin, wpos, k_cache, v_cache, hq, hkv)  # noqa: E731
    benchmark.extra_info.update(provider=provider, model=model, tokens=tokens, op="rope_kv_write")
    timed(benchmark, fn, qkv.numel() * 2 * 2)


# the linears of a layer (and the LM head) as the fused few-row kernel takes them: (op, N, K) per model
LINEARS = {"qkv": lambda H, I, hq, hkv, d: ("norm", (hq + 2 * hkv) * d, H),
           "gate_up": lambda H, I, *_: ("norm", 2 * I, H),
           "down": lambda H, I, *_: ("silu", H, I),
           "lm_head": lambda H, *_: ("norm", 151936, H)}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("linear", list(LINEARS))
@pytest.mark.parametrize("tokens", [1, 8])
def test_fused_linear(benchmark, provider, model, linear, tokens):
    """add + RMSNorm + linear (qkv, gate_up, the LM head) or silu-mul + linear (down): the reference
    composition (cuBLAS for the product) against the fused few-row kernel (`gemv`). Bytes: the weight."""
    from specengine.kernels import fused_linear as fl

    dev, shape = device(), SHAPES[model]
    kind, N, K = LINEARS[linear](*shape)
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
    if kind == "norm":
        x, r = (torch.randn(tokens, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.ones(K, device=dev, dtype=torch.bfloat16)
        op = pick(provider, fl.norm_linear_ref, "fused_linear", "norm_linear")
        fn = lambda: op(x, r, nw, 1e-6, W)  # noqa: E731
    else:
        gu = torch.randn(tokens, 2 * K, device=dev, dtype=torch.bfloat16)
        op = pick(provider, fl.silu_linear_ref, "fused_linear", "silu_linear")
        fn = lambda: op(gu, W)  # noqa: E731
    benchmark.extra_info.update(provider=provider, model=model, tokens=tokens, op=f"fused_linear:{linear}")
    timed(benchmark, fn, W.numel() * 2)
