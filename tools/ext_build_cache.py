"""A machine-wide cache of the compiled extensions (setup.py), like ccache for whole modules.

A fresh clone's install compiled csrc/ again (~80 s of 2 cores on an AVX2 EPYC) although the same
sources, compiler, torch and flags had been compiled on this machine before: CI installs into a
clean clone every run. Each built module is kept under `<cache>/ext-build/<key>/`, the key being a
hash of everything the binary depends on: every file under csrc/, setup.py and this file, the
extension's sources, macros and flags, the compiler's and nvcc's `--version`, torch's and Python's
versions, the machine and the environment variables the build reads. Any change is a new key (a
compile); nothing is ever reused across one. The KEEP builds last built or reused stay, older ones are
removed. SPECENGINE_EXT_CACHE=0 turns it off. Loaded by path
from setup.py (build isolation aside, the checkout is not importable there).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = 8  # builds kept (the most recently built or reused; ~1.4 MB each on a CPU machine)
ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "TORCH_CUDA_ARCH_LIST", "SPECENGINE_ISAS", "CUDA_HOME")


def enabled() -> bool:
    return os.environ.get("SPECENGINE_EXT_CACHE", "1") != "0"


def cache_root() -> Path:
    # the package's cache (specengine.machine.cache_dir), which setup.py cannot import
    return Path(os.environ.get("SPECENGINE_CACHE", Path.home() / ".cache" / "specengine")) / "ext-build"


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd + ["--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "absent"


def key(ext, torch_version: str, cuda_home: str | None, root: Path = ROOT) -> str:
    """The hash of what `ext`'s binary is made of (see the module's doc)."""
    h = hashlib.sha256()
    files = sorted(p for p in (root / "csrc").rglob("*") if p.is_file())
    for path in [*files, root / "setup.py", root / "tools" / "ext_build_cache.py"]:
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    cuda = any(str(s).endswith(".cu") for s in ext.sources)
    nvcc = _version([str(Path(cuda_home) / "bin" / "nvcc")]) if cuda and cuda_home else ""
    parts = [ext.name, ext.sources, ext.define_macros, ext.extra_compile_args, ext.extra_link_args,
             torch_version, sys.version, platform.machine(), _version([os.environ.get("CXX", "c++")]), nvcc,
             [(v, os.environ.get(v)) for v in ENV]]
    h.update(repr(parts).encode())
    return h.hexdigest()[:24]


def fetch(k: str, target: str) -> bool:
    """Copy a kept build of key `k` to `target`; False when there is none."""
    kept = cache_root() / k / Path(target).name
    if not (enabled() and kept.is_file()):
        return False
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(kept, target)
    os.utime(kept.parent)  # recently used: the last to be pruned
    print(f"specengine: {Path(target).name} reused from {kept.parent} (same sources, compiler, torch, flags)",
          file=sys.stderr)
    return True


def keep(k: str, built: str) -> None:
    """File a fresh build under key `k` (written aside, then renamed: never a half file)."""
    if not enabled() or not Path(built).is_file():
        return
    folder = cache_root() / k
    try:
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / (Path(built).name + f".part{os.getpid()}")
        shutil.copy2(built, part)
        os.replace(part, folder / Path(built).name)
        builds = sorted((d for d in cache_root().iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
        for old in builds[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # a cache that cannot be written costs the next install a compile, nothing else
        print(f"specengine: could not keep the build in {folder} ({e})", file=sys.stderr)
