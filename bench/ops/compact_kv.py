"""compact_kv microbenchmark: compiled extension vs torch fallback (provider axis).

Cache shapes of Qwen2.5-1.5B (28 layers, 2 KV heads, d 128) and Llama-2-7B (32 layers,
32 KV heads, d 128), bf16, batch 4, 4096 positions; count accepted positions per row moved
from a scattered tree path into contiguous slots. Bytes = read + write of the moved K/V.
Runs on CPU (the C++ path) and on GPU (the CUDA kernel).
"""
import pytest
import torch
from conftest import timed

from specengine.runtime.kv_compact import compact_kv, extension_available

SHAPES = {"qwen2.5-1.5b": (28, 2, 128), "llama-2-7b": (32, 32, 128)}


@pytest.mark.parametrize("provider", ["ext", "torch"])
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("count", [1, 4, 8, 16])
def test_compact_kv(benchmark, provider, model, count):
    if provider == "ext" and not extension_available():
        pytest.skip("extension not built")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L, H, D = SHAPES[model]
    B, S = 4, 4096
    kv = torch.zeros(L, 2, B, S, H, D, dtype=torch.bfloat16, device=dev)
    base = 3000
    src = (base + torch.arange(count, device=dev) * 2)[None].expand(B, count).contiguous()  # every other slot
    dst = torch.full((B,), base, dtype=torch.int32, device=dev)
    cnt = torch.full((B,), count, dtype=torch.int32, device=dev)
    nbytes = 2 * L * 2 * B * count * H * D * kv.element_size()
    benchmark.extra_info.update(provider=provider, model=model, count=count, B=B, device=dev)
    timed(benchmark, lambda: compact_kv(kv, src, dst, cnt, backend=provider, check=False), nbytes)
