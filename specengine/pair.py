"""Load an engine's (target, draft) pair: devices, weights (float or GGUF blocks) and each
model's dtype for its role (precision.py), as `Engine.from_pretrained` asks."""
from __future__ import annotations

import warnings

import torch

from . import draft_requant, huge_pages, precision
from .kernels import cpu_ext
from .config import EngineConfig
from .errors import SpecEngineError
from .models.decoder import Transformer
from .models import requant
from .models.loading import load_config, load_model, load_tokenizer, resolve


NO_CPU_KERNELS = ("specengine: the compiled CPU kernels (specengine._quantext) are not built in this install, "
                  "so every CPU op runs its torch reference and GGUF blocks are dequantized at every matmul "
                  "(far slower). Rebuild them with a C++ compiler and torch importable at build time: "
                  "pip install --no-build-isolation -e . (or make install)")


def device_of(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecEngineError(f"device {device!r} requested but CUDA is not available", "device")
    return dev


def gguf_twin(name, cfg: EngineConfig, device):
    """The model as GGUF blocks (fp32 activations) when weights "auto" may choose them: a CPU
    model whose source is a GGUF file (a registry name or a .gguf path); else None."""
    from .models.gguf_weights import gguf_file

    if name is None or cfg.weights != "auto" or device.type != "cpu" or gguf_file(name) is None:
        return None
    return load_model(name, torch.float32, device, weights="gguf")[0]


def load_pair(target, draft, cfg: EngineConfig):
    """(target model, its path, draft model or None, dtype decision or None). dtype "auto":
    bf16 on CUDA; on a CPU each model's setting for its role in the engine's method, from the
    measured matmul table (precision.py): fp32 or bf16, or with weights "auto" and a GGUF
    source also the file's blocks, unless SPECENGINE_CPU_DTYPE forces a dtype."""
    cpu_ext.forced_isa()  # before any measurement: they are filed per kernel copy
    huge_pages.enable(cfg.huge_pages)  # and per page size (machine.key): set before the weights load
    dev = device_of(cfg.device)
    ddev = dev if cfg.draft_device is None else device_of(cfg.draft_device)
    if cpu_ext.EXT is None and "cpu" in (dev.type, ddev.type):
        warnings.warn(NO_CPU_KERNELS, RuntimeWarning, stacklevel=3)
    dtype = cfg.torch_dtype()
    if cfg.weights == "gguf":  # blocks as stored; dtype is the activations' (fp32 unless asked)
        act = dtype or torch.float32
        tmodel, tpath = load_model(target, act, dev, weights="gguf")
        dmodel = load_model(draft, act, ddev, weights="gguf")[0] if draft is not None else None
        return tmodel, tpath, dmodel, {"target": precision.GGUF, "draft": precision.GGUF if dmodel is not None else None,
                                       "activations": str(act).removeprefix("torch."), "method": cfg.method,
                                       "why": "weights='gguf'"}
    if dtype is not None:
        tmodel, tpath = load_model(target, dtype, dev)
        return tmodel, tpath, load_model(draft, dtype, ddev)[0] if draft is not None else None, None
    method = cfg.method or ("sd" if draft is not None else "ar")
    on_cpu = [d.type == "cpu" for d in (dev, ddev)]
    force = precision.forced_cpu_dtype()
    if force is None and all(on_cpu):
        chosen = _choose_before_loading(target, draft, cfg, method, dev)
        if chosen is not None:
            return chosen
    first = {True: torch.float32 if force is None else getattr(torch, force), False: torch.bfloat16}
    tmodel, tpath = load_model(target, first[on_cpu[0]], dev)
    dmodel = load_model(draft, first[on_cpu[1]], ddev)[0] if draft is not None else None
    if not on_cpu[0] and (dmodel is None or not on_cpu[1]):
        return tmodel, tpath, dmodel, {"target": "bfloat16", "draft": "bfloat16" if dmodel is not None else None,
                                       "method": method, "why": "cuda"}
    if force is not None:
        return tmodel, tpath, dmodel, precision.forced(force, dmodel is not None, method)
    cpu_draft = dmodel if on_cpu[1] else None
    if on_cpu[0]:
        quant = {"target": gguf_twin(target, cfg, dev), "draft": gguf_twin(draft if on_cpu[1] else None, cfg, ddev)}
        choice = precision.choose(tmodel, cpu_draft, method, gamma=cfg.gamma, quant=quant)
        tmodel = _take(tmodel, quant, "target", choice["target"])
    else:  # only the draft on a CPU: its one-row steps decide
        quant = {"target": gguf_twin(draft, cfg, ddev)}
        choice = precision.choose(dmodel, None, "ar", quant=quant)
        choice = {**choice, "target": "bfloat16", "draft": choice["target"], "method": method}
        quant = {"draft": quant["target"]}
    if cpu_draft is not None and choice["draft"]:
        dmodel = _take(cpu_draft, quant, "draft", choice["draft"])
    return tmodel, tpath, dmodel, choice


def _choose_before_loading(target, draft, cfg: EngineConfig, method: str, dev):
    """weights "auto" on a CPU with GGUF sources: the blocks are loaded, the float settings are
    timed on the float models' shapes alone (meta tensors: no float weights read, none written),
    and a float model is loaded only where it wins. None where a source is not a GGUF."""
    quant = {"target": gguf_twin(target, cfg, dev), "draft": gguf_twin(draft, cfg, dev)}
    if quant["target"] is None or (draft is not None and quant["draft"] is None):
        return None
    if draft is not None:  # the grid tokenizes it only if it measures the requantized draft's agreement
        quant["calibration"] = lambda: draft_requant.calibration_ids(load_tokenizer(resolve(target)))
        quant["requant"] = draft_requant.Candidate(quant["draft"])  # built only if priced or chosen
    shapes = {role: _shapes(name) for role, name in (("target", target), ("draft", draft)) if name is not None}
    choice = precision.choose(shapes["target"], shapes.get("draft"), method, gamma=cfg.gamma, quant=quant)
    models = {role: _held(choice[role], quant, role) or load_model(name, getattr(torch, choice[role]), dev)[0]
              for role, name in (("target", target), ("draft", draft)) if name is not None}
    return models["target"], resolve(target), models.get("draft"), choice


def _shapes(name):
    """The float model's module tree on the meta device: its shapes, no weights."""
    with torch.device("meta"):
        return Transformer(load_config(resolve(name)))


def _held(setting: str, quant: dict, role: str):
    """The role's model where the chosen setting holds GGUF blocks: the file's, or the draft's
    requantized (built now if the grid priced it from the cache alone); else None."""
    if setting == precision.GGUF:
        return quant[role]
    if setting == requant.SETTING:
        return quant["requant"].model()
    return None


def _take(model, quant: dict, role: str, setting: str):
    """The model in the chosen setting: blocks (`_held`), or itself in the chosen dtype (the loser's
    memory is released when its last reference goes)."""
    return _held(setting, quant, role) or model.to(getattr(torch, setting))
