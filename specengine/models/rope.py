"""Rotary position embedding tables (theta and scaling from the HF config)."""
from __future__ import annotations

import torch


def _default_inv_freq(theta: float, head_dim: int, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_inv_freq(hf_config, head_dim: int, device=None, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor, exactly as transformers computes them.
    layer_type: for configs with RoPE parameters per layer type (Gemma 3's "sliding_attention"
    / "full_attention"), whose; default the full-attention layers'."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):  # one set per layer type
        layer_type = layer_type or "full_attention"
        params = params.get(layer_type) or {}
        if params.get("rope_type", "default") == "default":
            return _default_inv_freq(params.get("rope_theta", 10000.0), head_dim, device), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, device, layer_type=layer_type)
        return inv, float(factor)
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", 10000.0)
        return _default_inv_freq(theta, head_dim, device), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        from ..errors import SpecEngineError
        raise SpecEngineError(f"unsupported rope scaling type {rope_type!r}")
    inv, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)
    return inv, float(factor)


def rope_tables(hf_config, head_dim: int, max_len: int, device=None,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_len, head_dim] in fp32, indexed by absolute position."""
    inv, factor = rope_inv_freq(hf_config, head_dim, device, layer_type)
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :].float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * factor, emb.sin() * factor
