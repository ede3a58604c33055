"""`bench/gpu_e2e.py --smoke`: every section of the GPU end-to-end benchmark on the CPU with
tiny shapes (graphs through a stand-in capture, torch.compile with dynamo's eager backend), so
that a GPU session (30 minutes, rarely lent) never spends its time on an
error the script would have hit anyway. The figures mean nothing; what is checked is that
every section ran, wrote its rows, and that the rows keep their exactness promises."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.invariance_probe  # the invariant section depends on the probe (CI also forces a refusal)
def test_gpu_e2e_smoke_runs_every_section(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "gpu_e2e.py", "--smoke", "--out", str(out)], cwd=BENCH,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and "errors" not in result
    spec = result["spec"]
    pairs = {r["pair"] for r in spec}
    assert pairs == {"random 1.5b/0.5b", "random 7b/0.5b", "all-accept 1.5b/1.5b copy"}
    providers = {"ar"} | set(result["method_providers"])
    assert len(providers) == 13
    for pair in pairs:
        assert {r["provider"] for r in spec if r["pair"] == pair} == providers, pair
    assert all(r["same_tokens_as_ar"] for r in spec if r["provider"] != "ar")  # lossless, every method
    # the all-accept copy accepts every draft: each sd:γ round commits γ+1 tokens (S.new = 6)
    sd2 = next(r for r in spec if r["pair"].startswith("all-accept") and r["provider"] == "sd:2")
    assert sd2["acceptance_rate"] == 1.0 and sd2["tokens_per_target_forward"] == 3.0
    peers = result["peers"]
    assert len(peers) == 4 and all(r["same_tokens_as_ar"] for r in peers)  # fp32: HF == our ar
    assert {r["variant"] for r in result["ar"]} == {"unfused", "fused", "torch.compile"}
    compiled = [r for r in result["ar"] if r["variant"] == "torch.compile"]
    assert compiled and all(r["dynamo_graphs"] == 1 for r in compiled)  # one shape (batch 1, one context)
    # mode off and auto always run (batch 1 and 2); mode on runs where the probe holds, and a
    # refusal (kernels no padding makes invariant) is recorded with the probe's finding
    inv = result["invariant"]
    refused = [r for r in inv if "refused" in r]
    assert all(r["mode"] == "True" and "batch-invariant mode" in r["refused"] for r in refused)
    assert len(inv) == 6 - len(refused) and len(refused) <= 1
    assert all(r["sd_same_tokens_as_ar"] for r in inv if "refused" not in r)
    if os.environ.get("SPECENGINE_INVARIANT_PROBE") == "refuse":
        assert refused and all(not r["info"]["on"] for r in inv if "refused" not in r)
    assert result["projected"] and all(r["projected"] for r in result["projected"])


def test_kernel_microbenchmarks_run_their_torch_providers(tmp_path):
    """`make bench-kernels` (GPU) shares its files with a CPU check: every case of the fused-op,
    attention and rejection-sampling benchmarks runs once with the torch provider."""
    import os

    env = dict(os.environ, SPECENGINE_BENCH_CPU="1")
    files = ["bench_fused_ops.py", "bench_verify_attention.py", "bench_rejection_sampling.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k",
                           "torch and not compile", "--benchmark-disable"], cwd=BENCH, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
