"""CPU weights held in 2 MiB pages (Linux transparent huge pages, asked for with madvise).

A decode step streams every weight once, ~1.1 GB for the default target. In 4 KiB pages that is
~270,000 TLB misses a step, each a page walk, and on a VM a nested one (guest and host tables):
on the 2-vCPU AMX Xeon VM the one-row kernels streamed 14-15% faster from 2 MiB pages and the read
probe 29%, and whole replies decoded 1.14-1.20x faster (`ar`) and 1.10-1.13x (`sd`), same tokens
(docs/design.md, "Weights in 2 MiB pages"). Where THP is set to "always" big allocations may get such
pages anyway; the common "madvise" setting gives them only to ranges that ask, which `hold` does.

`hold(model)` copies the model's CPU weights into one 2 MiB-aligned block asked for with
MADV_HUGEPAGE (views keep their strides and sharing: a tied embedding stays one tensor); whatever
cached the old tensors must drop them (the caller: the compiled layer stack's cache). The kernel may
still give 4 KiB pages (fragmented memory); `huge_bytes` reads back what it gave (/proc/self/smaps). A
tensor replaced after the hold (a layout changed at run time) is held anew in a block of its own, and
its old bytes stay in the first block while the model holds any of it. The cost is the huge pages'
first touch: on that VM, whose host takes freed guest memory back, 7.8 s/GiB for fresh ones (0.15
s/GiB for ones the process had just freed; 4 KiB pages 0.2 s/GiB): there `huge_pages=False` suits
short-lived processes.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import time
import weakref
from pathlib import Path

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_enabled = True  # set per load by the engine's `huge_pages` option (`enable`)
_blocks: dict[int, tuple] = {}  # each held block's mapping (data pointer) -> (weakref to its storage, bytes held)
_moves = weakref.WeakKeyDictionary()  # model -> {"bytes", "seconds"} its holds moved, summed
_refusals = weakref.WeakKeyDictionary()  # model -> why its hold got no block (mmap or madvise failed)


def support() -> str | None:
    """Why weights cannot be held in huge pages here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return f"transparent huge pages are Linux's ({sys.platform})"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"this kernel has no transparent huge pages ({THP_SETTING} is missing)"
    if "[never]" in setting:
        return f"transparent huge pages are off ({THP_SETTING}: never)"
    return None


def enable(on: bool) -> None:
    """Whether `hold` moves weights (the engine's `huge_pages` option, set before its models load)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled and support() is None


def _tensors(modules) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, name, tensor) of every dense CPU parameter and buffer of `modules` not held yet."""
    out = []
    for mod in modules:
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None and t.device.type == "cpu" and t.layout == torch.strided \
                        and t.untyped_storage().data_ptr() not in _blocks:
                    out.append((mod, name, t))
    return out


def _block(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] at a 2 MiB boundary of a fresh anonymous mapping (not torch's allocator: after large
    frees glibc serves blocks of up to 32 MiB from memory already touched in small pages), its whole 2
    MiB spans asked for as huge pages before anything touches them (a fault then takes a huge page; the
    tail, less than one, stays in small pages). The tensor keeps the mapping alive; freed with it."""
    area = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(area)) % HUGE
    whole = nbytes // HUGE * HUGE
    if whole:
        area.madvise(MADV_HUGEPAGE, start, whole)
    return torch.frombuffer(area, dtype=torch.uint8)[start: start + nbytes]


def hold(model) -> dict | None:
    """Move the model's CPU weights into one block of huge pages (tensors sharing a storage, as a
    tied embedding, stay shared); {"bytes", "seconds"} of what moved, or None where nothing did
    (disabled, unsupported, under 2 MiB, or held already)."""
    if not enabled():
        return None
    storages, total = {}, 0  # storage pointer -> (storage, its offset in the block): sharers stay shared
    found = _tensors(model.modules())
    for _, _, t in found:
        s = t.untyped_storage()
        if s.data_ptr() not in storages:
            storages[s.data_ptr()] = (s, total)
            total += -(-s.nbytes() // 64) * 64
    if total < HUGE:  # nothing a huge page would hold
        return None
    t0 = time.perf_counter()
    try:
        block = _block(total)
    except OSError as e:  # a kernel or sandbox that refuses the mapping or the advice: small pages, said why
        _refusals[model] = f"the kernel refused huge pages: {e}"
        return None
    for s, at in storages.values():
        block[at: at + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
    moved = {}  # id of an old tensor -> its new one (a tensor registered twice stays one)
    for mod, name, t in found:
        new = moved.get(id(t))
        if new is None:
            s, at = storages[t.untyped_storage().data_ptr()]
            v = block[at: at + s.nbytes()].view(t.dtype)
            new = v.as_strided(t.shape, t.stride(), v.storage_offset() + t.storage_offset())
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            moved[id(t)] = new
        (mod._parameters if name in mod._parameters else mod._buffers)[name] = new
    _blocks[block.untyped_storage().data_ptr()] = (weakref.ref(block.untyped_storage()), total)
    _forget_freed()
    done = {"bytes": total, "seconds": time.perf_counter() - t0}
    so_far = _moves.get(model, {"bytes": 0, "seconds": 0.0})
    _moves[model] = {k: so_far[k] + done[k] for k in done}
    return done


def held(model) -> bool:
    """Has `hold` moved this model's weights?"""
    return model in _moves


def refused(model) -> str | None:
    """Why this model's hold got no block (the kernel refused the mapping or the advice), else None.
    Per model: one refusal (a sandbox's moment, a mapping too large) does not stop the next model's."""
    return _refusals.get(model)


def pending(model) -> bool:
    """Will a hold still move this model's weights (enabled here, not held yet, not refused)?"""
    return enabled() and not held(model) and model not in _refusals


def _forget_freed() -> None:
    for ptr in [p for p, (ref, _) in _blocks.items() if ref() is None]:
        del _blocks[ptr]


def huge_bytes() -> int:
    """Bytes of the held weights (every model's) that the kernel backs with huge pages now: the
    AnonHugePages of the mappings holding them (/proc/self/smaps), at most their whole 2 MiB spans. A
    mapping holds whichever blocks sit side by side, so this is counted for all at once; 0 where not
    readable."""
    _forget_freed()
    blocks = [(ptr, ref().nbytes(), held) for ptr, (ref, held) in _blocks.items() if ref() is not None]
    try:
        text = Path("/proc/self/smaps").read_text() if blocks else ""
    except OSError:
        return 0
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's address range starts its entry
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(p < hi and p + n > lo for p, n, _ in blocks)
        elif head == "AnonHugePages:" and inside:
            total += int(line.split()[1]) * 1024
    return min(total, sum(held // HUGE * HUGE for _, _, held in blocks))


def report(model) -> dict:
    """This model's weights: bytes moved into huge pages and the seconds it took, or why none were."""
    why = "huge_pages=False" if not _enabled else support() or refused(model)
    moved = _moves.get(model)
    return moved or {"why_not": why or "under 2 MiB of weights"}
