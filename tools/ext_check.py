"""Compile the CUDA part of the KV extension (csrc/) for a real GPU, without a GPU.

The development and CI machines have a CPU build of torch, whose headers lack the CUDA
parts that csrc/compact_kv_cuda.cu includes. This module finds the headers of a CUDA build
of torch (the installed torch if it is one, `$SPECENGINE_CUDA_TORCH_INCLUDE`, or headers
extracted once from a CUDA torch wheel into the cache), compiles the .cu file with nvcc for
sm_90 in the C++ standard that torch's own build config names, with the flags
torch.utils.cpp_extension adds, and reads registers, stack frame and spills per kernel from
`-Xptxas -v`.

    python tools/ext_check.py --fetch-only      # extract headers (pip download; cached)
    python tools/ext_check.py                   # compile and print the resource table
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specengine.models.fetch import cache_dir

CSRC = Path(__file__).resolve().parents[1] / "csrc"
DEFAULT_WHEEL_SPEC = "torch==2.14.1"  # a CUDA (cu130) build; the CPU machines' pip finds it on disk


def headers_cache() -> Path:
    return cache_dir() / "torch-cuda-headers"


def cuda_torch_root() -> Path | None:
    """A directory holding `include/torch/extension.h` of a CUDA build of torch, or None."""
    env = os.environ.get("SPECENGINE_CUDA_TORCH_INCLUDE")
    if env:
        return Path(env)
    import torch

    if torch.version.cuda is not None:
        return Path(torch.__file__).parent
    found = sorted(headers_cache().glob("*/torch/include/torch/extension.h"))
    return found[-1].parents[2] if found else None


def fetch_headers(spec: str = DEFAULT_WHEEL_SPEC) -> Path:
    """pip-download a CUDA torch wheel, keep its headers and build config, drop the wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        spec, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("torch-*.whl"))
        dest = headers_cache() / wheel.stem
        with zipfile.ZipFile(wheel) as z:
            version = z.read("torch/version.py").decode()
            if "cuda: Optional[str] = None" in version:
                raise RuntimeError(f"{wheel.name} is not a CUDA build of torch")
            keep = [n for n in z.namelist() if n.startswith("torch/include/")
                    or n in ("torch/share/cmake/Torch/TorchConfig.cmake", "torch/version.py")]
            z.extractall(dest, keep)
    return dest / "torch"


def ensure_headers(spec: str = DEFAULT_WHEEL_SPEC) -> Path | None:
    """The CUDA torch headers, fetched once if missing; None (with a note) when they cannot be."""
    root = cuda_torch_root()
    if root is None:
        try:
            root = fetch_headers(spec)
        except Exception as e:  # offline, no such wheel, no pip: the nvcc test then skips
            print(f"specengine: no CUDA torch headers ({type(e).__name__}: {e}); the csrc nvcc check will skip",
                  file=sys.stderr)
    return root


def torch_cxx_standard(root: Path) -> str:
    """The C++ standard torch's build config requires of extensions (TorchConfig.cmake)."""
    text = (root / "share" / "cmake" / "Torch" / "TorchConfig.cmake").read_text()
    standard = max(int(n) for n in re.findall(r"CXX_STANDARD\s+(\d+)", text))
    return f"c++{standard}"


@dataclass
class KernelUsage:
    name: str
    registers: int
    stack_bytes: int
    spill_bytes: int
    shared_bytes: int


def parse_ptxas(text: str) -> list[KernelUsage]:
    """Per kernel from `-Xptxas -v`: registers, stack frame, spills and shared memory."""
    out = []
    for block in re.split(r"Compiling entry function ", text)[1:]:
        name = block.split("'")[1]
        stack, stores, loads = map(int, re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block).groups())
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        smem = re.search(r"(\d+) bytes smem", block)
        out.append(KernelUsage(name, regs, stack, stores + loads, int(smem.group(1)) if smem else 0))
    return out


def compile_cuda(root: Path, arch: str = "90", out_dir: Path | None = None) -> tuple[str, list[KernelUsage]]:
    """nvcc-compile csrc/compact_kv_cuda.cu against `root`'s headers; (standard, usage)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    std = torch_cxx_standard(root)
    out_dir = Path(out_dir or tempfile.mkdtemp())
    cmd = ["nvcc", "-c", str(CSRC / "compact_kv_cuda.cu"), "-o", str(out_dir / "compact_kv_cuda.o"),
           f"-std={std}", "-O3", "-DWITH_CUDA", "--compiler-options", "-fPIC", *COMMON_NVCC_FLAGS,
           f"-I{CSRC}", f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
           f"-I{sysconfig.get_paths()['include']}", "-gencode", f"arch=compute_{arch},code=sm_{arch}",
           "-Xptxas", "-v"]
    memo = _memo_path(cmd, out_dir)
    if memo.exists():  # the same sources, flags, headers and nvcc compiled before: its ptxas report
        return std, parse_ptxas(memo.read_text())
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(proc.stdout + proc.stderr)
    return std, parse_ptxas(proc.stdout + proc.stderr)


def _memo_path(cmd: list[str], out_dir: Path) -> Path:
    """Where a successful compile's report is kept, keyed (like ccache) by everything that decides
    it: the command (flags, include paths, header root), every csrc/ source and nvcc's version."""
    key = hashlib.sha256()
    root = str(CSRC.parent)  # where the checkout lies decides nothing: the same files compile alike anywhere
    key.update(" ".join(cmd).replace(str(out_dir), "OUT").replace(root, "ROOT").replace(sys.prefix, "PREFIX").encode())
    for f in sorted(CSRC.rglob("*")):
        if f.is_file():
            key.update(f.name.encode() + f.read_bytes())
    key.update(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.encode())
    return cache_dir() / "ext-check" / f"{key.hexdigest()[:32]}.txt"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch-headers", nargs="?", const=DEFAULT_WHEEL_SPEC, default=None, metavar="SPEC",
                    help=f"extract the headers of a CUDA torch wheel first (default {DEFAULT_WHEEL_SPEC})")
    ap.add_argument("--fetch-only", action="store_true", help="fetch the headers if missing, compile nothing")
    ap.add_argument("--arch", default="90")
    args = ap.parse_args(argv)
    # --fetch-only alone fetches the default wheel's headers (a missing spec once asked pip for "None")
    root = ensure_headers(args.fetch_headers or DEFAULT_WHEEL_SPEC) if args.fetch_headers or args.fetch_only \
        else cuda_torch_root()
    if args.fetch_only:
        print(f"CUDA torch headers: {root}")
        return 0
    if root is None:
        print("no CUDA torch headers: run with --fetch-only first", file=sys.stderr)
        return 2
    std, usage = compile_cuda(root, args.arch)
    print(f"csrc/compact_kv_cuda.cu, sm_{args.arch}, -std={std}, headers {root}")
    print("kernel | registers | stack B | spill B | shared B")
    for k in usage:
        print(f"{k.name} | {k.registers} | {k.stack_bytes} | {k.spill_bytes} | {k.shared_bytes}")
    return 1 if any(k.stack_bytes or k.spill_bytes for k in usage) else 0


if __name__ == "__main__":
    sys.exit(main())
