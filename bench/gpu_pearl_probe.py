"""Why PEARL's first call never ends on a GPU: one variant of it per process, with a line per
round and every thread's stack every few seconds (bench/gpu_first_call.py on an H200 found the
host waiting in the round's one sync for > 75 s after the warm-up: the device never finished).
Variants:
  concurrent  as shipped: the draft on a second stream, both models' CUDA graphs
  serial      the draft and the target one after the other on one stream
  eager       as shipped, without CUDA graphs
Run each in its own process (a hung device does not come back):
  CUDA_LAUNCH_BLOCKING=1 timeout 90 python bench/gpu_pearl_probe.py --variant concurrent
"""
from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

import gpu_e2e as E


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=["concurrent", "serial", "eager"], default="concurrent")
    ap.add_argument("--target", default="qwen2.5-7b", choices=sorted(E.SHAPES))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--stacks-every", type=float, default=10.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = ap.parse_args(argv)
    E.S = E.SMOKE if args.smoke else E.Setup()
    import specengine.generation as G
    import specengine.methods.pearl as P

    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:7.2f} s] {msg}", flush=True)

    if args.variant == "serial":
        P.overlap = lambda device, side, draft_fn, target_fn: (draft_fn(), target_fn())
    read = G.Generation._read

    def traced_read(self, r):
        out = read(self, r)
        say(f"round {self.counters.rounds}: kept {[len(k) for k in out]}, n {[len(x.ids) for x in self.rows]}")
        return out

    G.Generation._read = traced_read
    target, draft = E.random_model(args.target, 0), E.random_model("qwen2.5-0.5b", 1)
    eng = E.fresh_engine(target, draft)
    if args.variant == "eager":
        eng.set_cuda_graphs(False)
    say(f"engine built ({args.variant}, target {args.target})")
    faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
    prompt = E.prompts(1, E.S.spec_ctx)[0]
    for i in range(2):
        with torch.inference_mode():
            out = eng.generate(prompt, method="pearl", max_new_tokens=args.new, ignore_eos=True)
        E.sync()
        st = getattr(out, "stats", {}) or {}
        keys = ("gamma", "rounds", "plain_rounds", "measured_cost_ratio", "round_wall_s", "tokens_per_s")
        say(f"call {i + 1} done: {len(out.token_ids)} tokens, {({k: st.get(k) for k in keys})}")
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
