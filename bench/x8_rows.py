"""Cost of the interleaved GGUF kernel (csrc/cpu/x8_impl.h) per activation row count, relative to one
row: the target's gate/up shape 17920 x 1536 (random blocks, partly in cache), best of 10 per count.

    python bench/x8_rows.py --out bench/results/cpu_x8_rows.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from gguf_cpu import EXT_CODES, K, N, best_ms, blocks
from specengine.benchmark import environment, save
from specengine.kernels.quant_pack import PACKED, pack_x8
from specengine.models.quant_linear import _quantext, extension_isa


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cpu_x8_rows.json")
    args = ap.parse_args(argv)
    report = {"environment": environment(), "isa": extension_isa(), "shape": [N, K], "ms": {}}
    for qtype in PACKED:
        wp, code = pack_x8(blocks(qtype), qtype), EXT_CODES[qtype]
        ms = [best_ms(lambda: _quantext.quant_matmul_x8(torch.randn(m, K), wp, code, N), 10) for m in range(1, 10)]
        report["ms"][qtype] = ms
        print(qtype, " ".join(f"{m}:{t / ms[0]:.2f}x" for m, t in enumerate(ms, 1)))
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
