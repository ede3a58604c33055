"""Model configuration read from a Hugging Face `config.json` (through transformers)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecEngineError

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    qk_norm: bool = False  # Qwen3, Gemma 3: each q and k head RMS-normed before RoPE
    # Gemma 3: its MLP activation, sandwich norms, scaled embeddings, attention scale, and a
    # sliding window (with its own RoPE base) per local layer; None / False elsewhere
    act: str = "silu"
    gemma: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    layer_windows: tuple = ()  # per layer: its sliding window in tokens, or None (global)
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
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise SpecEngineError(f"unsupported activation {act!r} (SwiGLU or GeGLU with tanh gelu)")
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, cap, None):
                raise SpecEngineError(f"{cap} ({cfg.model_type}) is not supported")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise SpecEngineError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        window = getattr(cfg, "sliding_window", None)
        if cfg.model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
            window = None
        gemma = cfg.model_type == "gemma3_text"
        layer_windows = ()
        if window is not None:  # local layers read only their window; global ones everything
            types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers  # Mistral: all
            layer_windows = tuple(window if t == "sliding_attention" else None for t in types)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            # Qwen2 always has q/k/v bias; Llama/Mistral/Qwen3/Gemma 3 only with attention_bias.
            qkv_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 1 << 20),
            sliding_window=window,  # every windowed layer's; which layers: layer_windows
            qk_norm=cfg.model_type in ("qwen3", "gemma3_text"),
            act=ACTIVATIONS[act],
            gemma=gemma,
            embed_scale=cfg.hidden_size ** 0.5 if gemma else None,
            attn_scale=cfg.query_pre_attn_scalar ** -0.5 if gemma else None,
            layer_windows=layer_windows,
            hf_config=cfg,
        )
