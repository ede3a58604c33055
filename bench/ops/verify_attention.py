"""Verification attention microbenchmark with a provider axis.

providers: torch reference, triton, SDPA (chain: causal-equivalent mask over the same Q;
tree: explicit mask), flash-attn (chain only, if installed). Shapes: B x Q x context for the
heads of Qwen2.5-1.5B (12 q / 2 kv, d 128) and Llama-2-7B (32 / 32, d 128).
"""
import pytest
import torch
from baselines import binary_tree_mask, sdpa
from conftest import device, timed

from specengine.kernels import verify_attention_ref

HEADS = {"qwen2.5-1.5b": (12, 2, 128), "llama-2-7b": (32, 32, 128)}


def provider_fn(name):
    if name == "torch":
        return verify_attention_ref
    if name == "sdpa":
        return sdpa
    if name == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available():
            pytest.skip("triton timings need a GPU")
        from specengine.kernels.verify_attention import verify_attention
        return verify_attention
    if name == "flash":
        flash = pytest.importorskip("flash_attn")

        def fa(q, k, v, lens, tree_mask=None):
            if tree_mask is not None:
                pytest.skip("flash-attn has no tree mask")
            return flash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)
        return fa
    raise ValueError(name)


@pytest.mark.parametrize("provider", ["torch", "triton", "sdpa", "flash"])
@pytest.mark.parametrize("model", list(HEADS))
@pytest.mark.parametrize("ctx", [512, 4096, 32768])
@pytest.mark.parametrize("Q", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("mask", ["chain", "tree"])
def test_verify_attention(benchmark, provider, model, ctx, Q, B, mask):
    dev = device()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    Hq, Hkv, D = HEADS[model]
    if dev == "cpu" and (ctx > 4096 or B > 4):
        pytest.skip("CPU: small shapes only")
    fn = provider_fn(provider)
    S = ctx + Q
    q = torch.randn(B, Q, Hq, D, device=dev, dtype=dtype)
    k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    tree = binary_tree_mask(Q, dev) if mask == "tree" else None
    nbytes = 2 * B * S * Hkv * D * k.element_size() + 2 * q.numel() * q.element_size()
    benchmark.extra_info.update(provider=provider, model=model, ctx=ctx, Q=Q, B=B, mask=mask)
    timed(benchmark, lambda: fn(q, k, v, lens, tree), nbytes)
