"""Before/after check for a change that must not change results (a refactor): every method on
the real pair, fixed options (no measured choice), fp32 and bf16, the tokens and acceptance
counters of each call written to JSON. Run it on the old and the new commit, same machine,
and compare the files (only the batch-invariant "auto" decision may differ: it is timed).

    python tools/same_results.py OUT.json
"""
import json
import subprocess
import sys

from specengine import Engine
from specengine.benchmark import environment
from specengine.prompts import humaneval

RUNS = [("ar", {}), ("sd", {"gamma": 3}), ("sd", {"gamma": 3, "policy": "specdec++"}), ("sd", {"tree": "2x3:5"}),
        ("parallelspec", {"gamma": 3}), ("pearl", {"gamma": 3}), ("sd", {"gamma": 2, "temperature": 0.8, "seed": 5})]


def main(out_path: str) -> None:
    out = {"environment": environment(), "command": "python tools/same_results.py " + out_path,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    prompts = [p["prompt"] for p in humaneval(2)]
    for dtype in ("float32", "bfloat16"):
        eng = Engine.from_pretrained("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                                     max_seq_len=512, dtype=dtype, cpu_matmul="linear")
        for method, kw in RUNS:
            for i, prompt in enumerate(prompts):
                r = eng.generate(prompt, max_new_tokens=40, method=method, ignore_eos=True, **kw)
                s = r.stats
                out[f"{dtype} {method} {kw} p{i}"] = [r.token_ids, s.get("accepted_drafts"), s.get("proposed_drafts"),
                                                       s.get("rounds")]
        out[f"{dtype} invariant"] = {k: v for k, v in eng.batch_invariant_info.items() if k != "cost"}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=0)
    print(f"wrote {out_path} ({len(out)} entries)")


if __name__ == "__main__":
    main(sys.argv[1])
