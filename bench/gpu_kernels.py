"""Kernel microbenchmarks on a GPU against their baselines, in one run (scripts/gpu_check.sh).

- rejection sampling (V 151936, B 1/8/32, K 3/7, greedy and sampled): Triton vs the torch
  reference and the memory roofline (logits + draft probs read once / measured bandwidth);
- chain verification attention vs SDPA, contexts 512..16384 (Qwen2.5-1.5B and 7B heads);
- tree verification (32 and 64 nodes) vs SDPA with an explicit mask;
- compact_kv: the CUDA extension vs the torch fallback.
Times are medians of triton.testing.do_bench (CUDA events). Inputs are rotated over enough
copies to exceed the L2 cache, so a kernel is not timed reading its input from cache.
Writes JSON: python bench/gpu_kernels.py --out bench/results/gpu_kernels_h100.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from specengine.benchmark import environment
from specengine.kernels import rejection_sample_ref, verify_attention_ref
from specengine.kernels.rejection_sampling import rejection_sample
from specengine.kernels.verify_attention import verify_attention
from specengine.runtime.kv_compact import compact_kv, extension_available

sys.path.insert(0, str(Path(__file__).resolve().parent / "ops"))  # the kernel benchmarks' folder
from baselines import binary_tree_mask, sdpa  # noqa: E402  SDPA with an explicit mask: the baseline

HEADS = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}
L2_BYTES = 200 << 20  # rotate inputs past this many bytes (H100 L2 is 50 MB, H200 60 MB)


def bench(fn_for, sets: int) -> float:
    """Median µs of fn_for(i) cycling over `sets` input sets."""
    state = {"i": 0}

    def call():
        fn_for(state["i"] % sets)
        state["i"] += 1
    return do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3


def bench_graph(fn) -> float | None:
    """Median µs of fn replayed from a CUDA graph: GPU time without the host's launch cost (one
    input set: small inputs may sit in L2). None if fn cannot be captured."""
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    except Exception:  # e.g. a host sync inside fn
        torch.cuda.synchronize()
        return None


def copies(nbytes: int) -> int:
    return max(1, min(16, math.ceil(L2_BYTES / max(nbytes, 1))))


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted): the practical ceiling."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def rejection_rows(rows: list, bw: float) -> None:
    V = 151936
    for B in (1, 8, 32):
        for K in (3, 7):
            for temperature in (0.0, 1.0):
                nbytes = B * (K + 1) * V * 4 + (B * K * V * 4 if temperature else 0)
                n = copies(nbytes)
                logits = [torch.randn(B, K + 1, V, device="cuda") for _ in range(n)]
                q = [torch.softmax(torch.randn(B, K, V, device="cuda"), -1) if temperature else None for _ in range(n)]
                drafts = torch.randint(0, V, (B, K), device="cuda")
                nd = torch.full((B,), K, dtype=torch.int32, device="cuda")
                temp = torch.full((B,), temperature, device="cuda")
                seed = torch.arange(B, dtype=torch.int64, device="cuda")
                off = torch.zeros((), dtype=torch.int64, device="cuda")
                out_t = rejection_sample(logits[0], drafts, q[0], nd, temp, seed, off)
                out_r = rejection_sample_ref(logits[0], drafts, q[0], nd, temp, seed, off)
                same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(out_t, out_r))
                t_triton = bench(lambda i: rejection_sample(logits[i], drafts, q[i], nd, temp, seed, off), n)
                t_torch = bench(lambda i: rejection_sample_ref(logits[i], drafts, q[i], nd, temp, seed, off), n)
                g_triton = bench_graph(lambda: rejection_sample(logits[0], drafts, q[0], nd, temp, seed, off))
                g_torch = bench_graph(lambda: rejection_sample_ref(logits[0], drafts, q[0], nd, temp, seed, off))
                roof = nbytes / bw * 1e6
                rows.append(dict(op="rejection_sampling", B=B, K=K, V=V, temperature=temperature, bytes=nbytes,
                                 triton_us=t_triton, torch_us=t_torch, roofline_us=roof,
                                 triton_graph_us=g_triton, torch_graph_us=g_torch,
                                 x_roofline=t_triton / roof, speedup_vs_torch=t_torch / t_triton,
                                 same_tokens_as_reference=same))
                print(f"rejection B={B:2d} K={K} T={temperature}: triton {t_triton:8.1f} us  torch {t_torch:8.1f} us"
                      f"  roofline {roof:7.1f} us  ({t_triton / roof:.2f}x roof, {t_torch / t_triton:.1f}x torch)"
                      f"  graph: triton {g_triton} torch {g_torch}  same={same}", flush=True)
                del logits, q


def _sdpa_flash(q, kx, vx):
    """SDPA's fused path: bottom-right causal (the chain) on K/V already expanded to the query
    heads and cut at the valid length (equal lengths), so flash / memory-efficient kernels apply."""
    from torch.nn.attention.bias import causal_lower_right

    Q, S = q.shape[1], kx.shape[2]
    mask = causal_lower_right(Q, S) if Q > 1 else None
    return F.scaled_dot_product_attention(q.transpose(1, 2), kx, vx, attn_mask=mask).transpose(1, 2)


def attention_rows(rows: list) -> None:
    dt = torch.bfloat16
    # chain at batch 1 first (the fused step's goal: <= 1.0x the best SDPA), then batch 8, then trees
    cases = [("chain", m, B, Q, ctx) for B in (1, 8) for m in HEADS for Q in (1, 5, 9) for ctx in (512, 4096, 16384)]
    cases += [("tree", "qwen2.5-1.5b", B, nodes, ctx) for B in (1, 8) for nodes in (32, 64) for ctx in (1024, 4096)]
    for kind, model, B, Q, ctx in cases:
        Hq, Hkv, D = HEADS[model]
        S = ctx + Q
        nbytes = 2 * B * S * Hkv * D * 2
        n = copies(nbytes)
        qs = [torch.randn(B, Q, Hq, D, device="cuda", dtype=dt) for _ in range(n)]
        ks = [torch.randn(B, S, Hkv, D, device="cuda", dtype=dt) for _ in range(n)]
        vs = [torch.randn(B, S, Hkv, D, device="cuda", dtype=dt) for _ in range(n)]
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        tree = binary_tree_mask(Q, "cuda") if kind == "tree" else None
        ref = verify_attention_ref(qs[0].float(), ks[0].float(), vs[0].float(), lens, tree)
        got = verify_attention(qs[0], ks[0], vs[0], lens, tree)
        err = float((got.float() - ref).norm() / ref.norm())
        row = dict(op=f"verify_attention_{kind}", model=model, B=B, Q=Q, ctx=ctx, bytes=nbytes, rel_err=err)
        row["triton_us"] = bench(lambda i: verify_attention(qs[i], ks[i], vs[i], lens, tree), n)
        row["sdpa_mask_us"] = bench(lambda i: sdpa(qs[i], ks[i], vs[i], lens, tree), n)
        row["triton_graph_us"] = bench_graph(lambda: verify_attention(qs[0], ks[0], vs[0], lens, tree))
        row["sdpa_mask_graph_us"] = bench_graph(lambda: sdpa(qs[0], ks[0], vs[0], lens, tree))
        if kind == "chain":
            G = Hq // Hkv
            kx = [k.transpose(1, 2).repeat_interleave(G, 1).contiguous() for k in ks]
            vx = [v.transpose(1, 2).repeat_interleave(G, 1).contiguous() for v in vs]
            row["sdpa_fused_us"] = bench(lambda i: _sdpa_flash(qs[i], kx[i], vx[i]), n)
            row["sdpa_fused_graph_us"] = bench_graph(lambda: _sdpa_flash(qs[0], kx[0], vx[0]))
            del kx, vx
        best = min(v for k, v in row.items() if k.startswith("sdpa") and k.endswith("_us") and "graph" not in k)
        row["sdpa_best_us"], row["x_sdpa_best"] = best, row["triton_us"] / best
        gbest = [v for k, v in row.items() if k.startswith("sdpa") and k.endswith("graph_us") and v]
        if gbest and row["triton_graph_us"]:
            row["sdpa_best_graph_us"] = min(gbest)
            row["x_sdpa_best_graph"] = row["triton_graph_us"] / min(gbest)
        print(f"{kind:5s} {model:13s} B={B} Q={Q:2d} ctx={ctx:5d}: triton {row['triton_us']:7.1f} us  "
              f"sdpa best {best:7.1f} us ({row['x_sdpa_best']:.2f}x)  graph: triton {row['triton_graph_us']} "
              f"sdpa {row.get('sdpa_best_graph_us')} ({row.get('x_sdpa_best_graph')})  err {err:.1e}", flush=True)
        rows.append(row)
        del qs, ks, vs


def compact_rows(rows: list) -> None:
    for model, (L, H, D) in {"qwen2.5-1.5b": (28, 2, 128), "qwen2.5-7b": (28, 4, 128)}.items():
        for count in (4, 16):
            B, S = 4, 4096
            kv = torch.randn(L, 2, B, S, H, D, dtype=torch.bfloat16, device="cuda")
            src = (3000 + torch.arange(count, device="cuda") * 2)[None].expand(B, count).contiguous()
            dst = torch.full((B,), 3000, dtype=torch.int32, device="cuda")
            cnt = torch.full((B,), count, dtype=torch.int32, device="cuda")
            row = dict(op="compact_kv", model=model, B=B, count=count, bytes=2 * L * 2 * B * count * H * D * 2)
            for backend in ("ext", "torch"):
                if backend == "ext" and not extension_available():
                    continue
                row[f"{backend}_us"] = bench(lambda i: compact_kv(kv, src, dst, cnt, backend=backend, check=False), 1)
                row[f"{backend}_graph_us"] = bench_graph(lambda: compact_kv(kv, src, dst, cnt, backend=backend,
                                                                            check=False))
            print(f"compact_kv {model} count={count}: {row}", flush=True)
            rows.append(row)


def quant_rows(rows: list, bw: float) -> None:
    """GGUF blocks on the GPU (issue 38): the 1.5B target's gate/up (17920 x 1536) as Q4_K and its
    LM head shape as Q6_K, 1 / 5 / 9 / 16 rows, against bf16 F.linear on the same shape."""
    from specengine.kernels.quant_matmul import FORMATS, quant_matmul_triton

    for qtype, (N, K) in (("Q4_K", (17920, 1536)), ("Q6_K", (151936, 1536))):
        values, nbytes = FORMATS[qtype]
        w = torch.randint(0, 256, (N, K // values * nbytes), dtype=torch.uint8, device="cuda")
        w.view(N, K // values, nbytes)[..., 0:2] = torch.tensor([0, 0x20], dtype=torch.uint8, device="cuda")  # d
        dense = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
        for m in (1, 5, 9, 16):
            x = torch.randn(m, K, dtype=torch.bfloat16, device="cuda")
            row = dict(op="quant_matmul", format=qtype, N=N, K=K, rows=m, bytes=w.numel(), copy_bw_Bps=bw)
            row["triton_us"] = bench(lambda i: quant_matmul_triton(x, w, qtype), 1)
            row["triton_graph_us"] = bench_graph(lambda: quant_matmul_triton(x, w, qtype))
            row["bf16_linear_us"] = bench(lambda i: torch.nn.functional.linear(x, dense), 1)
            row["weight_GBps"] = w.numel() / row["triton_us"] / 1e3
            print(f"quant_matmul {qtype} rows={m}: {row}", flush=True)
            rows.append(row)
        del w, dense


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="rejection,attention,compact,quant")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    env = environment()
    env["triton"] = triton.__version__
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    result = {"environment": env, "copy_bandwidth_Bps": bw, "sms": props.multi_processor_count, "rows": []}
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    # attention first: verify vs SDPA at batch 1 is a goal of the fused step (issue 25)
    for part, fn in (("attention", attention_rows), ("rejection", lambda rows: rejection_rows(rows, bw)),
                     ("compact", compact_rows), ("quant", lambda rows: quant_rows(rows, bw))):
        if part in args.only:
            try:
                fn(result["rows"])  # appends row by row
            except Exception as e:  # record and go on: one broken kernel must not hide the rest
                import traceback
                traceback.print_exc()
                result.setdefault("errors", {})[part] = repr(e)
            finally:  # also when a time limit interrupts the run (SIGTERM -> KeyboardInterrupt below)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` -> save what was measured
    sys.exit(main())
