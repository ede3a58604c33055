"""Where a graphed round's time goes on a GPU (issue 35: the first H100 run saw 0.7-1.3 ms of
idle GPU per `ar` round at every model size, against 1.16-1.20 ms for a 0.5B step inside the
draft's whole-chain graph). Per shape (random weights, bf16, batch 1, ctx 512), `ar` with our
CUDA graphs, timed side by side in one process:
  replay      target.decode alone, N times, one sync at the end: the graph's own time
  device      the method's round + cache lengths, N times, one sync at the end: every launch
              of a round but none of the host's reading and bookkeeping
  round       Generation.step, N times: what a user gets (one host sync per round), with the
              rounds overlapped (round k+1 launched before round k is read: a GPU engine's
              default) and without
and, with the profiler, the host's ops per round and a Chrome trace of a few rounds (gzip), so
the gap between one round's sync and the next graph launch can be read off.
`--method sd` measures the 7B/0.5B pair's `sd` γ auto the same way (round and trace only).
python bench/gpu_round_anatomy.py --out DIR [--smoke]
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch

import gpu_e2e as E
from specengine import Engine
from specengine.benchmark import environment


def timed(fn, n: int) -> float:
    E.sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    E.sync()
    return (time.perf_counter() - t) / n


def anatomy(eng, label: str, out: Path, rounds: int, method: str, overlap: bool = False, **kw) -> dict:
    kw = dict(method=method, max_new_tokens=rounds * 8 + 16, ignore_eos=True, **kw)
    prompt = E.prompts(1, E.S.spec_ctx)
    eng.overlap_rounds = overlap
    row = dict(label=label, method=method, overlap=overlap)
    with torch.inference_mode():
        for _ in range(2):  # warm-up: captures, autotuning
            gen, _ = eng._start(prompt, **kw)
            for _ in range(4):
                gen.step()
        gen, _ = eng._start(prompt, **kw)
        gen.step()
        row["round_s"] = timed(gen.step, rounds)
        if method == "ar" and not overlap:
            st, tgt = gen.state, eng.target

            def device_round():
                gen.method.round(st, gen.timer)
                tgt.cache.set_lens(st.n - 1)

            row["device_s"] = timed(device_round, rounds)
            row["replay_s"] = timed(lambda: tgt.decode(st.last_tokens(), attn_len=st.attn_len), rounds)
        gen, _ = eng._start(prompt, **kw)
        gen.step()
        kinds = torch.profiler.ProfilerActivity
        acts = [kinds.CPU, kinds.CUDA] if E.S.device == "cuda" else [kinds.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(8):
                gen.step()
            E.sync()
    row.update(E.host_time(prof, 8))
    if E.S.device == "cuda":
        row.update(E.gpu_busy(prof, 8))
    trace = out / f"trace_{re.sub(r'[^A-Za-z0-9.-]+', '_', label)}.json"  # names a device command returns
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    print(f"{label}: " + "  ".join(f"{k} {row[k] * 1e3:.3f} ms" for k in ("round_s", "device_s", "replay_s",
                                                                         "gpu_busy_s_per_round") if k in row)
          + f"  host ops {row['host_op_calls_per_round']:.0f}/round", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a folder: anatomy.json and the traces")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args(argv)
    E.S = E.SMOKE if args.smoke else E.Setup()
    if E.S.device == "cuda" and not torch.cuda.is_available():
        print("gpu_round_anatomy: needs a CUDA device (--smoke checks the script on a CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(environment=environment(), rows=[])
    draft = E.random_model("qwen2.5-0.5b", 1)
    for name in ("qwen2.5-0.5b", "qwen2.5-7b"):
        model = draft if name == "qwen2.5-0.5b" else E.random_model(name, 0)
        eng = Engine(model, E.NoTokenizer(), draft if model is not draft else None, max_seq_len=E.S.max_seq,
                     max_batch=1, **E.PINNED, batch_invariant=False)
        eng.set_cuda_graphs(True, capture=E.S.capture)
        same = []
        for overlap in (False, True):  # the overlapped driver against the plain one, on this device
            eng.overlap_rounds = overlap
            same.append(eng.generate(E.prompts(2, 40), max_new_tokens=24, ignore_eos=True, method="ar"))
        tokens = [[r.token_ids for r in out] for out in same]
        result.setdefault("overlap_same_tokens", {})[name] = tokens[0] == tokens[1]
        print(f"{name}: overlapped ar gives the plain driver's tokens: {tokens[0] == tokens[1]}", flush=True)
        result["rows"].append(anatomy(eng, f"ar {name}", out, args.rounds, "ar"))
        result["rows"].append(anatomy(eng, f"ar {name} overlapped", out, args.rounds, "ar", overlap=True))
        if model is not draft:
            result["rows"].append(anatomy(eng, f"sd:auto {name}/0.5b", out, args.rounds // 2, "sd", gamma="auto"))
        (out / "anatomy.json").write_text(json.dumps(result, indent=1))
        del eng
        E.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
