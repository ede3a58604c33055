"""`make gpu-run GPU_SMOKE=1`: the one GPU command rehearsed end to end on the CPU (tiny layers,
the real vocabulary, the committed trace of the real pair). What a GPU session gets back is what
lands in $OUT (at most 8 files): each section's JSON as it ends, also when a section stalls and
its limit stops it; then one screen and the logs. A device window is 15 minutes in all: this
is how none of it goes to a script error."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # minutes: in the last tier (conftest.py)
SECTIONS = ["step", "replay_7b", "replay_1.5b", "peers", "pearl"]


def test_the_command_returns_every_section_and_survives_a_stalled_one(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_SMOKE="1", PYTHON=sys.executable, GPU_SMOKE_STALL="peers",
               SPECENGINE_COMMIT="abc1234")
    proc = subprocess.run(["make", "-s", "gpu-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode != 0  # the stalled section fails the command ...
    summary = (out / "summary.txt").read_text()
    lines = {s: next(line for line in summary.splitlines() if line.startswith(f"{s}: rc=")) for s in SECTIONS}
    assert "rc=124" in lines["peers"] and "stopped by its limit" in lines["peers"]
    assert all("rc=0" in lines[s] for s in SECTIONS if s != "peers"), summary  # ... and the others ran
    files = sorted(f.name for f in out.rglob("*") if f.is_file())
    assert len(files) <= 8 and {"step.json", "replay_7b.json", "replay_1.5b.json", "pearl.json", "summary.txt",
                                "logs.tar"} <= set(files)
    with tarfile.open(out / "logs.tar") as logs:
        assert {"./step.log", "./replay_7b.log", "./pearl.log"} <= set(logs.getnames())

    step = json.loads((out / "step.json").read_text())
    assert step["environment"]["commit"] == "abc1234"  # passed in: the device's copied .git may be stale
    assert [r["model"] for r in step["rows"]] == ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"]
    for name, pair in (("replay_7b.json", "7b/0.5b"), ("replay_1.5b.json", "1.5b/0.5b")):
        rows = json.loads((out / name).read_text())["rows"]
        real = {r["provider"]: r for r in rows if r["trace"] == "real"}
        assert set(real) == {"ar", "sd:2", "sd:3", "sd:4", "sd:auto", "sd:8@specdec++", "parallelspec:4",
                             "sd[tree=4x4:8]", "parallelspec[tree=3x4:8]", "ngram:auto", "hybrid:auto"}
        assert all(r["pair"] == pair and r["same_tokens_as_trace"] for r in rows)  # the real pair's tokens
        assert real["sd:4"]["tokens_per_target_forward"] > 1.5  # the real pair's acceptance, not random's
        rejecting = {r["provider"]: r for r in rows if r["trace"] == "rejecting"}
        assert set(rejecting) == {"ar", "sd:auto", "hybrid:auto"}
    pearl = json.loads((out / "pearl.json").read_text())["rows"]
    assert {(r["pair"], r["trace"], r["provider"]) for r in pearl} >= {("7b/0.5b", "real", "pearl"),
                                                                       ("1.5b/0.5b", "rejecting", "pearl")}
    assert all(r["same_tokens_as_trace"] for r in pearl)
    assert "sd:auto" in summary and "x HF" in summary  # the one screen


@pytest.mark.parametrize("blocked", ["pytest", "pytest_benchmark", "specengine._quantext"])
def test_the_command_imports_nothing_the_gpu_machine_may_lack(blocked, tmp_path):
    """The device runs its own image's packages and no extension build: the command's script loads
    (`--help`, after every import) without pytest (it once came in through gpu_kernels ->
    bench/ops/verify_attention), the pytest-benchmark plugin, or our compiled CPU extension. Run as
    scripts/gpu_run.sh runs it, with the module made unimportable at start-up (sitecustomize: a
    module set to None in sys.modules raises ImportError when imported)."""
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{blocked!r}] = None\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "bench/gpu_replay.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "section" in proc.stdout, proc.stderr[-2000:]


def test_the_one_screen_sets_each_gemv_row_beside_cublas_and_the_timed_choice(tmp_path):
    """The step rows a GPU run writes (CUDA only, so the smoke above has none): the fused few-row
    linears' step as a ratio of the same shape's cuBLAS step, and warmup()'s own timed choice."""
    step = [dict(model="qwen2.5-0.5b", variant="fused", step_s=1e-3, kernels_per_step=300),
            dict(model="qwen2.5-0.5b", variant="fused+gemv", step_s=0.8e-3, kernels_per_step=180),
            dict(model="qwen2.5-0.5b", variant="timed choice", gemv={"chosen": "triton",
                                                                     "ms": {"torch": 1.01, "triton": 0.79}}),
            dict(model="qwen2.5-7b", variant="timed choice", gemv=None)]
    (tmp_path / "step.json").write_text(json.dumps({"rows": step}))
    proc = subprocess.run([sys.executable, "bench/gpu_replay.py", "table", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fused+gemv" in proc.stdout and "x cuBLAS 1.25" in proc.stdout
    assert "timed choice: triton (torch 1.010 ms, triton 0.790 ms)" in proc.stdout
    assert "qwen2.5-7b    timed choice: none ()" in proc.stdout
