"""SpecDec++'s acceptance prediction head (Huang et al. 2024, arXiv 2405.19715).

A small residual MLP on the draft's final hidden state at the position that produces a
draft token; it returns the logit of P(the target accepts that token). The `specdec++`
policy (methods/policies.py) stops drafting once P(at least one rejection so far) =
1 - prod P(accept_i) exceeds a threshold. The head only chooses how many tokens to
propose, so decoding stays lossless whatever it predicts.

A head file is a safetensors file whose metadata names what it fits: the draft's hidden
size, vocabulary and a fingerprint of its config, the decoding mode it was trained for,
and how it was trained (the data recipe and provenance live in a sidecar JSON).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .artifacts import save_artifact, shipped
from ..errors import SpecEngineError

HEADS_DIR = Path(__file__).parent / "heads"


def model_fingerprint(config) -> str:
    """A short hash of what makes two drafts interchangeable for a head (shapes, vocab, rope)."""
    hf = config.hf_config
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rope_theta", "tie_word_embeddings")
    blob = json.dumps({k: getattr(hf, k, None) for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class HeadMeta:
    hidden_size: int
    vocab_size: int
    fingerprint: str
    mode: str  # "greedy" | "sampled": the decoding mode the labels were made for
    n_blocks: int
    draft: str = ""  # the draft's name, for people reading the file


class AcceptanceHead(nn.Module):
    """x -> x + SiLU(W_i x) for each block, then a linear layer to one logit."""

    def __init__(self, meta: HeadMeta):
        super().__init__()
        self.meta = meta
        h = meta.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(meta.n_blocks))
        self.out = nn.Linear(h, 1)
        for blk in self.blocks:  # start close to the identity: a residual block adds little
            nn.init.normal_(blk.weight, std=0.02 / h ** 0.5)
            nn.init.zeros_(blk.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(self.out.weight.dtype)
        for blk in self.blocks:
            x = x + F.silu(blk(x))
        return self.out(x).squeeze(-1).float()

    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.forward(hidden))

    def check_fits(self, draft_config) -> None:
        """A clear error when this head was trained for another draft."""
        m = self.meta
        vocab = draft_config.own_vocab_size  # a draft padded to a target's vocabulary keeps its heads
        if m.hidden_size != draft_config.hidden_size or m.vocab_size != vocab:
            raise SpecEngineError(
                f"acceptance head does not fit the draft: head hidden/vocab {m.hidden_size}/{m.vocab_size}, "
                f"draft {draft_config.hidden_size}/{vocab}; train one with `specengine train-head`")
        fp = model_fingerprint(draft_config)
        if m.fingerprint != fp:
            raise SpecEngineError(
                f"acceptance head was trained for another draft model (fingerprint {m.fingerprint}, "
                f"{m.draft or 'unnamed'}; this draft: {fp}); train one with `specengine train-head`")

    def save(self, path, extra: dict | None = None) -> Path:
        return save_artifact(path, self.state_dict(), self.meta, extra)


def load_head(path, device=None) -> AcceptanceHead:
    """Load a head file, with a clear error for a missing, foreign or damaged file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise SpecEngineError(f"acceptance head file not found: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            raw = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise SpecEngineError(f"{path} is not a readable safetensors head file ({e})") from None
    try:
        meta = HeadMeta(hidden_size=int(raw["hidden_size"]), vocab_size=int(raw["vocab_size"]),
                        fingerprint=raw["fingerprint"], mode=raw["mode"], n_blocks=int(raw["n_blocks"]),
                        draft=raw.get("draft", ""))
    except (KeyError, ValueError) as e:
        raise SpecEngineError(f"{path} is not an acceptance head (metadata missing {e})") from None
    head = AcceptanceHead(meta)
    try:
        head.load_state_dict(tensors)
    except RuntimeError as e:
        raise SpecEngineError(f"{path}: weights do not match the head's metadata ({str(e).splitlines()[0]})") from None
    return head.to(device).eval() if device is not None else head.eval()


def default_head_path(draft_config, mode: str) -> Path | None:
    """The head shipped for this draft (matched by fingerprint) and mode, if any."""
    return shipped(HEADS_DIR, fingerprint=model_fingerprint(draft_config), mode=mode)
