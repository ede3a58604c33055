"""Where a method's first call goes (graph captures, Triton autotuning, step-cost probes): the
first and second generate of one method on a random pair, timed, the first under cProfile.
The H100 runs of 77df1d5 and e560fac never got past `pearl` inside their limits; on an H200
(b286a30) this script's stack dumps showed the host waiting in the round's sync: a device hang,
fixed in 14fc5bf (docs/design.md, "Model runner and CUDA graphs").
python bench/gpu_first_call.py --method pearl [--target qwen2.5-1.5b] [--smoke]
"""
from __future__ import annotations

import argparse
import cProfile
import faulthandler
import io
import pstats
import signal
import sys
import time

import torch

import gpu_e2e as E


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="pearl")
    ap.add_argument("--target", default="qwen2.5-1.5b", choices=sorted(E.SHAPES))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    ap.add_argument("--limit", type=int, default=120,
                    help="seconds for the first call: past it the profile so far is printed and the script exits")
    ap.add_argument("--stacks-every", type=float, default=20.0,
                    help="dump every thread's stack this often during the first call (shows a stall even inside C)")
    args = ap.parse_args(argv)
    E.S = E.SMOKE if args.smoke else E.Setup()
    if E.S.device == "cuda" and not torch.cuda.is_available():
        print("gpu_first_call: needs a CUDA device (--smoke checks the script on a CPU)", file=sys.stderr)
        return 2
    t = time.perf_counter()
    target, draft = E.random_model(args.target, 0), E.random_model("qwen2.5-0.5b", 1)
    eng = E.fresh_engine(target, draft)  # the engine gpu_e2e's spec section runs (and PEARL stalled in)
    print(f"models and engine: {time.perf_counter() - t:.1f} s", flush=True)
    prompt = E.prompts(1, E.S.spec_ctx)[0]
    kw = dict(method=args.method, max_new_tokens=E.S.new, ignore_eos=True)
    prof = cProfile.Profile()
    for i in range(2):
        t = time.perf_counter()
        if i == 0:
            faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
            signal.signal(signal.SIGALRM, _past_limit)
            signal.alarm(args.limit)
            prof.enable()
        try:
            with torch.inference_mode():
                out = eng.generate(prompt, **kw)
            E.sync()
        except PastLimit:
            prof.disable()
            print(f"{args.method} call 1: past its limit of {args.limit} s; the profile so far:", flush=True)
            _print_profile(prof)
            return 3
        if i == 0:
            prof.disable()
            signal.alarm(0)
            faulthandler.cancel_dump_traceback_later()
        print(f"{args.method} call {i + 1}: {time.perf_counter() - t:.1f} s, {len(out.token_ids)} tokens", flush=True)
        if i == 0:
            _print_profile(prof)
    return 0


class PastLimit(Exception):
    pass


def _past_limit(signum, frame):
    raise PastLimit


def _print_profile(prof) -> None:
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    sys.exit(main())
