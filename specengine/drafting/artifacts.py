"""Trained add-ons for a draft (SpecDec++ heads, ParallelSpec drafters) as safetensors files.

Each file carries its description as safetensors metadata (strings): what draft it fits
(hidden size, vocabulary, config fingerprint) and how it was made. The shipped ones sit in
`specengine/drafting/heads/` and `specengine/drafting/drafters/` and are found by matching
that metadata.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import SpecEngineError


def save_artifact(path, tensors: dict[str, torch.Tensor], meta, extra: dict | None = None) -> Path:
    """Write `tensors` with the dataclass `meta` (and a JSON `extra`) as metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {k: str(v) for k, v in asdict(meta).items()} | {"extra": json.dumps(extra or {})}
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def read_metadata(path, what: str) -> dict[str, str]:
    """The metadata of a safetensors file, from its header only (no tensor is read)."""
    path = Path(path)
    if not path.is_file():
        raise SpecEngineError(f"{what} file not found: {path}")
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return json.loads(f.read(n)).get("__metadata__") or {}
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise SpecEngineError(f"{path} is not a {what} file ({type(e).__name__}: {e})") from None


def shipped(directory: Path, **match: str) -> Path | None:
    """The first shipped file in `directory` whose metadata has every `match` value."""
    for path in sorted(directory.glob("*.safetensors")):
        meta = read_metadata(path, "shipped")
        if all(meta.get(k) == v for k, v in match.items()):
            return path
    return None
