"""How CPU `Linear` layers multiply the few-row inputs of decoding and verification,
chosen by measurement on the machine at hand (docs/design.md, "CPU matmul paths").

CPU BLAS libraries handle 1-16 row inputs very differently from one CPU to the next: on
one machine `F.linear` is near memory bandwidth, on another the transposed product
`(W @ xᵀ)ᵀ` or oneDNN with a pre-packed weight is 2-4x faster. No choice is hard-coded:
for every weight shape of a model (grouped: all q_proj of a model share a shape) and every
row count 1..ROWS_TUNED[-1], each candidate path is timed on the model's own weights, the
fastest is kept, and the entries go to the machine's one table (specengine/machine.py: keyed
by CPU, instruction sets, threads, torch and the kernels' digest), so later loads apply it at once.

Candidates: `F.linear`, the transposed product, the padded one-row product, oneDNN, and ours
(`rows`, bf16 weights: each weight row widened once for every input row, csrc/; where built).

Past the tuned widths (a prompt) a group takes its storage's large-input path (F.linear, or oneDNN's
for a packed weight), or, for a dtype `rows` applies to, whichever of that and `rows` won at PREFILL_ROWS.

A shape group also chooses its weight *storage*: the plain tensor (paths `linear`, `wxt`, `wxt_pad`)
or oneDNN's packed layout (`mkldnn`, every row count), which replaces the weight; `unpack` restores it.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import machine
from ..timing import best_seconds
from . import quant_linear
from .quant_linear import _quantext  # the compiled CPU kernels (None where not built)

ROWS_TUNED = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)  # decode (1), verify (γ+1), small batches
# A prompt's width, where a dtype with our `rows` kernel (bf16) times it against the storage's large-input
# path: without native bf16, F.linear's emulated GEMM costs ~3x `rows` there on the AVX2 EPYC (prefill)
PREFILL_ROWS = 64
MIN_PASS_BYTES = 256 << 20  # a timing pass reads at least this much weight (or every layer)
LOSES_BY = 1.3  # a path whose first pass gets this much slower than the best one's stops there, timed once
DROPPED_AT = 2.0  # a path this much slower than its storage's best at 2+ rows is not timed at more rows


# ----------------------------------------------------------------------------- paths
def _linear(x, w):
    return F.linear(x, w)


def _wxt(x, w):  # (W @ xᵀ)ᵀ: another BLAS kernel family, fast for few rows on some CPUs
    return (w @ x.t()).t()


def _wxt_pad(x, w):  # one row padded to two: avoids a slow GEMV on some BLAS builds
    return (w @ x.repeat(2, 1).t()).t()[:1] if x.shape[0] == 1 else _wxt(x, w)


def _mkldnn(x, packed):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _pack_mkldnn(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def _rows(x, w):
    """Our few-row kernel (csrc/cpu/dequant_impl.h `dense_matmul`): each bf16 weight row widened
    once and multiplied with every input row in fp32 (where BLAS costs ~k decodes for k rows)."""
    return quant_linear.dense_matmul(x.float().contiguous(), w).to(x.dtype)


PATHS = {"linear": ("plain", _linear), "wxt": ("plain", _wxt), "wxt_pad": ("plain", _wxt_pad),
         "mkldnn": ("mkldnn", _mkldnn)} | ({"rows": ("plain", _rows)} if _quantext is not None else {})
STORAGE_LARGE_PATH = {"plain": "linear", "mkldnn": "mkldnn"}  # rows past the tuned range
# bf16 only: fp32 BLAS is already near memory bandwidth for few rows on the CPUs measured, and
# fp32 keeps transformers' sums (the fp32 peers' token equality on random models rests on it)
PATH_DTYPES = {"rows": (torch.bfloat16,)}
PREFILL_PATHS = {*STORAGE_LARGE_PATH.values(), "rows"}  # the paths timed at PREFILL_ROWS


def applies(name: str, dtype: torch.dtype) -> bool:
    """Whether path `name` exists here (`rows`: where the extension is built) and multiplies `dtype`."""
    return name in PATHS and dtype in PATH_DTYPES.get(name, (dtype,))


@functools.lru_cache(maxsize=None)
def storage_available(storage: str, dtype: torch.dtype) -> bool:
    """oneDNN packing exists only where this torch build and CPU support it for the dtype."""
    if storage == "plain":
        return True
    try:
        _pack_mkldnn(torch.zeros(8, 8, dtype=dtype))
        return True
    except (RuntimeError, AttributeError):
        return False


# ----------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Plan:
    """The storage of one shape group and its path per row count (index = rows)."""
    storage: str
    by_rows: tuple[str, ...]  # path for r rows at index r (index 0: the path past the last index)

    def fns(self):
        return tuple(PATHS[p][1] for p in self.by_rows), PATHS[self.by_rows[0]][1]

    @property
    def pack(self):
        """The weight's packing function for this storage (None: the plain tensor)."""
        return _pack_mkldnn if self.storage == "mkldnn" else None


def fastest(times: dict[str, float], storage: str) -> tuple[float, str]:
    """(ms, path) of the fastest measured path that works on weights in `storage`."""
    return min((ms, p) for p, ms in times.items() if PATHS[p][0] == storage)


def plan_from_entry(entry: dict) -> Plan:
    """Best path per tuned row count; an untuned count uses the next larger tuned one; past the
    largest, the PREFILL_ROWS winner where that width was timed, else the storage's large path."""
    storage = entry["storage"]
    best = {int(r): fastest(times, storage)[1] for r, times in entry["ms"].items()}
    top = max(best)
    large = best.get(PREFILL_ROWS, STORAGE_LARGE_PATH[storage])
    by_rows = [large] + [best[min(t for t in best if t >= r)] for r in range(1, top + 1)]
    return Plan(storage, tuple(by_rows))


def unpack(model) -> None:
    """Back to plain weights and F.linear everywhere (e.g. before moving a model to a GPU), and
    GGUF blocks back to the file's rows."""
    for layer in _linears(model):
        layer.plain()
        layer.__dict__.pop("own_plan", None)  # F.linear is its own plan now (use_path)
    for layer in quant_linear.quant_layers(model):
        layer.pack(False)


# ----------------------------------------------------------------------------- the machine's table
def _load_table() -> dict:
    return machine.load()


def _save_table(entries: dict) -> None:
    machine.update(entries)


# ----------------------------------------------------------------------------- measuring
def _linears(model):
    from .decoder import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def shape_groups(model, dtype=None) -> dict[str, list]:
    """Linear layers keyed by "dtype:out x in:storage options" (a tied LM head stays plain)."""
    tied = getattr(model.embed_tokens, "weight", None)  # a quantized embedding has none
    groups: dict[str, list] = {}
    for layer in _linears(model):
        dt = dtype or (layer.weight if layer.weight is not None else layer.packed_weight).dtype
        shared = layer.weight is tied
        key = f"{str(dt).removeprefix('torch.')}:{layer.out_features}x{layer.in_features}:{'tied' if shared else 'own'}"
        groups.setdefault(key, []).append(layer)
    return groups


def _dense(layer) -> torch.Tensor:
    """The layer's weight to time paths on. A layer on the meta device (a float model's shapes
    only: precision.py chooses before loading) gets fp32 rows of a constant, only as many as `_sample`
    can time: past 2x a pass's rows it keeps just the first pass's."""
    if layer.weight is not None and layer.weight.is_meta:
        need = -(-MIN_PASS_BYTES // (layer.in_features * 4))
        # values never change a matmul's time: a constant fill is 10x cheaper than randn (which was
        # 7 of a first load's 10 s of bf16 one-row floors on the AVX2 EPYC)
        return torch.full((min(layer.out_features, 2 * need + 1), layer.in_features), 0.02)
    return layer.weight.detach() if layer.weight is not None else layer.packed_weight.to_dense()


def _sample(layers, dtype) -> list[torch.Tensor]:
    """Enough of a group's weights that a pass streams MIN_PASS_BYTES from memory, as
    decoding does (every layer when the group is smaller). A single huge weight (an LM head)
    is cut to its first output rows: same kernel, same inner size, a quarter of the time."""
    out, total = [], 0
    for layer in layers:
        w = _dense(layer)
        rows_needed = -(-MIN_PASS_BYTES // (w.shape[1] * w.element_size()))
        if not out and w.shape[0] > 2 * rows_needed:
            return [w[:rows_needed].to(dtype)]
        out.append(w.to(dtype))
        total += w.numel() * w.element_size()
        if total >= MIN_PASS_BYTES and len(out) >= 2:
            break
    return out


def _time_pass(fn, x, weights, reps: int, xs=None, loses_at: float | None = None) -> float:
    """Best-of-`reps` seconds per weight for one pass fn(x, w) over `weights` (per-weight
    inputs when `xs` is given). The first pass also warms up; it rarely wins the minimum.
    loses_at: seconds per weight past which the path cannot win (LOSES_BY x the best path timed at
    this row count): one untimed call on the first weight takes the shape's one-time costs, and a
    first timed pass stops at the weight that takes it past the bound, its rate so far the answer:
    a loser costs at most ~LOSES_BY x the best pass, however far behind (bf16 on an AVX2 EPYC:
    F.linear and the transposed product lose 3-4x to `rows` from 1 row on, and their full passes
    were 24 of the bf16 pair's 31 s table). A pass that ends inside the bound gets every rep."""
    xs = xs or [x] * len(weights)

    def one_pass():
        for x_i, w in zip(xs, weights):
            fn(x_i, w)
    if loses_at is None:
        return best_seconds(one_pass, reps) / len(weights)
    fn(xs[0], weights[0])
    limit, start = loses_at * len(weights), time.perf_counter()
    for done, (x_i, w) in enumerate(zip(xs, weights), 1):
        fn(x_i, w)  # a CPU call: done when it returns
        elapsed = time.perf_counter() - start
        if elapsed >= limit:
            return elapsed / done
    return best_seconds(one_pass, reps - 1, best=elapsed) / len(weights)


def measure_group(layers, dtype, rows, storages, reps: int = 2, bar=None) -> dict:
    """{rows: {path: ms per layer}} for the paths of the given storages on this group's weights. A path
    that lost by DROPPED_AT to one of its storage at 2+ rows is left out of larger row counts (one row
    is no evidence: a BLAS's slow GEMV, `wxt_pad`; a prompt's width is timed for itself)."""
    plain = _sample(layers, dtype)
    scale = layers[0].out_features / plain[0].shape[0]  # a sliced LM head: scale to the whole
    stores = {"plain": plain}
    if "mkldnn" in storages:
        stores["mkldnn"] = [_pack_mkldnn(w) for w in plain]
    gen = torch.Generator().manual_seed(0)
    ms, order, dropped = {}, list(PATHS), set()
    for r in rows:
        x = torch.randn(r, plain[0].shape[1], generator=gen).to(dtype)
        times = ms[str(r)] = {}
        for name in order:
            storage, fn = PATHS[name]
            if storage not in stores or (name == "wxt_pad" and r != 1) or not applies(name, dtype):
                continue
            if name in dropped and r != PREFILL_ROWS:
                continue
            if r == PREFILL_ROWS and name not in PREFILL_PATHS:  # what a prompt may take: see tune
                continue
            best = min(times.values(), default=None)  # ms of the best path timed so far
            loses_at = None if best is None else LOSES_BY * best / (1e3 * scale)
            # a prompt's width is compute-bound: one weight times it as well as a stream of them
            weights = stores[storage][:1] if r == PREFILL_ROWS else stores[storage]
            times[name] = 1e3 * scale * _time_pass(fn, x, weights, reps, loses_at=loses_at)
            if bar is not None:
                bar.update(1)
        # the winner here goes first at the next row count, so the paths losing to it are timed once
        # there (bf16 on an AVX2 EPYC: `rows`, last in PATHS, beats F.linear from 2 rows on by 1.2-2x)
        winner = min(times, key=times.get)
        order = [winner] + [p for p in order if p != winner]
        if 2 <= r < PREFILL_ROWS:  # far behind a path of its storage past one row (a GEMV's quirks): out
            dropped |= {p for p, t in times.items() if t > DROPPED_AT * fastest(times, PATHS[p][0])[0]}
    return ms


def _choose_storage(ms: dict, storages) -> str:
    """The storage whose best paths sum to the least time over the tuned row counts (ROWS_TUNED
    only, all of which `tune` measures first: rows measured later for a wider verify never
    change a storage already chosen, so every load of a machine chooses alike)."""
    def total(storage):
        return sum(fastest(times, storage)[0] for r, times in ms.items() if int(r) in ROWS_TUNED)
    return min(storages, key=total)


def _storages(key: str, dtype) -> list[str]:
    """The storages a group is timed in: plain, and oneDNN-packed where available (a tied LM head stays plain)."""
    return ["plain"] + (["mkldnn"] if not key.endswith(":tied") and storage_available("mkldnn", dtype) else [])


def tune(model, rows=ROWS_TUNED, reps: int = 2, progress: bool = True, dtype=None) -> dict[str, dict]:
    """Measure (or read from the machine's table) every shape group of `model`; returns entries."""
    dtype = dtype or model.dtype
    rows = sorted(set(rows) | set(ROWS_TUNED))  # the storage is chosen over all of ROWS_TUNED
    if applies("rows", dtype):
        # a prompt's path: the storage's large path or `rows` (other dtypes: the large path, untimed)
        rows = sorted(set(rows) | {PREFILL_ROWS})
    table = _load_table()
    groups = shape_groups(model, dtype)
    todo = {}
    for key, layers in groups.items():
        storages = _storages(key, dtype)
        entry = table.get(key, {})
        # an entry timed over another set of paths (a path added or gone) is timed again
        missing = [r for r in rows if str(r) not in entry.get("ms", {})] if entry.get("paths") == sorted(PATHS) else list(rows)
        if missing:
            todo[key] = (layers, storages, missing)
    if todo:
        n = sum(len(m) * (2 + len(s)) for _, s, m in todo.values())
        with tqdm(total=n, desc="measuring CPU matmul paths (once per machine)", disable=not progress,
                  leave=False) as bar:
            for key, (layers, storages, missing) in todo.items():
                if table.get(key, {}).get("paths") != sorted(PATHS):
                    table[key] = {"ms": {}, "paths": sorted(PATHS)}
                entry = table[key]
                entry["ms"].update(measure_group(layers, dtype, missing, storages, reps, bar))
                entry["storage"] = _choose_storage(entry["ms"], storages)
            bar.update(n - bar.n)  # the paths left out of larger row counts
        _save_table(table)
    return {key: table[key] for key in groups}


def one_row_seconds(model, dtype, progress: bool = True) -> float:
    """One forward's matmuls at one row, every group at its fastest path of any storage: a floor
    under the forward at any row count (k rows stream the same weights; precision.py prunes by
    it). Only row 1 is measured (entries `tune` completes later, if asked)."""
    table = _load_table()
    groups = shape_groups(model, dtype)
    todo = {key: layers for key, layers in groups.items()
            if table.get(key, {}).get("paths") != sorted(PATHS) or "1" not in table[key]["ms"]}
    if todo:
        with tqdm(total=len(todo), desc="measuring CPU matmul paths at one row (once per machine)",
                  disable=not progress, leave=False) as bar:
            for key, layers in todo.items():
                if table.get(key, {}).get("paths") != sorted(PATHS):
                    table[key] = {"ms": {}, "paths": sorted(PATHS)}
                table[key]["ms"].update(measure_group(layers, dtype, [1], _storages(key, dtype)))
                bar.update(1)
        _save_table(table)
    return sum(len(layers) * min(table[key]["ms"]["1"].values()) for key, layers in groups.items()) / 1e3


def row_invariant_path(model) -> str | None:
    """`rows` where it multiplies every Linear of `model` (bf16 held plain, the extension built): each
    row's sum in one order whatever rows share the call, batch-invariant unpadded (invariance.py)."""
    layers = _linears(model)
    return "rows" if layers and all(m.weight is not None and applies("rows", m.weight.dtype) for m in layers) else None


def use_path(model, path: str | None) -> None:
    """Every Linear of `model` multiplies along `path` at every row count, prompts included; None:
    each takes back its own plan, kept on the layer (so the invariance probe's one-layer shadow and
    the model's runner never disagree on it)."""
    one = Plan("plain", (path,) * (ROWS_TUNED[-1] + 1)) if path is not None else None
    for layer in _linears(model):
        if one is not None:
            if not hasattr(layer, "own_plan"):
                layer.own_plan = layer.plan
            layer.use(one)
        elif hasattr(layer, "own_plan"):
            own = layer.__dict__.pop("own_plan")
            layer.use(own) if own is not None else layer.plain()


def apply(model, entries: dict[str, dict]) -> dict[str, Plan]:
    plans = {}
    for key, layers in shape_groups(model).items():
        plans[key] = plan_from_entry(entries[key])
        for layer in layers:
            layer.use(plans[key])
            layer.__dict__.pop("own_plan", None)  # the tuned plan is its own now (use_path)
    return plans


def optimize(model, progress: bool = True) -> dict[str, Plan]:
    """Tune (cached per machine) and apply the fastest path per shape and row count."""
    return apply(model, tune(model, progress=progress))


def step_seconds(model, entries: dict[str, dict], rows: int = 1, dtype=None) -> float:
    """Matmul time of one forward at `rows` rows with the best paths of each group's storage."""
    total = 0.0
    for key, layers in shape_groups(model, dtype).items():
        storage, times = entries[key]["storage"], entries[key]["ms"][str(rows)]
        total += len(layers) * fastest(times, storage)[0] / 1e3
    return total


def weight_bytes(model) -> int:
    """Bytes of Linear weights one decode step reads (a tied LM head counted once; GGUF blocks
    at their size)."""
    seen, total = set(), 0
    for layer in quant_linear.quant_layers(model):
        for _, w in layer.stored():
            if id(w) not in seen:
                seen.add(id(w))
                total += w.numel()
    for layer in _linears(model):
        w = layer.weight if layer.weight is not None else layer.packed_weight
        if id(w) not in seen:
            seen.add(id(w))
            total += layer.out_features * layer.in_features * w.element_size()
    return total


def matvec_bound(model, repeats: int = 3) -> dict:
    """The memory-bandwidth bound of decoding on this machine, measured: the best of
    `repeats` passes over every Linear of the model with one-row inputs, in forward order,
    through the paths decoding uses. A decode step cannot beat its own matrix-vector work."""
    layers = quant_linear.quant_layers(model) + _linears(model)
    xs = [torch.randn(1, layer.in_features).to(model.dtype) for layer in layers]
    with torch.inference_mode():
        seconds = _time_pass(lambda x, layer: layer(x), None, layers, repeats, xs) * len(layers)
    nbytes = weight_bytes(model)
    return {"weight_bytes": nbytes, "matvec_s": seconds, "matvec_gb_per_s": nbytes / seconds / 1e9,
            "tokens_per_s_bound": 1.0 / seconds}
