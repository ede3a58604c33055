"""Fused rejection sampling microbenchmark: torch reference vs Triton (provider axis).

Bytes counted: target logits [B,K+1,V] fp32 and draft probs [B,K,V] fp32, read once each
(the memory roofline of the op). Reports µs and achieved GB/s (and fraction of peak on GPU).
"""
import pytest
import torch
from conftest import device, timed

from specengine.kernels import rejection_sample_ref


@pytest.mark.parametrize("provider", ["torch", "triton"])
@pytest.mark.parametrize("V", [32000, 151936])
@pytest.mark.parametrize("K", [4, 8])
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rejection_sampling(benchmark, provider, V, K, B, temperature):
    dev = device()
    if provider == "triton":
        pytest.importorskip("triton")
        if dev != "cuda":
            pytest.skip("triton timings need a GPU")
        from specengine.kernels.rejection_sampling import rejection_sample as fn
    else:
        fn = rejection_sample_ref
    logits = torch.randn(B, K + 1, V, device=dev)
    q = torch.softmax(torch.randn(B, K, V, device=dev), -1)
    drafts = torch.multinomial(q.view(-1, V), 1).view(B, K)
    num_draft = torch.full((B,), K, dtype=torch.int32, device=dev)
    temp = torch.full((B,), temperature, device=dev)
    seed = torch.zeros(B, dtype=torch.int64, device=dev)
    offset = torch.zeros((), dtype=torch.int64, device=dev)
    nbytes = logits.numel() * 4 + q.numel() * 4
    benchmark.extra_info.update(provider=provider, V=V, K=K, B=B, temperature=temperature)
    timed(benchmark, lambda: fn(logits, drafts, q, num_draft, temp, seed, offset), nbytes)
