"""ParallelSpec's parallel drafter (arXiv 2410.05589): k draft tokens from one forward.

The draft model reads [its unseen committed tokens, MASK_1 .. MASK_{k-1}]: the last real
token's logits propose token 1 as usual, MASK_i's logits propose token i+1. What is added to
the draft is small and only acts on the mask positions:
  - k_max - 1 learned mask embeddings (the input at MASK_i),
  - LoRA adapters (rank r) on the attention and MLP projections, applied to mask rows only.
Real tokens therefore run exactly the plain draft (same logits, same K/V), so the drafter
shares the draft's cache with `sd`, and a mask's K/V, written past the committed length,
is discarded by the length rollback like any rejected draft token.

Both inference and training express "which token sees which" as a tree mask over the new
tokens (the verify_attention contract): position ids follow from it (a node's depth), so a
mask sits right after the last real token it sees, whatever the row's layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .acceptance_head import model_fingerprint
from .artifacts import read_metadata, save_artifact, shipped
from ..errors import SpecEngineError

DRAFTERS_DIR = Path(__file__).parent / "drafters"
# the draft's projections that get adapters (merged ones adapt each of their parts:
# q/k/v and gate/up, so files keep one update per checkpoint projection)
LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class DrafterMeta:
    hidden_size: int
    vocab_size: int
    fingerprint: str
    k_max: int
    rank: int
    draft: str = ""


class _RowFlags:
    """Which rows of the current forward are masks ([B,T,1] float), shared by the adapters."""
    value: torch.Tensor | None = None


class LoRAPart(nn.Module):
    """The low-rank update B(A(x)) of one checkpoint projection (q_proj, gate_proj, ...)."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.lora_a = nn.Parameter(torch.randn(rank, in_features) / in_features ** 0.5)
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))  # starts as the plain draft

    def delta(self, x):
        return F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))


class MaskedLoRA(nn.Module):
    """base(x) + flags * B(A(x)) * scale: a low-rank update on mask rows only. Over a merged
    projection (qkv, gate_up) each part has its own update, on its own slice of the output."""

    def __init__(self, base: nn.Module, rank: int, flags: _RowFlags, name: str, alpha: float = 16.0):
        super().__init__()
        self.base, self.flags, self.scale = base, flags, alpha / rank
        parts = getattr(base, "parts", ()) or ((name, base.out_features),)
        self.parts = nn.ModuleDict({part: LoRAPart(base.in_features, rows, rank) for part, rows in parts})

    def forward(self, x):
        y = self.base(x)
        f = self.flags.value
        if f is None:
            return y
        delta = torch.cat([part.delta(x) for part in self.parts.values()], dim=-1)
        return y + f.to(y.dtype) * (delta * self.scale)


class ParallelDrafter(nn.Module):
    """Mask embeddings + mask-row LoRA around a draft `Transformer` (installed in place)."""

    def __init__(self, draft, meta: DrafterMeta):
        super().__init__()
        self.meta, self.flags = meta, _RowFlags()
        self.mask_embed = nn.Parameter(torch.randn(meta.k_max - 1, meta.hidden_size) * 0.02)
        self.adapters = nn.ModuleDict()
        for i, layer in enumerate(draft.layers):
            for parent in (layer.self_attn, layer.mlp):
                for name in LORA_TARGETS:
                    if hasattr(parent, name) and not isinstance(getattr(parent, name), MaskedLoRA):
                        lora = MaskedLoRA(getattr(parent, name), meta.rank, self.flags, name)
                        setattr(parent, name, lora)
                        for part, update in lora.parts.items():  # keyed by checkpoint projection
                            self.adapters[f"{i}_{part}"] = update
        self.draft = [draft]  # not a submodule: its weights are not part of the drafter's state

    @property
    def model(self):
        return self.draft[0]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        out = {"mask_embed": self.mask_embed}
        for key, lora in self.adapters.items():
            out[f"{key}.lora_a"], out[f"{key}.lora_b"] = lora.lora_a, lora.lora_b
        return out

    def embed(self, tokens: torch.Tensor, mask_index: torch.Tensor) -> torch.Tensor:
        """Token embeddings, with MASK_i's embedding where mask_index = i >= 1 (0 = real)."""
        x = self.model.embed_tokens(tokens)
        table = torch.cat([torch.zeros_like(self.mask_embed[:1]), self.mask_embed.to(x.dtype)])
        return torch.where((mask_index > 0)[..., None], table[mask_index.clamp(max=self.meta.k_max - 1)], x)

    def forward(self, tokens, mask_index, cache, ops, tree_mask, attn_len=None):
        """Logits [B,T,V] of a forward whose mask rows (mask_index > 0) use the adapters."""
        self.flags.value = (mask_index > 0)[..., None].float()
        try:
            return self.model(tokens, cache, ops, tree_mask=tree_mask, attn_len=attn_len,
                              inputs_embeds=self.embed(tokens, mask_index))
        finally:
            self.flags.value = None

    def check_fits(self, config) -> None:
        fits(self.meta, config)

    def save(self, path, extra: dict | None = None) -> Path:
        return save_artifact(path, self.trainable_state(), self.meta, extra)

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        state = self.trainable_state()
        if set(tensors) != set(state):
            raise SpecEngineError(f"drafter file holds {sorted(set(tensors) ^ set(state))[:4]}… that do not match")
        with torch.no_grad():
            for k, v in tensors.items():
                if v.shape != state[k].shape:
                    raise SpecEngineError(f"drafter tensor {k} has shape {tuple(v.shape)}, expected "
                                          f"{tuple(state[k].shape)}")
                state[k].copy_(v)


def fits(meta: DrafterMeta, config) -> None:
    """Refuse a drafter trained for another draft (before it wraps any layer)."""
    m = meta
    if (m.hidden_size, m.vocab_size) != (config.hidden_size, config.own_vocab_size) or \
            m.fingerprint != model_fingerprint(config):
        raise SpecEngineError(
            f"parallel drafter was trained for another draft ({m.draft or 'unnamed'}, fingerprint {m.fingerprint}); "
            f"this draft: {model_fingerprint(config)}; train one with `specengine train-parallel`")


def read_meta(path) -> DrafterMeta:
    raw = read_metadata(path, "parallel drafter")
    try:
        return DrafterMeta(int(raw["hidden_size"]), int(raw["vocab_size"]), raw["fingerprint"], int(raw["k_max"]),
                           int(raw["rank"]), raw.get("draft", ""))
    except (ValueError, KeyError) as e:
        raise SpecEngineError(f"{path} is not a parallel drafter file ({type(e).__name__}: {e})") from None


def shipped_drafter(config) -> Path | None:
    """The drafter shipped for this draft (matched by fingerprint), if any."""
    return shipped(DRAFTERS_DIR, fingerprint=model_fingerprint(config))


def load_drafter(path, draft) -> ParallelDrafter:
    from safetensors.torch import load_file

    meta = read_meta(path)
    fits(meta, draft.config)
    drafter = ParallelDrafter(draft, meta)
    drafter.load_trainable(load_file(str(path)))
    return drafter.to(draft.device, draft.dtype)  # a GGUF-block draft: its activations' dtype
