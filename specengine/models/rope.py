"""Rotary position embedding tables (theta and scaling from the HF config)."""
from __future__ import annotations

import torch


def rope_inv_freq(hf_config, head_dim: int, device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor, exactly as transformers computes them."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        from ..errors import SpecEngineError
        raise SpecEngineError(f"unsupported rope scaling type {rope_type!r}")
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)
    return inv, float(factor)


def rope_tables(hf_config, head_dim: int, max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] in fp32, indexed by absolute position."""
    inv, factor = rope_inv_freq(hf_config, head_dim, device)
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :].float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * factor, emb.sin() * factor
