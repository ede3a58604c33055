"""The machine at hand, and the one cache of what was measured on it (docs/design.md, "The plan").

The persisted measurements (CPU matmul paths, GGUF block layouts and their costs, which feed the
precision per role; the step costs and the round clock's corrections, runtime/step_costs.py; not
the batch-invariant probe, taken per engine: on a CPU it needs no timing where no padding is
needed) file their results in one table per *key*: the CPU model, torch's and our kernels' instruction sets, the thread
count, the torch version and a digest of the compiled kernels (the extension's bytes: any
change of csrc/ or of its flags is a new digest). So a new kernel, torch or thread count reads
a table of its own: nothing is bumped by hand, nothing stale is read. Each entry also keeps how
fast the machine ran when it was taken (`reference_ms`): one taken on a machine busier than now
is measured again (`load`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
from pathlib import Path

import torch

from . import huge_pages


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def cpuinfo(field: str) -> str | None:
    """A field of /proc/cpuinfo's first processor (None off Linux or where it is missing): a VM
    may name its CPU only "AMD EPYC", so benchmarks also record "cpu family" and "model"."""
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(rf"^{re.escape(field)}\s*:\s*(.+)$", f.read(), re.M)
    except OSError:
        return None
    return found.group(1).strip() if found else None


ZEN = {23: "zen2", 26: "zen5"}  # AMD CPU family -> core; family 25 is Zen 3 without AVX-512, Zen 4 with it


def cpu_kind() -> str:
    """A short name of this CPU's kind for result files: torch's instruction set and the core where
    /proc/cpuinfo tells it ("avx2_zen3", "avx512_zen4", "avx512_zen5", "avx512_xeon_amx"). A VM may
    call Zen 4 and Zen 5 both "AMD EPYC", and both run AVX-512: the ISA alone would let one kind's
    results overwrite the other's."""
    isa = torch.backends.cpu.get_cpu_capability().lower()
    vendor, family, flags = cpuinfo("vendor_id") or "", cpuinfo("cpu family") or "", (cpuinfo("flags") or "").split()
    if vendor == "AuthenticAMD" and family.isdigit():
        f = int(family)
        core = ("zen4" if "avx512f" in flags else "zen3") if f == 25 else ZEN.get(f, f"amd{f}")
    elif vendor == "GenuineIntel":
        core = "xeon_amx" if "amx_tile" in flags else "xeon"
    else:
        core = re.sub(r"[^a-z0-9]+", "", (vendor or platform.machine()).lower()) or "cpu"
    return f"{isa}_{core}"


@functools.lru_cache(maxsize=None)
def kernel_digest() -> str:
    """The compiled CPU kernels' identity: the first 12 hex digits of the extension file's
    sha256 ("torch" where it was not built: every op then runs its torch reference)."""
    from .kernels.cpu_ext import EXT

    if EXT is None or not getattr(EXT, "__file__", None):
        return "torch"
    return hashlib.sha256(Path(EXT.__file__).read_bytes()).hexdigest()[:12]


def last_level_cache_bytes() -> int:
    """The largest cache this CPU reports (sysfs; 32 MiB when it says nothing): what a weight pass
    must outgrow to be read from memory (quant_plan.choose_prefetch; bench/gguf_cpu.py streams twice it)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def machine() -> dict:
    """What the measurements depend on. "kernels": the instruction set our kernels run with
    here (CPUID; None where not built)."""
    from .kernels.cpu_ext import EXT, TILES, VECTOR

    # the tile copy's choice is a measurement filed in this table (quant_plan.choose_tiles): both copies
    # name one table, or the choice would move the table it is in
    kernels = None if EXT is None else (VECTOR if EXT.isa() == TILES else EXT.isa())
    return {"cpu": cpu_name(), "isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": kernels,
            "kernel_digest": kernel_digest(), "pages": "2M" if huge_pages.enabled() else "4K"}


def key() -> str:
    m = machine()
    # the weights' page size moves every timing (huge_pages.py): a table measured in 4 KiB pages is another's
    raw = (f"{m['cpu']}-{m['isa']}-{m['kernels'] or 'torch'}-{m['threads']}t-torch{m['torch']}-{m['kernel_digest']}"
           + ("" if m["pages"] == "4K" else f"-{m['pages']}pages"))
    return re.sub(r"[^A-Za-z0-9.]+", "-", raw).strip("-")


def cache_dir() -> Path:
    """Where this machine keeps what specengine fetched, converted and measured."""
    return Path(os.environ.get("SPECENGINE_CACHE", Path.home() / ".cache" / "specengine"))


def cache_path() -> Path:
    """This machine's table: under SPECENGINE_PLAN_DIR if set (the test suite keeps its own, so
    tests never file into a user's table), else <cache>/plan."""
    folder = os.environ.get("SPECENGINE_PLAN_DIR")
    return (Path(folder) if folder else cache_dir() / "plan") / f"{key()}.json"


STALE = 1.4  # an entry timed while the machine ran this much slower than now is timed again


@functools.lru_cache(maxsize=None)
def reference_ms() -> float:
    """How fast this machine runs right now: the best of five fp32 matvecs over a 64 MB weight on
    every thread (memory-bound, so a neighbour's load on a core or on the memory shows), ~30 ms once
    per process. Each measured entry keeps the value it was taken at (`ref_ms`)."""
    import time

    w, x = torch.full((4096, 4096), 0.5), torch.ones(1, 4096)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(6):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t)
    return 1e3 * best


def _bare(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "ref_ms"}


def load() -> dict:
    """The machine's table: {entry key: measured entry}; empty when nothing was measured yet (or the
    file is unreadable: it is then measured again). Entries taken while the machine ran STALE times
    slower than it does now (another process busy on a 2-core VM: a table measured then chose a bf16
    draft that cost more than the target) are left out, so they are measured again and replaced; a
    table taken on a quiet machine is kept when the machine is busy now."""
    try:
        entries = json.loads(cache_path().read_text())["entries"]
    except (OSError, ValueError, KeyError):
        return {}
    now = reference_ms()
    return {k: v for k, v in entries.items() if v.get("ref_ms", 0.0) <= STALE * now}


def save(entries: dict) -> None:
    """Write the table back, atomically: concurrent processes never read half a file (the
    last writer wins; what another process measured meanwhile is measured again later)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"machine": machine(), "entries": entries}, indent=1, sort_keys=True))
    tmp.replace(path)


def update(new: dict, timed: bool = True) -> dict:
    """Merge `new` entries into the table (read again just before writing, so entries another
    process saved meanwhile are kept) and return the table. An entry new or changed here is
    stamped, in place, with the machine's speed now (`reference_ms`); one handed back as it was
    keeps its own. timed=False: entries that hold no times (ratios, acceptance rates) are never
    stamped, so never left out as stale: whether a process saw them hung on its reference matvec."""
    table = load()
    for k, v in new.items():
        old = table.get(k)
        if not timed:
            v.pop("ref_ms", None)
        elif old is None or "ref_ms" not in v or _bare(old) != _bare(v):
            v["ref_ms"] = reference_ms()
        table[k] = v
    save(table)
    return table
