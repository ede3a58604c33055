"""GGUF weights kept as blocks vs dequantized, on this CPU, in one run (issue 38's first figures).

1. Kernel: the target's merged gate/up shape (17920 x 1536) per block format, 1 / 5 / 9 rows,
   our compiled kernel (`specengine._quantext`) beside bf16 and fp32 `F.linear` on the same shape.
2. End to end on the real pair (HumanEval prompts, greedy, EOS ignored): `ar`, `sd` γ 3 and
   γ auto with weights="gguf" (fp32 activations) and with weights="float" in bf16 and fp32.
3. With --llamacpp (`make bench-gguf`): llama.cpp on the same files, prompts and threads
   (bench/llamacpp.py): its `ar`, its speculative decoding with the 0.5B draft (draft max 3
   and 6) and its n-gram drafting, decode tokens/s from its own timers.

    python bench/gguf_cpu.py --out bench/results/cpu_gguf_first.json [--n-prompts 2 --max-new-tokens 48]
    python bench/gguf_cpu.py --llamacpp --out bench/results/cpu_gguf_vs_llamacpp.json
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from specengine import Engine
from specengine.benchmark import environment, run_benchmark, save
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.models.quant_linear import EXT_CODES, _quantext, extension_isa

N, K = 17920, 1536
SETTINGS = {"gguf (fp32 activations)": dict(weights="gguf"), "float bf16": dict(weights="float", dtype="bfloat16"),
            "float fp32": dict(weights="float", dtype="float32")}


def best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def blocks(qtype: str) -> torch.Tensor:
    """Random rows of `qtype` blocks with finite scales (what the kernel's speed depends on: the bytes)."""
    from specengine.kernels.quant_matmul import FORMATS

    values, nbytes = FORMATS[qtype]
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, 256, (N, K // values, nbytes), generator=g, dtype=torch.uint8)
    scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,))
    for at in scale_at:
        b[..., at:at + 2] = torch.full((N, K // values), 0.01).half().view(torch.uint8).reshape(N, K // values, 2)
    return b.reshape(N, -1).contiguous()


def kernels() -> list[dict]:
    rows = []
    dense = {dt: torch.randn(N, K).to(dt) for dt in (torch.bfloat16, torch.float32)}
    for m in (1, 5, 9):
        x = torch.randn(m, K)
        for dt, w in dense.items():
            name = f"F.linear {str(dt).removeprefix('torch.')}"
            rows.append(dict(provider=name, rows=m, bytes=w.numel() * w.element_size(),
                             ms=best_ms(lambda: torch.nn.functional.linear(x.to(dt), w))))
        for qtype, code in EXT_CODES.items():
            if qtype in ("Q4_0", "Q5_K"):
                continue  # not in the real files
            w = blocks(qtype)
            rows.append(dict(provider=f"ours {qtype}", rows=m, bytes=w.numel(),
                             ms=best_ms(lambda: _quantext.quant_matmul(x, w, code))))
    for r in rows:
        r["GB_per_s"] = r["bytes"] / r["ms"] / 1e6
        print(f"{r['provider']:18s} rows {r['rows']}: {r['ms']:7.2f} ms  {r['GB_per_s']:5.1f} GB/s of weights", flush=True)
    return rows


def llamacpp_providers(n_prompts: int, new: int) -> dict:
    """llama.cpp's providers on our prompts, threads and files: mean decode tokens/s per provider."""
    import llamacpp
    from specengine.models.gguf_weights import gguf_file
    from specengine.prompts import humaneval

    target, draft, threads = gguf_file(DEFAULT_TARGET), gguf_file(DEFAULT_DRAFT), torch.get_num_threads()
    runs = {"ar": lambda p: llamacpp.ar(target, p, new, threads),
            "draft max 3": lambda p: llamacpp.speculative(target, draft, p, new, threads, "draft-simple", 3),
            "draft max 6": lambda p: llamacpp.speculative(target, draft, p, new, threads, "draft-simple", 6),
            "ngram-simple": lambda p: llamacpp.speculative(target, None, p, new, threads, "ngram-simple", 3)}
    out = {"version": llamacpp.version(), "threads": threads}
    for name, run in runs.items():
        rows = [run(p["prompt"]) for p in humaneval(n_prompts)]
        out[name] = {"decode_tokens_per_s": sum(r["decode_tokens_per_s"] for r in rows) / len(rows), "runs": rows}
        print(f"llama.cpp {name:13s}: {out[name]['decode_tokens_per_s']:6.2f} decode tok/s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_gguf_first.json")
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp's providers (bench/llamacpp.py build first)")
    args = ap.parse_args(argv)
    if _quantext is None:
        print("the quantized kernel is not built (make install builds it)", file=sys.stderr)
        return 2
    report = {"benchmark": "gguf_cpu", "environment": environment(), "kernel_isa": extension_isa(),
              "kernel_shape": [N, K], "kernels": kernels(), "e2e": {}}
    for name, kw in SETTINGS.items():
        eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024, **kw)
        report["e2e"][name] = run_benchmark(eng, ["ar", "sd:3", "sd:auto"], args.n_prompts, args.max_new_tokens)
        del eng
        gc.collect()
    if args.llamacpp:
        report["llamacpp"] = llamacpp_providers(args.n_prompts, args.max_new_tokens)
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
