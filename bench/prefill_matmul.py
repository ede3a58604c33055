"""Prefill widths on CPU: the int8 GGUF kernel (file layout and interleaved) against dequantizing
the weight and calling BLAS in fp32, per activation row count, on the target's gate/up shape
17920 x 1536 (random blocks). Why quant_matmul runs the int8 kernel at every width.

    python bench/prefill_matmul.py --out bench/results/cpu_prefill_matmul.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from gguf_cpu import EXT_CODES, K, N, best_ms, blocks
from specengine.benchmark import environment, save
from specengine.kernels.quant_pack import pack_x8
from specengine.models.quant_linear import _dequantize, _quantext, extension_isa

ROWS = (1, 16, 64, 128, 256, 512)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cpu_prefill_matmul.json")
    ap.add_argument("--qtypes", default="Q4_K,Q6_K")
    args = ap.parse_args(argv)
    report = {"environment": environment(), "isa": extension_isa(), "shape": [N, K], "rows": list(ROWS),
              "threads": torch.get_num_threads(), "ms": {}}
    for qtype in args.qtypes.split(","):
        w, code = blocks(qtype), EXT_CODES[qtype]
        wp = pack_x8(w, qtype)
        row = report["ms"][qtype] = {"int8": [], "int8_interleaved": [], "dequantize_blas": []}
        for m in ROWS:
            x = torch.randn(m, K)
            row["int8"].append(best_ms(lambda: _quantext.quant_matmul(x, w, code), 3))
            row["int8_interleaved"].append(best_ms(lambda: _quantext.quant_matmul_x8(x, wp, code, N), 3))
            row["dequantize_blas"].append(best_ms(lambda: x @ _dequantize(w, code, K).T, 3))
            print(qtype, m, {k: round(v[-1], 2) for k, v in row.items()}, flush=True)
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
