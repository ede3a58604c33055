"""Load a GGUF file with its weights kept as blocks (models/quant_linear.py): the file's
quantized tensors become QuantLinear / QuantEmbedding layers at their GGUF size, its float
tensors (norms, biases) load in the activation dtype. The architecture comes from the HF
directory the file converts to once (models/fetch.py), so config and tokenizer are the ones
the float path uses; only the weights differ.

Names: llama.cpp's (`blk.N.attn_q`, ...) onto ours; q/k/v and gate/up merge into one layer
(a segment per part when their formats differ). llama.cpp stores a llama-architecture q/k
with the rows of each head interleaved for its RoPE; they are put back in HF order, which is
a permutation of whole rows, so it applies to the blocks as they are.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SpecEngineError
from ..kernels.quant_matmul import FORMATS
from . import fetch
from .decoder import Linear, Transformer
from .quant_linear import QuantEmbedding, QuantLinear

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_output": "self_attn.o_proj", "ffn_down": "mlp.down_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # the last two: Qwen3
# Gemma 3's sandwich norms (llama.cpp stores Gemma norms as 1 + w: what our layers hold)
GEMMA_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
MERGED = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "mlp.gate_up_proj": ("ffn_gate", "ffn_up")}


def gguf_file(name_or_path) -> Path | None:
    """The GGUF file behind a model reference (a registry name or a .gguf path), else None."""
    ref = str(name_or_path)
    if ref in fetch.REGISTRY:
        fetch.fetch(ref)  # downloads and converts once; the GGUF stays in the cache
        return fetch.cache_dir() / "gguf" / f"{ref}.gguf"
    path = Path(ref).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def tensor_index(path: Path) -> dict:
    """{"arch", "tensors": {name: [format, numpy dtype, shape, byte offset]}} of a GGUF file, as the
    `gguf` package's GGUFReader would report them (tests compare the two), read by `_read_index`
    (~0.1 s: GGUFReader makes a numpy view of every metadata string first, the tokenizer's 151k
    of them: ~7 s per Qwen2.5 file on 2 cores) and kept beside the cache, keyed by the file's
    size and mtime."""
    import json

    st = path.stat()
    where = fetch.cache_dir() / "gguf_index" / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}.json"
    if where.exists():
        return json.loads(where.read_text())
    index = _read_index(path)
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = where.with_suffix(".partial")
    tmp.write_text(json.dumps(index))
    tmp.replace(where)
    return index


# GGUF metadata value types (gguf's GGUFValueType): fixed widths; 8 is a string, 9 an array
_WIDTH = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}


def _read_index(path: Path) -> dict:
    """The GGUF header walked with struct (the GGUF spec: magic, version, counts, key/values,
    tensor infos, aligned data): only the architecture, the alignment and the tensor table kept.
    Why long: one walk of the file in its own order, the spec's sections one after the other."""
    import mmap
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values = {GGMLQuantizationType.F32: "<f4", GGMLQuantizationType.F16: "<f2", GGMLQuantizationType.F64: "<f8",
              GGMLQuantizationType.I8: "|i1", GGMLQuantizationType.I16: "<i2", GGMLQuantizationType.I32: "<i4",
              GGMLQuantizationType.I64: "<i8"}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as b:
        if b[:4] != b"GGUF":
            raise SpecEngineError(f"{path} is not a GGUF file (no GGUF magic)", "weights")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", b, 4)
        if version not in (2, 3):
            raise SpecEngineError(f"{path} is GGUF version {version}; versions 2 and 3 are read", "weights")
        pos, meta = 24, {}

        def string(pos):
            (n,) = struct.unpack_from("<Q", b, pos)
            return b[pos + 8: pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

        def skip(pos, vtype):  # past one value, without decoding it
            if vtype in _WIDTH:
                return pos + _WIDTH[vtype]
            if vtype == 8:
                return pos + 8 + struct.unpack_from("<Q", b, pos)[0]
            if vtype != 9:
                raise SpecEngineError(f"{path}: metadata value type {vtype} is not in the GGUF spec", "weights")
            etype, count = struct.unpack_from("<IQ", b, pos)
            pos += 12
            if etype in _WIDTH:
                return pos + count * _WIDTH[etype]
            for _ in range(count):
                pos = skip(pos, etype)
            return pos

        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", b, pos)
            if key == "general.architecture" and vtype == 8:
                meta[key], _ = string(pos + 4)
            elif key == "general.alignment" and vtype == 4:
                meta[key] = struct.unpack_from("<I", b, pos + 4)[0]
            pos = skip(pos + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", b, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", b, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", b, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(ggml_type), offset))
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, dims, kind, offset in infos:
        shape = list(reversed(dims))
        if kind not in values:  # blocks: bytes per row, as GGUFReader shapes them
            block, size = GGML_QUANT_SIZES[kind]
            shape[-1] = shape[-1] // block * size
        tensors[name] = [kind.name, np.dtype(values.get(kind, "|u1")).str, shape, start + offset]
    return {"arch": meta.get("general.architecture", "?"), "tensors": tensors}


class _Tensors:
    """The file's tensors by name: (format name, data as a torch tensor [rows, row bytes or values]).

    The data are views of the file's copy-on-write mapping, not copies: most are repacked or held in
    2 MiB pages next, and a copy first cost every load of the default pair ~7 s of fresh-page faults
    on the 2-vCPU EPYC VM (a warm load in 4 KiB pages 18 -> 10 s). A write into one changes this
    process's page only, never the file."""

    def __init__(self, path: Path):
        import numpy as np

        index = tensor_index(path)
        self.file, self.arch, self.by_name = path.name, index["arch"], index["tensors"]
        self._bytes = np.memmap(path, dtype=np.uint8, mode="c")

    def __contains__(self, name):
        return name in self.by_name

    def _array(self, name: str):
        import numpy as np

        _, dtype, shape, offset = self.by_name[name]
        dt = np.dtype(dtype)
        count = int(np.prod(shape)) if shape else 1
        return self._bytes[offset: offset + count * dt.itemsize].view(dt).reshape(shape)

    def get(self, name: str):
        if name not in self.by_name:
            raise SpecEngineError(f"{self.file} ({self.arch}) has no tensor {name!r}, which this architecture needs")
        kind = self.by_name[name][0]
        data = torch.from_numpy(self._array(name))
        if kind in ("F32", "F16", "BF16"):
            return kind, data
        if kind not in FORMATS:
            raise SpecEngineError(f"{name} is stored as {kind}, a GGUF format specengine does not run quantized "
                                  f"(supported: {', '.join(FORMATS)}); load it with weights='float'", "weights")
        return kind, data.reshape(data.shape[0], -1)


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's RoPE row interleave of a q/k weight undone (rows: [heads * head_dim, ...])."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def load_quantized(model: Transformer, path: Path, dtype: torch.dtype) -> Transformer:
    """Fill `model` (built on the meta device) from the GGUF file at `path`: quantized layers
    for its block tensors, `dtype` (the activation dtype) for the rest."""
    src, cfg = _Tensors(path), model.config
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}

    def tensor(name, part=None):
        kind, data = src.get(name)
        if src.arch == "llama" and part in heads:
            data = _unpermute(data, heads[part])
        return kind, data

    def linear(names: list[str], parts: tuple = ()) -> QuantLinear:
        got = [tensor(n + ".weight", n.rsplit(".", 1)[-1]) for n in names]
        segments = []
        for kind, data in got:
            if kind not in FORMATS:
                raise SpecEngineError(f"{names[0]} is a float tensor in a quantized layer; load with weights='float'")
            if segments and segments[-1][0] == kind:  # same format: one segment, rows stacked
                segments[-1] = (kind, torch.cat([segments[-1][1], data]))
            else:
                segments.append((kind, data))
        biases = [n + ".bias" for n in names]
        bias = torch.cat([_bias(src, b, names[0]) for b in biases]) if biases[0] in src else None
        return QuantLinear(segments, None if bias is None else bias.to(dtype), parts)

    kind, emb = src.get("token_embd.weight")
    if kind not in FORMATS:
        raise SpecEngineError("token_embd is a float tensor in this file; load it with weights='float'", "weights")
    model.embed_tokens = QuantEmbedding(kind, emb, cfg.hidden_size, dtype)
    # a tied LM head shares the embedding's blocks (the file has no `output`)
    model.lm_head = linear(["output"]) if "output.weight" in src else QuantLinear([(kind, emb)])
    model.norm.weight = torch.nn.Parameter(src.get("output_norm.weight")[1].to(dtype), requires_grad=False)
    for i, layer in enumerate(model.layers):
        blk = f"blk.{i}."
        for ours, parts in MERGED.items():
            owner, attr = ours.split(".")
            old = getattr(getattr(layer, owner), attr)
            setattr(getattr(layer, owner), attr, linear([blk + p for p in parts], old.parts))
        for theirs, ours in (GEMMA_NAMES if cfg.gemma else LAYER_NAMES).items():
            owner, attr = ours.rsplit(".", 1) if "." in ours else (None, ours)
            target = getattr(layer, owner) if owner else layer
            if not hasattr(target, attr):  # a tensor this architecture does not have (q/k norm)
                continue
            if isinstance(getattr(target, attr), Linear):
                setattr(target, attr, linear([blk + theirs]))
            else:
                getattr(target, attr).weight = torch.nn.Parameter(src.get(blk + theirs + ".weight")[1].to(dtype),
                                                                  requires_grad=False)
    return model


def _bias(src: _Tensors, name: str, layer: str) -> torch.Tensor:
    if name not in src:
        raise SpecEngineError(f"{layer}: some merged parts have a bias and some do not")
    return src.get(name)[1].float()
