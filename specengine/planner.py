"""The engine's plan: every choice made by measuring this machine, in one immutable record
(docs/design.md, "The plan"). `engine.plan` returns it; `specengine plan` prints it.

What is measured, and where it is filed: the CPU matmul paths per shape and row count
(models/cpu_matmul.py) and the GGUF blocks' costs, layouts, the cache their weight stream is
prefetched into and, on a CPU with AMX, whether the kernels' tile copy beats their vector copy
(models/quant_plan.py), which
the precision per role is computed from (precision.py); the step costs that γ "auto",
PEARL's window and hybrid's deferred draft prefill are chosen by (runtime/step_costs.py). Each
files its results in the machine's one table (machine.py: one key from the CPU, instruction
sets, threads, torch and the kernels' digest), so a second load on the same machine measures
nothing again. The batch-invariant probe (runtime/invariance.py)
runs per engine and is not filed; which executor runs each CPU model's layers
(models/cpu_stack.py) is decided, not measured, as is holding the CPU weights in 2 MiB pages
(huge_pages.py: the engine's `huge_pages`). On a GPU, `Engine.warmup()` times each model's step
with cuBLAS and with the fused few-row linears and keeps the faster (runtime/kernel_choice.py; not
filed). The plan reads them back from the engine; no choice is made here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import huge_pages, machine


@dataclass(frozen=True)
class Plan:
    key: str  # the machine table's key (machine.py)
    machine: dict
    precision: dict | None  # each role's setting and why (engine.dtype_choice, without the grid)
    ops: dict  # role -> {op: implementation} (kernels/ops.py names)
    linears: dict  # role -> {shape group: {"storage", "paths": {rows: path}, "ms": {rows: ms of that path}}}
    layouts: dict  # role -> {"<qtype>:<rows>x<cols>": "x8" | "rows"} (GGUF blocks)
    invariance: dict  # batch-invariant mode: on, pad width, why, cost
    forward: dict  # role -> what runs its layers on a CPU: the compiled layer stack or the Python loop, and why
    step_costs: dict  # batch -> {"draft_s", "target_s" and "draft_widths_s": per width, "draft_prefill_s": per token}
    tiles: dict | None = None  # AMX: the copy running and each copy's ms at 32 rows (quant_plan.choose_tiles)
    prefetch: dict | None = None  # the weight stream's prefetch ("l2@2048": cache, bytes ahead), each setting's pass ms
    pages: dict | None = None  # role -> CPU weights moved into 2 MiB pages (bytes, seconds), or why not
    huge_bytes: int = 0  # of the held weights, the bytes the kernel backs with huge pages now
    gemv: dict | None = None  # role -> {"chosen": "torch" | "triton", "ms": each one's graphed step} (GPU warmup)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        m = self.machine
        out = [f"plan for {m['cpu']} ({m['isa']}; kernels {m['kernels'] or 'torch only'}), {m['threads']} threads, "
               f"torch {m['torch']}", f"  table: {self.key}"]
        if self.precision:
            p = self.precision
            out.append(f"precision: target {p.get('target')}, draft {p.get('draft')} ({p.get('why')})"
                       + (f", predicted {p['predicted_tokens_per_s']:.1f} tok/s at γ {p['predicted_gamma']}"
                          if p.get("predicted_tokens_per_s") else ""))
            if p.get("draft_agreement"):
                a = p["draft_agreement"]
                out.append(f"  draft agrees with the target on {a['file']:.0%} of {a['tokens']} tokens as the file holds it, "
                           f"{a['requantized']:.0%} in Q4_0 (its acceptance in the grid scaled by the ratio)")
            if p.get("floored"):
                out.append(f"  not measured past one row (its one-row time at every width still loses): "
                           + ", ".join(p["floored"]))
        for role, names in self.ops.items():
            out.append(f"{role} ops: " + ", ".join(f"{op}={impl}" for op, impl in sorted(names.items())))
        for role, g in (self.gemv or {}).items():
            why = g.get("why") or (f"a graphed step {g['ms']['torch']:.3f} ms with cuBLAS, {g['ms']['triton']:.3f} ms "
                                   f"with the fused kernel")
            out.append(f"{role} few-row linears: {'fused kernel' if g['chosen'] == 'triton' else 'cuBLAS'} ({why})")
        for role, how in self.forward.items():
            out.append(f"{role} layers: {how}")
        for role, groups in self.linears.items():
            for group, g in groups.items():
                paths = " ".join(f"{r}:{p}" for r, p in g["paths"].items())
                out.append(f"{role} linear {group} [{g['storage']}]: {paths}")
        if self.tiles:
            out.append(f"kernel copy: {self.tiles['running']} (Q4_K at 32 rows: "
                       + ", ".join(f"{isa} {ms:.3f} ms" for isa, ms in self.tiles["ms"].items()) + ")")
        if self.prefetch:
            p = self.prefetch
            level, _, ahead = p["running"].partition("@")
            timed = ("; a pass over the GGUF layers at " + " / ".join(next(iter(p["ms"].values()))) + " rows: "
                     + ", ".join(f"{s} " + " / ".join(f"{ms:.1f}" for ms in by.values()) + " ms"
                                 for s, by in sorted(p["ms"].items(), key=lambda kv: sum(kv[1].values())))
                     if p.get("ms") else " (not timed: no model yet large enough to stream from memory)")
            out.append(f"weight stream prefetched into {level}" + (f", {ahead} bytes ahead" if ahead else "") + timed)
        if self.pages:
            out.append("weights in 2 MiB pages: " + ", ".join(
                f"{role} {h['bytes'] / 2**30:.2f} GiB (moved in {h['seconds']:.1f} s)" if "bytes" in h
                else f"{role} none ({h['why_not']})" for role, h in self.pages.items())
                + f"; {self.huge_bytes / 2**30:.2f} GiB backed by huge pages now")
        for role, layouts in self.layouts.items():
            out.append(f"{role} GGUF layouts: " + ", ".join(f"{k}={v}" for k, v in sorted(layouts.items())))
        inv = self.invariance
        out.append(f"batch-invariant: {'on' if inv.get('on') else 'off'} ({inv.get('why')})"
                   + (f", padded to {inv['pad_width']}" if inv.get("pad_width") else "")
                   + (f", every Linear on `{inv['path']}`" if inv.get("path") else ""))
        for batch, c in self.step_costs.items():
            target = ", ".join(f"{1e3 * s:.2f}" for s in c["target_s"])
            prime, dw = c.get("draft_prefill_s"), c.get("draft_widths_s")
            draft = f"[{', '.join(f'{1e3 * s:.2f}' for s in dw)}]" if dw else f"{1e3 * c['draft_s']:.2f}"
            out.append(f"step costs (batch {batch}): draft {'by width ' if dw else ''}{draft} ms, target by width [{target}] ms"
                       + (f", draft prefill {1e3 * prime:.2f} ms a token" if prime else ""))
        return "\n".join(out)


def plan_of(engine) -> Plan:
    """The engine's plan as it stands (step costs appear once a call or `warmup` measured them)."""
    from .kernels import cpu_ext
    from .models import cpu_matmul, cpu_stack, quant_plan
    from .models.quant_linear import quant_layers

    runners = {"target": engine.target} | ({"draft": engine.draft} if engine.draft is not None else {})
    table = machine.load()
    linears, layouts = {}, {}
    for role, runner in runners.items():
        model = runner.model
        groups = {}
        for group, layers in cpu_matmul.shape_groups(model).items():
            plan = layers[0].plan
            if plan is None:
                continue
            ms = table.get(group, {}).get("ms", {})
            paths = {r: plan.by_rows[r] for r in range(1, len(plan.by_rows))}
            groups[group] = {"storage": plan.storage, "paths": paths,
                             "ms": {r: ms[str(r)].get(p) for r, p in paths.items() if str(r) in ms}}
        if groups:
            linears[role] = groups
        lay = {f"{q}:{w.shape[0] if n is None else n}x{layer.in_features}": "x8" if n is not None else "rows"
               for layer in quant_layers(model) for (q, w), n in zip(layer.stored(), layer.packed)}
        if lay:
            layouts[role] = lay
    choice = engine.dtype_choice
    precision = None if choice is None else {k: v for k, v in choice.items() if k not in ("grid", "matmul_s")}
    inv = {k: v for k, v in (engine.batch_invariant_info or {}).items() if k != "costs"}
    costs = {(str(b) if isinstance(b, int) else f"{b[0]} (target alone)"):
             {"draft_s": c.draft_s, "target_s": list(c.target_s), "draft_prefill_s": c.draft_prefill_s,
              "draft_widths_s": list(c.draft_widths_s) if c.draft_widths_s else None}
             for b, c in engine.measured_step_costs.items()}
    # a draft on another device than its target is a CrossDeviceDraft over its own runner
    ops = {role: dict(getattr(r, "runner", r).ops.names) for role, r in runners.items()}
    models = {role: getattr(r, "runner", r).model for role, r in runners.items()}
    forward = {role: cpu_stack.describe(m, ops[role]) for role, m in models.items() if m.device.type == "cpu"}
    tiles = table.get(quant_plan.TILES_ENTRY)
    tiles = {"running": cpu_ext.EXT.isa(), "ms": tiles["ms"]} if tiles else None
    fetch = table.get(quant_plan.PREFETCH_ENTRY)
    prefetch = {"running": quant_plan.prefetch_setting(cpu_ext.EXT), "ms": fetch and fetch["ms"]} \
        if layouts and cpu_ext.has("prefetch") else None  # an older build has no switch: nothing to say
    pages = {role: huge_pages.report(m) for role, m in models.items() if m.device.type == "cpu"}
    return Plan(key=machine.key(), machine=machine.machine(), precision=precision, ops=ops, linears=linears,
                layouts=layouts, invariance=inv, forward=forward, step_costs=costs, tiles=tiles, prefetch=prefetch,
                pages=pages or None, huge_bytes=huge_pages.huge_bytes() if pages else 0,
                gemv=dict(engine.kernel_choice) or None)
