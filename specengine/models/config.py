"""Model configuration read from a Hugging Face `config.json` (through transformers)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecEngineError

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    qk_norm: bool = False  # Qwen3: each q and k head RMS-normed before RoPE
    hf_config: object = field(repr=False, default=None)  # kept for RoPE scaling helpers
    # set when the vocabulary was padded to a target's (models/vocab.py): the ids the model was
    # trained on, the only ones it may emit
    trained_vocab_size: int | None = None

    @property
    def own_vocab_size(self) -> int:
        """The vocabulary the checkpoint has (before any padding)."""
        return self.trained_vocab_size or self.vocab_size

    @classmethod
    def from_hf(cls, cfg) -> "ModelConfig":
        if cfg.model_type not in SUPPORTED:
            raise SpecEngineError(
                f"unsupported model type {cfg.model_type!r}; supported: {', '.join(SUPPORTED)}")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise SpecEngineError(f"unsupported activation {cfg.hidden_act!r} (only SwiGLU/silu)")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise SpecEngineError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        window = getattr(cfg, "sliding_window", None)
        if cfg.model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
            window = None
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            # Qwen2 always has q/k/v bias; Llama/Mistral only with attention_bias.
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 1 << 20),
            sliding_window=window,
            qk_norm=cfg.model_type == "qwen3",
            hf_config=cfg,
        )
