"""What a forward's GGUF-block matmuls cost on this machine, by row count, measured: the
"gguf" candidate of the precision plan (precision.py), beside the float32 / bfloat16 tables of
cpu_matmul.py. Layers are grouped by formats and shape (every layer's gate/up shares one);
each group is timed on its own blocks at each row count and cached in the machine's one table
(specengine/machine.py), whose key holds the kernels' digest: a new kernel is measured again.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from .. import huge_pages, machine
from . import cpu_matmul
from ..kernels.cpu_ext import TILES, VECTOR, forced_name
from ..kernels.quant_pack import PACKED, pack_x8
from .quant_linear import QuantLinear, _layout_changed, _quantext, quant_layers, quant_matmul, quant_matmul_packed

LAYOUT_ROWS = (1, 4)  # a decode and a typical verify: the layout faster over both is kept
TILES_ENTRY = "gguf:isa:tiles"  # which of the extension's copies TILES / VECTOR runs (choose_tiles)
PREFETCH_ENTRY = "gguf:prefetch"  # the cache the weight stream is prefetched into, how far ahead (choose_prefetch)
PREFETCH_LEVELS = ("l1", "l2")
PREFETCH_DISTANCES = (1024, 2048, 4096, 8192)  # bytes ahead; 4096 until timed (csrc/cpu/common.h)
PREFETCH_SETTINGS = tuple(f"{level}@{ahead}" for level in PREFETCH_LEVELS for ahead in PREFETCH_DISTANCES)


def group_key(formats, layer) -> str:
    """A shape group's entry in the machine table: "gguf:<formats>:<out>x<in>" (the table itself is
    the kernels': its key holds their instruction set and digest, specengine/machine.py)."""
    return f"gguf:{'+'.join(formats)}:{layer.out_features}x{layer.in_features}"


def groups(model) -> dict[str, list[QuantLinear]]:
    """QuantLinear layers keyed by `group_key`."""
    out: dict[str, list] = {}
    for layer in quant_layers(model):
        out.setdefault(group_key(layer.qtypes, layer), []).append(layer)
    return out


def _sample(items: list, nbytes=lambda layer: sum(w.numel() for _, w in layer.stored())) -> list:
    """Items (layers, or weights) enough that a pass streams MIN_PASS_BYTES (all of a smaller group),
    like the float tables: decoding reads weights from memory, never from cache."""
    out, total = [], 0
    for item in items:
        out.append(item)
        total += nbytes(item)
        if total >= cpu_matmul.MIN_PASS_BYTES and len(out) >= 2:
            break
    return out


def measure(layers, rows, reps: int = 2, bar=None) -> dict:
    """{rows: {"blocks": ms per layer}} for one group."""
    import torch

    sample = _sample(layers)
    gen = torch.Generator().manual_seed(0)
    ms = {}
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, layers[0].in_features, generator=gen)
            ms[str(r)] = {"blocks": 1e3 * cpu_matmul._time_pass(lambda x, layer: layer(x), x, sample, reps)}
            if bar is not None:
                bar.update(1)
    return ms


def tune(by_key: dict[str, list], rows, reps: int = 2, progress: bool = True) -> dict[str, dict]:
    """Measured (or cached) entries {key: {"ms": {rows: {"blocks": ms}}}} of every group (`groups`)."""
    table = cpu_matmul._load_table()
    todo = {k: (layers, [r for r in rows if str(r) not in table.get(k, {}).get("ms", {})])
            for k, layers in by_key.items()}
    todo = {k: v for k, v in todo.items() if v[1]}
    if todo:
        with tqdm(total=sum(len(m) for _, m in todo.values()), desc="measuring GGUF block matmuls (once per machine)",
                  disable=not progress, leave=False) as bar:
            for key, (layers, missing) in todo.items():
                table.setdefault(key, {"ms": {}})["ms"].update(measure(layers, missing, reps, bar))
        cpu_matmul._save_table(table)
    return {key: table[key] for key in by_key}


def step_seconds(model, rows, progress: bool = True) -> dict[int, float]:
    """rows -> seconds of one forward's matmuls with the blocks (plus any float Linear the file
    kept unquantized, from the fp32 table)."""
    by_key = groups(model)
    entries = tune(by_key, rows, progress=progress)
    return seconds_of({k: len(layers) for k, layers in by_key.items()}, entries, model, rows, progress)


def seconds_of(counts: dict[str, int], entries: dict, model, rows, progress: bool = True) -> dict[int, float]:
    """rows -> seconds of `counts[key]` layers of each group from their measured `entries`, plus the
    model's float Linear layers (the fp32 table)."""
    floats = cpu_matmul.tune(model, rows=rows, progress=progress) if cpu_matmul._linears(model) else {}
    return {r: sum(n * entries[k]["ms"][str(r)]["blocks"] / 1e3 for k, n in counts.items())
            + (cpu_matmul.step_seconds(model, floats, r) if floats else 0.0) for r in rows}


def _packable(model) -> dict[tuple, list[tuple]]:
    """(qtype, rows, cols) -> [(layer, segment index)] of segments an interleaved layout could hold: a
    format with a kernel for it, on CPU, not shared with the embedding (a tied head keeps the file's
    rows, which the embedding's lookups read)."""
    emb = getattr(getattr(model, "embed_tokens", None), "qweight", None)
    out: dict[tuple, list] = {}
    for layer in quant_layers(model):
        for i, (q, w) in enumerate(layer.stored()):
            if q in PACKED and w.device.type == "cpu" and (emb is None or w.data_ptr() != emb.data_ptr()):
                rows = w.shape[0] if layer.packed[i] is None else layer.packed[i]
                out.setdefault((q, rows, layer.in_features), []).append((layer, i))
    return out


def choose_tiles(ext=_quantext, table: dict | None = None) -> str | None:
    """Where this CPU offers AMX tiles (the extension lists TILES), run the copy that measured faster at
    a prefill width: timed once per machine and kernel build (the machine's table, read here unless
    given), set for this process. Returns the copy chosen, or None where there is no choice (no
    extension, no tiles, another copy set by `set_isa`, or any copy forced by SPECENGINE_ISA)."""
    if ext is None or TILES not in ext.isas() or ext.isa() not in (TILES, VECTOR) or forced_name():
        return None
    table = cpu_matmul._load_table() if table is None else table
    if TILES_ENTRY not in table:
        table[TILES_ENTRY] = {"ms": time_copies(ext, (VECTOR, TILES))}
        cpu_matmul._save_table(table)
    ms = table[TILES_ENTRY]["ms"]
    chosen = min((VECTOR, TILES), key=lambda isa: ms[isa])
    ext.set_isa(chosen)
    return chosen


def time_copies(ext, isas, rows: int = 32, reps: int = 5) -> dict[str, float]:
    """{copy: best ms} of the interleaved Q4_K kernel at `rows` rows (two tile chunks) under each copy, on a
    weight small enough to stay in cache (256 x 2048: what differs between the copies is compute), each
    after a call that wakes the threads (on a 2-core Zen 5 a first call took 15-23 ms, the next 0.1). The
    copy that ran before is set again."""
    import time

    import torch

    from ..kernels.quant_matmul import random_blocks

    n, k = 256, 2048
    w = pack_x8(random_blocks("Q4_K", n, k), "Q4_K")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
    code, before, out = ext.formats()["Q4_K"][0], ext.isa(), {}
    try:
        for isa in isas:
            ext.set_isa(isa)
            ext.quant_matmul_x8(x, w, code, n)
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                ext.quant_matmul_x8(x, w, code, n)
                best = min(best, time.perf_counter() - t)
            out[isa] = 1e3 * best
    finally:
        ext.set_isa(before)
    return out


def set_prefetch(ext, setting: str) -> None:
    """Apply a prefetch setting, "<level>@<bytes ahead>" (a bare level keeps the distance)."""
    level, _, ahead = setting.partition("@")
    ext.set_prefetch(level)
    if ahead and hasattr(ext, "set_prefetch_distance"):
        ext.set_prefetch_distance(int(ahead))


def prefetch_setting(ext) -> str:
    """The prefetch setting running, as `set_prefetch` takes it."""
    return f"{ext.prefetch()}@{ext.prefetch_distance()}" if hasattr(ext, "prefetch_distance") else ext.prefetch()


def filed_prefetch(table: dict | None = None) -> str | None:
    """The fastest prefetch setting this machine's table holds, or None where none was timed."""
    entry = (cpu_matmul._load_table() if table is None else table).get(PREFETCH_ENTRY)
    return None if entry is None else min(entry["ms"], key=lambda s: sum(entry["ms"][s].values()))


def choose_prefetch(model, ext=_quantext, table: dict | None = None, timer=None) -> str | None:
    """Prefetch the weight stream into whichever cache (L1 or L2) and how far ahead (PREFETCH_DISTANCES) a
    pass over this model's GGUF layers runs fastest with, at LAYOUT_ROWS rows: timed once per machine and
    kernel build (the machine's table), on the first model whose blocks are read from memory (more bytes
    than the last-level cache holds: a pass over more than a cache holds misses on every line; and at
    least a timing pass's), in the pages they will run from, set for this process. Returns the setting
    ("l2@2048"), or None where nothing was timed or filed (no extension, or a model small enough to sit in
    cache: its pass says nothing of the stream). `timer(ext, layers)`: `time_prefetch` unless given (tests)."""
    if ext is None or not hasattr(ext, "set_prefetch"):
        return None
    table = cpu_matmul._load_table() if table is None else table
    if PREFETCH_ENTRY not in table:
        layers = [layer for layer in quant_layers(model) if layer.stored()[0][1].device.type == "cpu"]
        nbytes = sum(w.numel() for layer in layers for _, w in layer.stored())
        if nbytes < max(machine.last_level_cache_bytes(), cpu_matmul.MIN_PASS_BYTES):
            return None
        if huge_pages.pending(model) and nbytes >= huge_pages.HUGE:
            return None  # timed once the engine holds the weights in the pages they will run from (`hold`)
        table[PREFETCH_ENTRY] = {"ms": (timer or time_prefetch)(ext, layers), "bytes": nbytes}
        cpu_matmul._save_table(table)
    chosen = filed_prefetch(table)
    set_prefetch(ext, chosen)
    return chosen


def time_prefetch(ext, layers, rounds: int = 3) -> dict[str, dict[str, float]]:
    """{setting: {rows: best ms of one pass over `layers`}} under each prefetch setting, taking turns
    `rounds` times (a VM's bandwidth drifts within a minute); the setting found is set again."""
    import torch

    gen, before, out = torch.Generator().manual_seed(0), prefetch_setting(ext), {}
    xs = {r: {n: torch.randn(r, n, generator=gen) for n in {layer.in_features for layer in layers}}
          for r in LAYOUT_ROWS}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for setting in PREFETCH_SETTINGS:
                    set_prefetch(ext, setting)
                    for r in LAYOUT_ROWS:
                        ms = 1e3 * len(layers) * cpu_matmul._time_pass(
                            lambda x, layer: layer(x[layer.in_features]), xs[r], layers, reps=1)
                        best = out.setdefault(setting, {})
                        best[str(r)] = min(best.get(str(r), ms), ms)
    finally:
        set_prefetch(ext, before)
    return out


def choose_layouts(model, reps: int = 2, progress: bool = True) -> dict[str, str]:
    """Hold each packable shape (`_packable`) in the layout its kernel runs faster at LAYOUT_ROWS rows
    on this machine: measured once per machine and kernel build (the machine's table), never
    assumed; then the weight stream's prefetch level (`choose_prefetch`). Returns
    {"<qtype>:<rows>x<cols>": "x8" | "rows"}."""
    import torch

    if _quantext is None:
        return {}
    table, tag, chosen = cpu_matmul._load_table(), "gguf", {}
    groups_ = _packable(model)
    if groups_:  # only a model with blocks the interleaved kernel runs has a copy to choose (AMX or not)
        choose_tiles(table=table)
    todo = [k for k in groups_ if f"{tag}:layout:{k[0]}:{k[1]}x{k[2]}" not in table]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for q, rows, cols in tqdm(todo, desc="measuring GGUF weight layouts (once per machine)",
                                  disable=not progress or not todo, leave=False):
            sample = _sample(groups_[(q, rows, cols)], lambda seg: seg[0].stored()[seg[1]][1].numel())
            plain = [layer.segments()[i][1] for layer, i in sample]
            packed = [pack_x8(w, q) for w in plain]
            ms = {}
            for r in LAYOUT_ROWS:
                x = torch.randn(r, cols, generator=gen)
                ms[str(r)] = {
                    "rows": 1e3 * cpu_matmul._time_pass(lambda x, w: quant_matmul(x, w, q), x, plain, reps),
                    "x8": 1e3 * cpu_matmul._time_pass(lambda x, w: quant_matmul_packed(x, w, q, rows), x, packed, reps)}
            table[f"{tag}:layout:{q}:{rows}x{cols}"] = {"ms": ms}
        if todo:
            cpu_matmul._save_table(table)
    for (q, rows, cols), segs in groups_.items():
        ms = table[f"{tag}:layout:{q}:{rows}x{cols}"]["ms"]
        best = min(("rows", "x8"), key=lambda lay: sum(ms[str(r)][lay] for r in LAYOUT_ROWS))
        chosen[f"{q}:{rows}x{cols}"] = best
        for layer, i in segs:
            layer.pack_segment(i, best == "x8")
    choose_prefetch(model, table=table)  # on the layouts as they will run
    return chosen


def hold(model) -> None:
    """The engine's model into 2 MiB pages where its `huge_pages` asks (huge_pages.py): the compiled
    layer stack drops the tensors it held, and the prefetch setting, if it waited for the hold, is timed
    now (on the held weights, or on the small pages a refused hold left)."""
    moved = huge_pages.hold(model) is not None
    if moved:
        _layout_changed()
    if moved or huge_pages.refused(model):
        choose_prefetch(model)
