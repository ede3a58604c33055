"""Random inputs shared by the fused step's op tests (the Triton kernels' and the compiled CPU
ops'): seeded tensors, and a RoPE + KV-write case whose row 1 runs off the cache's end
(clamped writes) and whose tree nodes rotate at their depth."""
import torch


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def rope_case(B, T, Hq, Hkv, D, S, dtype, tree: bool, seed=0, device="cpu", rope_dtype=torch.float32):
    """(qkv [B,T,(Hq+2Hkv)D] in dtype, cos, sin [B,T,D] in rope_dtype, write positions [B,T])."""
    from transformers import LlamaConfig

    from specengine.models.rope import rope_tables

    cfg = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=Hkv)
    cos_t, sin_t = rope_tables(cfg, D, S, device)
    qkv = rand(B, T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=seed, device=device)
    lens = torch.tensor([3, S - 2, 0][:B], device=device)  # row 1 runs off the end: clamped writes
    wpos = (lens[:, None] + torch.arange(T, device=device)).clamp(max=S - 1)
    rope_pos = wpos
    if tree:  # tree nodes rotate at their depth, not their slot
        depth = torch.tensor([0, 1, 1, 2, 2, 3][:T], device=device)
        rope_pos = (lens[:, None] + depth).clamp(max=S - 1)
    return qkv, cos_t[rope_pos].to(rope_dtype), sin_t[rope_pos].to(rope_dtype), wpos


def qk_norm_weights(D, dtype, device="cpu"):
    """(q weight, k weight, eps) that differ per dim and between q and k."""
    return (1 + rand(D, dtype=dtype, seed=5, device=device) * 0.3,
            1 + rand(D, dtype=dtype, seed=6, device=device) * 0.3, 1e-6)
