"""Find and load checkpoints: registry names, HF directories (sharded safetensors too), the
local HF hub cache, or a GGUF file (converted once). Never downloads from a hub."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from . import fetch
from .config import ModelConfig
from ..errors import SpecEngineError
from .decoder import Transformer, merged_homes


def resolve(name_or_path: str | Path) -> Path:
    """Map a user's model reference to a local HF directory."""
    ref = str(name_or_path)
    if ref in fetch.REGISTRY:
        return fetch.fetch(ref)
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
        out = fetch.cache_dir() / "models" / f"{path.stem}-{digest}"
        return out if (out / "config.json").exists() else fetch.convert_gguf(path, out, weights=False)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpecEngineError(f"{path} has no config.json; not a Hugging Face model directory")
        return path
    if path.exists():
        raise SpecEngineError(f"{path} is neither a model directory nor a .gguf file")
    return _from_hub_cache(ref)


def _from_hub_cache(repo_id: str) -> Path:
    if repo_id.count("/") != 1:
        raise SpecEngineError(
            f"model not found: {repo_id!r} is not a directory, a .gguf file, a registry model "
            f"({', '.join(fetch.REGISTRY)}) or a hub id")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # any failure here means: not in the local cache
        raise SpecEngineError(
            f"model {repo_id!r} is not in the local Hugging Face cache (specengine never downloads "
            f"from a hub): {type(e).__name__}") from None


def load_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig

    try:
        return ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    except (OSError, KeyError) as e:
        raise SpecEngineError(f"cannot read the config in {path}: {e}") from None


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecEngineError(f"no *.safetensors weights in {path}")
    return files


WEIGHTS = ("float", "gguf")


CHUNK_BYTES = 512 << 20  # a safetensors file is opened (mapped) for about this many bytes of tensors at a time


def _chunks(f: Path) -> list[list[str]]:
    """The file's tensor names in runs of at most ~CHUNK_BYTES, in file order."""
    import json
    import struct

    with open(f, "rb") as fh:
        header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    entries = sorted(((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__"))
    out, size = [[]], 0
    for (lo, hi), key in entries:
        if out[-1] and size + hi - lo > CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(key)
        size += hi - lo
    return out


def load_model(name_or_path, dtype=torch.float32, device="cpu", weights: str = "float") -> tuple[Transformer, Path]:
    """Build our decoder and load its weights; returns (model, resolved directory).
    weights="gguf": keep a GGUF file's quantized tensors as blocks (models/gguf_weights.py);
    `dtype` is then the activation dtype."""
    from safetensors import safe_open

    if weights not in WEIGHTS:
        raise SpecEngineError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHTS)} (or auto)", "weights")
    path = resolve(name_or_path)
    cfg = load_config(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    if weights == "gguf":
        return _load_gguf(model, name_or_path, dtype, device), path
    fetch.ensure_float_weights(path)  # a GGUF's directory gets its dequantized weights on first need
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    homes = merged_homes(model)  # q/k/v and gate/up parts: copied into their merged tensor's rows
    state, filled = {}, {}
    for f in _weight_files(path):
        for keys in _chunks(f):
            # each tensor copied into memory of its own, the file opened per chunk: a tensor left
            # on the file's mapping keeps the whole mapping (every weight's pages) resident until
            # the last one goes, so a weight later repacked (cpu_matmul) would be held twice
            with safe_open(f, framework="pt", device="cpu") as sf:
                for key in keys:
                    t, name = sf.get_tensor(key), key.removeprefix("model.")
                    if name not in homes:
                        state[name] = t.to(dtype) if t.dtype != dtype else t.clone()
                        continue
                    merged, start, rows = homes[name]
                    if tuple(t.shape) != (rows, *shapes[merged][1:]):
                        raise SpecEngineError(f"{key} in {f} has shape {tuple(t.shape)}; this architecture "
                                              f"expects {(rows, *shapes[merged][1:])}")
                    if merged not in state:
                        state[merged] = torch.empty(shapes[merged], dtype=dtype)
                    state[merged][start:start + rows].copy_(t)  # converts the dtype as it copies
                    filled[merged] = filled.get(merged, 0) + rows
    partial = sorted(k for k, rows in filled.items() if rows != shapes[k][0])
    if partial:
        raise SpecEngineError(f"checkpoint in {path} lacks parts of {len(partial)} merged projections, e.g. {partial[:3]}")
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if cfg.gemma:  # Gemma's norms scale by (1 + w): held as that, so every norm is one RMSNorm
        state = {k: v + 1 if k.endswith("norm.weight") else v for k, v in state.items()}
    expected = {k for k in shapes if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        raise SpecEngineError(f"checkpoint in {path} lacks {len(missing)} weights, e.g. {missing[:3]}")
    unexpected = sorted(k for k in state.keys() - expected if "rotary_emb" not in k)
    if unexpected:
        raise SpecEngineError(f"checkpoint in {path} has weights this architecture does not use, e.g. {unexpected[:3]}")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device).eval().requires_grad_(False), path


def _load_gguf(model: Transformer, name_or_path, dtype, device) -> Transformer:
    from .gguf_weights import gguf_file, load_quantized

    file = gguf_file(name_or_path)
    if file is None:
        raise SpecEngineError(f"weights='gguf' needs a .gguf file or a registry model; {name_or_path!r} is "
                              f"neither (use weights='float')", "weights")
    model = load_quantized(model, file, dtype)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise SpecEngineError(f"{file.name} lacks {len(left)} tensors this architecture needs, e.g. {left[:3]}")
    model = model.to(device).eval().requires_grad_(False)
    if torch.device(device).type == "cpu":  # the layout the kernel reads faster here, measured once per machine
        from .quant_plan import choose_layouts

        choose_layouts(model)
    return model


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SpecEngineError(f"cannot load a tokenizer from {path}: {e}") from None
