"""The GGUF matmul kernels streaming their weights from DRAM at decode and verify widths: the target's
and draft's shapes, each weight cloned past the last-level cache and called in turn, 1 / 5 / 9 rows
(bench/x8_rows.py times the same kernels from cache). What a verify costs against a decode.

    python bench/stream_rows.py --out bench/results/cpu_stream_rows.json [--ext OTHER_BUILD.so --label before] [--isa avx2]

--ext loads another build of specengine._quantext (e.g. one made at an earlier commit), so two
builds are compared with the same script.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch

CASES = [  # (layout, N, K, format): the target's (1.5B) gate/up, down, qkv, lm_head; the draft's (0.5B) down
    ("x8", 17920, 1536, "Q4_K"), ("x8", 1536, 8960, "Q4_K"), ("x8", 1536, 8960, "Q6_K"), ("x8", 2048, 1536, "Q4_K"),
    ("x8", 151936, 1536, "Q6_K"), ("x8", 896, 4864, "Q5_0"), ("rows", 4864, 896, "Q8_0"), ("rows", 1536, 8960, "Q6_K"),
]
ROWS = (1, 5, 9)


def load_ext(path: str | None):
    if path is None:
        from specengine.models.quant_linear import _quantext
        return _quantext
    spec = importlib.util.spec_from_file_location("specengine._quantext", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["specengine._quantext"] = mod
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cpu_stream_rows.json")
    ap.add_argument("--ext", default=None, help="path of another _quantext build to time")
    ap.add_argument("--label", default="this build")
    ap.add_argument("--isa", default=None, help="run another instruction-set copy this CPU can (avx2, avx512, ...)")
    ap.add_argument("--bytes", type=float, default=300e6, help="weight bytes streamed per call round")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args(argv)
    ext = load_ext(args.ext)  # before anything imports the package's own build
    if args.isa:
        ext.set_isa(args.isa)
    import gguf_cpu
    from gguf_cpu import EXT_CODES
    from specengine.benchmark import environment, save
    from specengine.kernels.quant_pack import pack_x8

    report = {"benchmark": "stream_rows", "label": args.label, "ext": args.ext, "environment": environment(),
              "isa": ext.isa(), "rows": list(ROWS), "cases": []}
    for layout, N, K, qt in CASES:
        gguf_cpu.N, gguf_cpu.K = N, K
        b = gguf_cpu.blocks(qt)
        base = pack_x8(b, qt) if layout == "x8" else b.reshape(N, -1).contiguous()
        weights = [base] + [base.clone() for _ in range(max(2, int(args.bytes // base.numel())) - 1)]
        code = EXT_CODES[qt]
        call = (lambda x, w: ext.quant_matmul_x8(x, w, code, N)) if layout == "x8" else (
            lambda x, w: ext.quant_matmul(x, w, code))

        def ms(m: int) -> float:
            x, best = torch.randn(m, K), float("inf")
            for _ in range(args.reps):
                t = time.perf_counter()
                for w in weights:
                    call(x, w)
                best = min(best, time.perf_counter() - t)
            return best * 1e3 / len(weights)

        t = {m: ms(m) for m in ROWS}
        report["cases"].append({"layout": layout, "N": N, "K": K, "format": qt, "ms": [t[m] for m in ROWS],
                                "vs_one_row": [t[m] / t[1] for m in ROWS], "GB_per_s_one_row": base.numel() / t[1] / 1e6})
        print(f"{layout:4s} {qt} {N}x{K}: " + "  ".join(f"{m} rows {t[m]:.3f} ms ({t[m] / t[1]:.2f}x)" for m in ROWS),
              flush=True)
        del weights, base
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
