"""Ahead-of-time compilation of every Triton kernel for real GPUs, without a GPU.

The interpreter (how the tests run the kernels on a CPU) accepts code that the real
compiler rejects and says nothing about registers, shared memory or spills. Here each
kernel is compiled with `triton.compile` for `GPUTarget("cuda", 90, 64)` (H100/H200) and
`("cuda", 80, 32)` (A100), for each dtype, autotune config and variant, down to a cubin
(the Triton wheel carries ptxas); `cuobjdump --dump-resource-usage` then reads the
registers, shared memory and local memory (spills) per thread.

    python -m specengine.kernels.compile_check            # representative configs
    python -m specengine.kernels.compile_check --full     # every config (make compile-check)

A variant fails when it does not compile, spills (LOCAL_LIMIT_BYTES of local memory per
thread), or needs more shared memory than the target has. Exit status: 0 all pass, 1 some
spill or overflow shared memory, 2 some do not compile (`make gpu-rehearsal` runs this
under the GPU machine's own, older Triton, where spills are reported and only 2 fails).
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TARGETS = {"sm_90": ("cuda", 90, 64), "sm_80": ("cuda", 80, 32)}
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}  # per block, opt-in maximum
LOCAL_LIMIT_BYTES = 0  # no spills: a kernel that spills on the hot path is a bug here
DTYPES = ("fp32", "fp16", "bf16")
DTORCH = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class Variant:
    kernel: str
    target: str
    params: dict
    regs: int | None = None
    shared: int | None = None
    local: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.local <= LOCAL_LIMIT_BYTES and self.shared <= SHARED_LIMIT[self.target]


def _attention_variants(full: bool):
    """Full: every autotune config the prune keeps, head_dim 64 and 128, every BLOCK_M the
    launcher picks for the dtype. Representative: head_dim 128, BLOCK_M 16, one kept config."""
    from . import verify_attention as va

    for dt, tree, split, window in itertools.product(DTYPES, (False, True), (False, True), (False, True)):
        if window and not (full or (tree and split)):  # representative: one variant with a sliding window
            continue
        kind = "fp32" if dt == "fp32" else "half"
        configs = [dict(BLOCK_N=c.kwargs["BLOCK_N"], num_warps=c.num_warps, num_stages=c.num_stages)
                   for c in va._configs()]
        shapes = [(D, bm) for D in (64, 128) for bm in (16, 64) if va.block_m_for(bm, getattr(torch, DTORCH[dt])) == bm]
        if not full:
            shapes = [(128, 16)]
        for D, BLOCK_M in shapes:
            kept = [c for c in configs if va.spill_free(kind, BLOCK_M, c["BLOCK_N"], c["num_warps"])]
            for cfg in kept if full else kept[:1]:
                p = f"*{dt}"
                sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, lens_ptr="*i32", mask_ptr="*i8" if tree else p, win_ptr="*i32",
                           out_ptr=p, m_part="*fp32", l_part="*fp32", acc_part="*fp32", qk_scale="fp32")
                sig.update({n: "i32" for n in ("s_qb", "s_qq", "s_qh", "s_kb", "s_ks", "s_kh", "s_vb", "s_vs",
                                               "s_vh", "s_ob", "s_oq", "s_oh", "s_mb", "s_mi", "s_mj", "NQ", "G",
                                               "HKV", "NSPLIT", "MPAD", "CHUNK", "FIXED", "S_LOG2")})
                const = dict(D=D, BLOCK_M=BLOCK_M, BLOCK_N=cfg["BLOCK_N"], HAS_TREE=tree, SPLIT=split,
                             IEEE=dt == "fp32", HAS_WINDOW=window)
                yield "verify_attention", va._verify_attention_kernel.fn, sig, const, \
                    dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]), {"dtype": dt, **const, **cfg}
    for dt in DTYPES:
        sig = dict(m_part="*fp32", l_part="*fp32", acc_part="*fp32", out_ptr=f"*{dt}")
        sig.update({n: "i32" for n in ("s_ob", "s_oq", "s_oh", "G", "HKV", "NSPLIT", "MPAD")})
        const = dict(D=128, NS_P=va.MERGE_BLOCK)
        yield "merge_splits", va._merge_splits_kernel, sig, const, dict(num_warps=4), dict(dtype=dt, **const)


def _i32(*names):
    return {n: "i32" for n in names}


def _sampler_variants(full: bool):
    from . import rejection_sampling as rs

    common = dict(drafts_ptr="*i64", num_draft_ptr="*i32", temp_ptr="*fp32", seed_ptr="*i64", offset_ptr="*i64")
    shapes = [(1, 2048, 8), (4, 128, 8), (1, 1024, 8), (1, 2048, 32)] if full else [(1, 2048, 8)]
    for dt, has_q, (bb, bv, bk) in itertools.product(DTYPES, (False, True), shapes):
        q = "*fp32" if has_q else f"*{dt}"
        sig = dict(logits_ptr=f"*{dt}", drafts_ptr="*i64", q_ptr=q, num_draft_ptr="*i32", temp_ptr="*fp32",
                   seed_ptr="*i64", offset_ptr="*i64", out_ptr="*i64", n_acc_ptr="*i32",
                   **_i32("B", "s_lb", "s_lk", "s_db", "s_dk", "s_qb", "s_qk", "s_ob", "K", "V"),
                   KEY_ACCEPT="i64", KEY_SAMPLE="i64")
        const = dict(HAS_Q=has_q, BLOCK_B=bb, BLOCK_V=bv, BLOCK_K=bk)
        yield "rejection_sample", rs._rejection_sample_kernel, sig, const, \
            dict(num_warps=8 if bv >= 2048 else 4), dict(dtype=dt, **const)

    # the vocab-split path (small batches): four kernels
    for dt in DTYPES:
        sig = dict(logits_ptr=f"*{dt}", num_draft_ptr="*i32", temp_ptr="*fp32", m_part="*fp32", s_part="*fp32",
                   a_part="*i64", **_i32("s_lb", "s_lk", "K1", "V", "NSPLIT", "CHUNK"))
        yield "split_stats", rs._split_stats_kernel, sig, dict(BLOCK_V=2048), dict(num_warps=8), \
            dict(dtype=dt, BLOCK_V=2048)
        for has_q in ((False, True) if full else (True,)):
            q = "*fp32" if has_q else f"*{dt}"
            sig = dict(logits_ptr=f"*{dt}", q_ptr=q, **common, n_acc_ptr="*i32", m_part="*fp32", s_part="*fp32",
                       a_part="*i64", end_ptr="*fp32", end_arg_ptr="*i64",
                       **_i32("B", "s_lb", "s_lk", "s_db", "s_dk", "s_qb", "s_qk", "K", "V", "NSPLIT"),
                       KEY_ACCEPT="i64")
            for bb, nsp in ((1, 128), (16, 16)) if full else ((1, 128),):
                const = dict(HAS_Q=has_q, BLOCK_B=bb, NS_P=nsp)
                yield "split_accept", rs._split_accept_kernel, sig, const, dict(num_warps=4), \
                    dict(dtype=dt, **const)
            sig = dict(logits_ptr=f"*{dt}", q_ptr=q, **common, n_acc_ptr="*i32", end_ptr="*fp32", br_part="*fp32",
                       ir_part="*i64", bp_part="*fp32", ip_part="*i64",
                       **_i32("s_lb", "s_lk", "s_db", "s_dk", "s_qb", "s_qk", "K", "V", "NSPLIT", "CHUNK"),
                       KEY_SAMPLE="i64")
            const = dict(HAS_Q=has_q, BLOCK_V=2048)
            yield "split_race", rs._split_race_kernel, sig, const, dict(num_warps=8), dict(dtype=dt, **const)
    sig = dict(drafts_ptr="*i64", temp_ptr="*fp32", n_acc_ptr="*i32", end_arg_ptr="*i64", br_part="*fp32",
               ir_part="*i64", bp_part="*fp32", ip_part="*i64", out_ptr="*i64",
               **_i32("B", "s_db", "s_dk", "s_ob", "K", "NSPLIT"))
    for bb, nsp in ((1, 128), (16, 16)) if full else ((1, 128),):
        const = dict(BLOCK_B=bb, NS_P=nsp, BLOCK_K=8)
        yield "split_finalize", rs._split_finalize_kernel, sig, const, dict(num_warps=4), dict(dtype="any", **const)


def _draft_variants(full: bool):
    from . import draft_sampling as ds

    for dt, greedy in itertools.product(DTYPES, (True, False)):
        sig = dict(logits_ptr=f"*{dt}", s_lb="i32", seed_ptr="*i64", offset_ptr="*i64", tok_ptr="*i64",
                   q_ptr="*fp32", s_qb="i32", conf_ptr="*fp32", temperature="fp32", pos="i32", V="i32", KEY="i64")
        const = dict(GREEDY=greedy, BLOCK_V=4096)
        yield "draft_sample", ds._draft_sample_kernel, sig, const, dict(num_warps=8), dict(dtype=dt, **const)


def _fused_step_variants(full: bool):
    """The fused step's ops at the hidden sizes of the 0.5B / 1.5B / 7B shapes (896, 1536,
    3584 -> BLOCK 1024, 2048, 4096) and head_dim 64 / 128."""
    from . import add_rms_norm as arn
    from . import rope_kv_write as rkv
    from . import silu_and_mul as sm

    for dt, res in itertools.product(DTYPES, (False, True)):
        sig = dict(x_ptr=f"*{dt}", r_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}", s_ptr=f"*{dt}",
                   **_i32("N", "s_x", "s_r", "s_y", "s_s"), eps="fp32")
        for block in (1024, 2048, 4096) if full else (4096,):
            const = dict(HAS_RES=res, BLOCK=block)
            yield "add_rms_norm", arn._add_rms_norm_kernel, sig, const, dict(num_warps=min(16, block // 256)), \
                dict(dtype=dt, **const)
    for dt in DTYPES:
        sig = dict(gu_ptr=f"*{dt}", out_ptr=f"*{dt}", **_i32("I", "s_in", "s_out"))
        yield "silu_and_mul", sm._silu_and_mul_kernel, sig, dict(BLOCK=1024), dict(num_warps=4), \
            dict(dtype=dt, BLOCK=1024)
        sig = dict(qkv_ptr=f"*{dt}", cos_ptr="*fp32", sin_ptr="*fp32", wpos_ptr="*i64", q_ptr=f"*{dt}",
                   k_ptr=f"*{dt}", v_ptr=f"*{dt}", qn_ptr=f"*{dt}", kn_ptr=f"*{dt}", eps="fp32",
                   **_i32("T", "HQ", "HKV", "HALF", "s_qkv", "s_rope", "s_qb", "s_qt", "s_qh", "s_kb", "s_ks", "s_kh"))
        for half, norm in itertools.product((32, 64) if full else (64,), (False, True)):  # NORM: Qwen3 / Gemma 3
            yield "rope_kv_write", rkv._rope_kv_write_kernel, sig, dict(BLOCK_H=half, NORM=norm), \
                dict(num_warps=1), dict(dtype=dt, BLOCK_H=half, NORM=norm)


def _commit_variants(full: bool):
    from . import commit_tokens as ct

    for new in ("i32", "i64"):
        sig = dict(tok_ptr="*i64", n_ptr="*i64", offset_ptr="*i64", active_ptr="*i1", out_ptr="*i64",
                   new_ptr=f"*{new}", **_i32("S", "W", "s_tok", "s_out"))
        yield "commit_tokens", ct._commit_tokens_kernel, sig, dict(BLOCK_W=16), dict(num_warps=1), \
            dict(dtype="any", n_new=new, BLOCK_W=16)


def _quant_variants(full: bool):
    """The GGUF-block matmul: every format it reads, in every activation dtype."""
    from . import quant_matmul as qm

    for fmt, code in qm.CODES.items():
        for dt in DTYPES:
            sig = dict(x_ptr=f"*{dt}", w_ptr="*u8", y_ptr="*fp32", **_i32("M", "N", "K", "row_bytes", "s_xm", "s_ym"))
            const = dict(FMT=code, BLOCK_M=qm.BLOCK_M, BLOCK_N=qm.BLOCK_N, BK=qm.BK, IEEE=dt == "fp32")
            yield "quant_matmul", qm._quant_matmul_kernel, sig, const, dict(num_warps=qm.NUM_WARPS), \
                dict(dtype=dt, format=fmt, **const)


def _gemv_variants(full: bool):
    """The few-row fused linear: each prologue (none, add + RMSNorm, silu-mul), residual and bias, every
    autotune config the prune keeps (representative: the norm with a residual and bias, one config)."""
    from . import fused_linear as fl

    cases = [(fl.NORM, True, True)] + ([(fl.NONE, False, True), (fl.NORM, False, False), (fl.SILU, False, False)]
                                       if full else [])
    for dt, (pro, res, bias) in itertools.product(DTYPES, cases):
        configs = [dict(BLOCK_N=c.kwargs["BLOCK_N"], BK=c.kwargs["BK"], num_warps=c.num_warps, num_stages=c.num_stages)
                   for c in fl.kept(fl._configs(), dt == "fp32")]
        for cfg in configs if full else configs[-1:]:  # representative: the largest tile
            p = f"*{dt}"
            sig = dict(x_ptr=p, r_ptr=p, nw_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, s_ptr=p, **_i32("M", "N", "K"),
                       eps="fp32", **_i32("s_xm", "s_rm", "s_wn", "s_ym", "s_sm"))
            const = dict(PRO=pro, HAS_RES=res, HAS_BIAS=bias, IEEE=dt == "fp32", BLOCK_M=fl.BLOCK_M,
                         BLOCK_N=cfg["BLOCK_N"], BK=cfg["BK"])
            yield "fused_linear", fl._fused_linear_kernel.fn, sig, const, \
                dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]), dict(dtype=dt, **const)


def variants(full: bool = False):
    yield from _attention_variants(full)
    yield from _sampler_variants(full)
    yield from _draft_variants(full)
    yield from _fused_step_variants(full)
    yield from _commit_variants(full)
    yield from _quant_variants(full)
    yield from _gemv_variants(full)


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers, static shared bytes, local bytes) per thread from cuobjdump."""
    import re

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", text.split("Function", 1)[1]))
    return int(fields["REG"]), int(fields["SHARED"]), int(fields["LOCAL"]) + int(fields.get("STACK", 0))


def compile_variant(kernel, fn, sig, const, options, params, target: str) -> Variant:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    v = Variant(kernel, target, params)
    try:
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
        compiled = triton.compile(src, target=GPUTarget(*TARGETS[target]), options=options)
        v.regs, static_shared, v.local = _resource_usage(compiled.asm["cubin"])
        v.shared = max(static_shared, compiled.metadata.shared)
    except Exception as e:  # a compile failure is the finding: report it, keep going
        v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return v


def run(full: bool = False, targets=tuple(TARGETS), progress: bool = True) -> list[Variant]:
    from tqdm.auto import tqdm

    jobs = [(job, t) for job in variants(full) for t in targets]
    return [compile_variant(*job, t) for job, t in tqdm(jobs, desc="compiling Triton kernels", disable=not progress)]


def table(results: list[Variant]) -> str:
    lines = ["kernel | target | variant | regs | shared B | local B | ok", "--- | --- | --- | --- | --- | --- | ---"]
    for v in results:
        params = ", ".join(f"{k}={val}" for k, val in v.params.items())
        lines.append(f"{v.kernel} | {v.target} | {params} | {v.regs} | {v.shared} | {v.local} | "
                     f"{'yes' if v.ok else 'NO: ' + (v.error or 'spills or shared memory')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="every autotune config and shape variant")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    results = run(args.full)
    print(table(results))
    if args.json:
        import platform

        import triton

        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                        cwd=Path(__file__).parent, check=False).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD") or None
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "-dirty"
        env = {"triton": triton.__version__, "python": platform.python_version(), "commit": commit,
               "command": " ".join(sys.argv), "local_limit_bytes": LOCAL_LIMIT_BYTES}
        Path(args.json).write_text(json.dumps({"environment": env, "results": [asdict(v) | {"ok": v.ok}
                                                                               for v in results]}, indent=1) + "\n")
    bad = [v for v in results if not v.ok]
    broken = [v for v in bad if v.error is not None]
    print(f"{len(results) - len(bad)} of {len(results)} variants compile without spills"
          f"{f'; {len(broken)} do not compile' if broken else ''}", file=sys.stderr)
    return 2 if broken else 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
