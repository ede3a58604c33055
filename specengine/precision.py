"""Each model's precision chosen for its role, from the work the method gives it
(docs/design.md, "Precision per role").

On a CPU, fp32 and bf16 matmuls scale differently with their row count: on AVX2, bf16 is
cheap for one row and costs about k times that for k rows, while fp32 is memory-bound up to
several rows. A draft only ever runs 1-row steps (and a 2-row catch-up); a target verifies
γ+1 rows. So the dtype that wins a 1-row decode may lose a verify, and the right choice is a
pair: for every (target dtype, draft dtype) the method's expected tokens per second is
computed from the measured matmul table (models/cpu_matmul.py) and an assumed acceptance,
over every draft length the method may run, γ = 0 (plain decoding) included. The best pair
is loaded; `Engine.dtype_choice` keeps the grid behind it, and the best pair of every other
method so that a call switching methods can be told what it would gain.

With weights "auto" and a GGUF source, a third setting joins the grid: "gguf", the file's
blocks kept as they are with fp32 activations (models/quant_plan.py measures their kernel per
row count, as cpu_matmul.py measures the float paths). The grid then picks storage and dtype
together, per role: a draft may stay blocks while its target runs bf16.

`SPECENGINE_CPU_DTYPE=float32|bfloat16` forces "auto" to one dtype for both models (CI runs
the tests that depend on the machine's choice both ways).
"""
from __future__ import annotations

import os

import torch

from .errors import SpecEngineError
from .methods.policies import expected_tokens
from . import draft_requant
from .models import cpu_matmul, requant

FORCE_ENV = "SPECENGINE_CPU_DTYPE"
CPU_DTYPES = ("float32", "bfloat16")
GGUF = "gguf"  # the setting "GGUF blocks, fp32 activations"
EXPECTED_ALPHA = 0.7  # acceptance assumed before any round (AutoGammaPolicy's prior)
GAMMA_MAX = 8  # sd's γ auto range (AutoGammaPolicy.gamma_max)
PARALLEL_KS = (2, 3, 4, 5, 6)  # parallelspec k (the shipped drafter's range)


def forced_cpu_dtype() -> str | None:
    value = os.environ.get(FORCE_ENV, "")
    if value and value not in CPU_DTYPES:
        raise SpecEngineError(f"{FORCE_ENV} must be one of {', '.join(CPU_DTYPES)}, got {value!r}", FORCE_ENV)
    return value or None


def setting_of(model) -> str:
    """The grid's name for how `model` is held: "gguf" (blocks), "gguf-q4_0" (a draft's blocks
    requantized, models/requant.py) or its dtype's name."""
    from .models.quant_linear import quant_layers

    if getattr(model, "requantized", None):
        return requant.SETTING
    return GGUF if quant_layers(model) else str(model.dtype).removeprefix("torch.")


def matmul_seconds(model, dtype: str, rows: tuple[int, ...], progress: bool = True):
    """rows -> seconds of one forward's matmuls at that many rows in `dtype` (or "gguf": the
    model's blocks), from the machine's measured table (measured now where missing; cached)."""
    if dtype == GGUF:
        from .models import quant_plan

        return quant_plan.step_seconds(model, rows, progress)
    if dtype == requant.SETTING:  # model: a draft_requant.Candidate
        return model.step_seconds(rows, progress)
    dt = getattr(torch, dtype)
    entries = cpu_matmul.tune(model, rows=rows, progress=progress, dtype=dt)
    return {r: cpu_matmul.step_seconds(model, entries, r, dt) for r in rows}


def one_row_floor(model, dtype: str, progress: bool = True) -> float:
    """Seconds of one forward's matmuls at one row in a float `dtype`: a floor under any width."""
    return cpu_matmul.one_row_seconds(model, getattr(torch, dtype), progress)


# ----------------------------------------------------------------------------- the methods' work
def method_widths(method: str, gamma=None, tree=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(target widths, draft widths) the method's rounds run, for the rows to measure."""
    if method == "ar":
        return (1,), ()
    if tree is not None:
        return (1, tree.nodes + 1), (1, tree.topk, 2)
    if method == "parallelspec":
        ks = (gamma,) if isinstance(gamma, int) else PARALLEL_KS
        return (1, *sorted({k + 1 for k in ks})), tuple(sorted({2 * k for k in ks}))
    gmax = gamma if isinstance(gamma, int) else GAMMA_MAX
    return tuple(range(1, gmax + 2)), (1, 2)


def best_round(method: str, t: dict, d: dict | None, alpha: float, gamma=None, tree=None) -> tuple[float, int]:
    """(expected tokens/s, draft length) of the method's best round from the seconds of a
    target forward `t[width]` and a draft forward `d[width]`; draft length 0 = a plain decode
    (sd's γ auto may choose it, so a losing pair falls back to plain decoding)."""
    plain = 1.0 / t[1]
    if method == "ar" or d is None:
        return plain, 0
    if tree is not None:  # one of K candidates per depth accepted: a chain at 1 - (1 - α)^K
        a_tree = 1 - (1 - alpha) ** tree.topk
        draft = d[1] + (tree.depth - 1) * d[tree.topk]
        return max((expected_tokens(a_tree, tree.depth) / (draft + t[tree.nodes + 1]), tree.depth), (plain, 0))
    if method == "parallelspec":
        ks = (gamma,) if isinstance(gamma, int) else PARALLEL_KS
        return max((expected_tokens(alpha, k) / (d[2 * k] + t[k + 1]), k) for k in ks)
    gammas = (gamma,) if isinstance(gamma, int) else range(0, GAMMA_MAX + 1)
    rates = [(plain, 0) if g == 0 else (expected_tokens(alpha, g) / (d[2] + (g - 1) * d[1] + t[g + 1]), g)
             for g in gammas]
    return max(rates)


# ----------------------------------------------------------------------------- the choice
def choose(target, draft, method: str, gamma=None, tree=None, alpha: float = EXPECTED_ALPHA,
           progress: bool = True, quant: dict | None = None) -> dict:
    """The (target, draft) settings that maximize `method`'s expected tokens/s on this CPU, with
    the grid behind the choice and each other method's best pair. Models in fp32 (as loaded);
    `quant`: {"target": ..., "draft": ...} the same models as GGUF blocks, where the file has them
    (each adds the setting "gguf" for its role), and optionally "requant": the draft's
    `draft_requant.Candidate`, which the caller keeps to build the model the choice names."""
    quant = quant if quant is not None else {}
    t_opts = _options(target, quant.get("target"))
    d_opts = _options(draft, quant.get("draft"))
    # the draft's blocks in fewer bits (models/requant.py): its acceptance scaled by how much less
    # often it agrees with the target than the file's draft does, measured (once; cached)
    alpha_of, agreement = {}, None
    if draft is not None and quant.get("calibration") is not None and requant.offered(quant.get("draft")) \
            and quant.get("target") is not None:
        cand = quant.get("requant") or draft_requant.Candidate(quant["draft"], progress)  # the caller's, if made
        agreement = draft_requant.agreement(quant["target"], quant["draft"], cand.model, quant["calibration"], progress)
        d_opts = {requant.SETTING: cand} if requant.mode() == requant.FORMAT else {**d_opts, requant.SETTING: cand}
        alpha_of[requant.SETTING] = alpha * agreement["requantized"] / max(agreement["file"], 1e-9)
    widths = {m: method_widths(m, gamma if m == method else None, tree if m == method else None)
              for m in ("ar", "sd", "parallelspec")} if draft is not None else {"ar": method_widths("ar")}
    widths.setdefault(method, method_widths(method, gamma, tree))
    t_rows = tuple(sorted({w for tw, _ in widths.values() for w in tw}))
    d_rows = tuple(sorted({w for _, dw in widths.values() for w in dw}))
    opts = {"target": t_opts, "draft": d_opts if draft is not None else {}}
    rows = {"target": t_rows, "draft": d_rows}
    # a float setting beside a role's blocks is first priced at its one-row time for every width (a
    # floor: k rows stream the same weights); measured in full only where that floor could still
    # win some method's grid: the dequantized weights are 2-4x the blocks' bytes, so on most CPUs
    # it cannot, and its full table was most of a first load (70 of 145 s on the AVX2 EPYC)
    sec, floors = {role: {} for role in opts}, set()
    for role, options in opts.items():
        for dt, m in options.items():
            if dt in CPU_DTYPES and quant.get(role) is not None:
                one = one_row_floor(m, dt, progress)
                sec[role][dt], floors = dict.fromkeys(rows[role], one), floors | {(role, dt)}
            else:
                sec[role][dt] = matmul_seconds(m, dt, rows[role], progress)
    grid, best = _grid(widths, method, sec, alpha_of, alpha, gamma, tree, draft is not None, floors)
    need = {(role, dt) for role, dt in floors
            if any(c[role] == dt and c["tokens_per_s"] >= best[c["method"]]["tokens_per_s"] for c in grid)}
    for role, dt in need:
        sec[role][dt] = matmul_seconds(opts[role][dt], dt, rows[role], progress)
    floors -= need
    if need:
        grid, best = _grid(widths, method, sec, alpha_of, alpha, gamma, tree, draft is not None, floors)
    chosen = best[method]
    return {"target": chosen["target"], "draft": chosen["draft"] if draft is not None else None,
            "method": method, "why": "measured", "expected_alpha": alpha,
            "predicted_tokens_per_s": chosen["tokens_per_s"], "predicted_gamma": chosen["gamma"],
            "best_by_method": {m: {k: c[k] for k in ("target", "draft", "gamma", "tokens_per_s")}
                               for m, c in best.items()},
            "grid": grid, "matmul_s": {"target": _named(sec["target"]), "draft": _named(sec["draft"])},
            "floored": sorted(f"{role} {dt}" for role, dt in floors),
            **({"draft_agreement": agreement} if agreement else {})}


def _grid(widths: dict, method: str, sec: dict, alpha_of: dict, alpha: float, gamma, tree, has_draft: bool,
          floors: set) -> tuple[list, dict]:
    """Every (method, target setting, draft setting) cell's expected tokens/s, and each method's
    best cell among those priced by measurement alone (a cell priced by a floor is an upper bound,
    marked "floor")."""
    t_sec, d_sec = sec["target"], sec["draft"]
    grid, best = [], {}
    for m in widths:
        kw = dict(gamma=gamma, tree=tree) if m == method else {}
        for tdt in t_sec:
            # cheapest draft step first: on a tie (γ 0 predicted best, where the draft's cost does not
            # enter) the cheapest draft wins, since γ auto may still draft and a plain round catches up
            for ddt in (sorted(d_sec, key=lambda dt: d_sec[dt][1]) if m != "ar" and has_draft else (None,)):
                rate, g = best_round(m, t_sec[tdt], d_sec.get(ddt), min(alpha_of.get(ddt, alpha), 1.0), **kw)
                cell = {"method": m, "target": tdt, "draft": ddt, "gamma": g, "tokens_per_s": rate}
                if ("target", tdt) in floors or ("draft", ddt) in floors:
                    cell["floor"] = True
                elif m not in best or rate > best[m]["tokens_per_s"]:
                    best[m] = cell
                grid.append(cell)
    return grid, best


def _options(model, blocks) -> dict:
    """The settings a role can take: fp32 and bf16 of the float model, and its GGUF blocks where
    the file has them. With blocks, fp32 is not measured: its weights are 4-8x the blocks' bytes
    (Q8_0 down to Q4_K), and at the few rows a decode or verify runs a CPU matmul streams its
    weights, so fp32 cannot win; bf16 (2-4x) can, where tiles make wide rows cheap (AMX)."""
    if blocks is None:
        return {dt: model for dt in CPU_DTYPES}
    return {"bfloat16": model, GGUF: blocks}


def _named(seconds: dict) -> dict:
    return {dt: {str(r): s for r, s in by_rows.items()} for dt, by_rows in seconds.items()}


def forced(dtype: str, has_draft: bool, method: str) -> dict:
    return {"target": dtype, "draft": dtype if has_draft else None, "method": method,
            "why": f"forced by {FORCE_ENV}={dtype}"}


def load_options(setting: str) -> dict:
    """`Engine.from_pretrained` options that load a model in a grid setting."""
    return {"weights": "gguf", "dtype": "float32"} if setting == GGUF else {"weights": "float", "dtype": setting}


def better_setting(choice: dict | None, method: str, target, draft) -> str | None:
    """What a call of `method` would gain from other settings (dtype or GGUF blocks) of the
    loaded `target` / `draft` models, as a sentence naming the setting, or None (no measured
    choice, the same pair, or less than 5% to gain)."""
    best = (choice or {}).get("best_by_method", {}).get(method)
    if best is None:
        return None
    have = {"target": setting_of(target), "draft": setting_of(draft) if draft is not None else None}
    if best["target"] == have["target"] and best["draft"] in (None, have["draft"]):
        return None
    now = next((c["tokens_per_s"] for c in choice["grid"] if c["method"] == method and c["target"] == have["target"]
                and c["draft"] in (None, have["draft"])), None)
    if now is None or best["tokens_per_s"] < 1.05 * now:
        return None
    pair = f"target {best['target']}" + (f", draft {best['draft']}" if best["draft"] else "")
    return (f"method {method!r} is predicted {best['tokens_per_s'] / now:.2f}x faster on this CPU with {pair} "
            f"(this engine chose its dtypes for {choice['method']!r}); load with method={method!r} to get them")
