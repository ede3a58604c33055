"""`make gpu-check GPU_SMOKE=1`: the two device commands rehearsed on the CPU with tiny shapes.
What a GPU session gets back is what lands in $OUT: each part's JSON, log and summary line
the moment the part ends, also when its time limit kills it (then with the sections it
finished). A GPU window is 30 minutes; this is how none of it goes to a script error."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # minutes: in the last tier (conftest.py)


def gpu_check(out: Path, parts: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, OUT=str(out), GPU_SMOKE="1", PYTHON=sys.executable,
                GPU_RESULTS=str(out.parent / "results"), **env)
    return subprocess.run(["make", "-s", "gpu-check", f"GPU_PARTS={parts}"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=900)


def test_the_first_command_returns_each_part_as_it_ends(tmp_path):
    out = tmp_path / "out"
    proc = gpu_check(out, "check e2e-first")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["environment", "check", "e2e-first"]
    assert all("rc=0" in line for line in summary)
    result = json.loads((out / "gpu_e2e_first_cpu.json").read_text())
    assert result["done"] == ["ar"] and "errors" not in result and not result["spec"]  # methods: make gpu-run
    assert {r["model"] for r in result["ar"]} == {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"}
    assert "ar qwen2.5-7b" in (out / "gpu_e2e_first_cpu.summary.txt").read_text()
    with tarfile.open(out / "gpu_check_logs.tar") as logs:  # logs and junit files: one file of the 8 a run returns
        assert {"check.log", "check_cpu.xml", "e2e-first.log"} <= set(logs.getnames())
    assert len([f for f in out.rglob("*") if f.is_file()]) <= 8
    assert json.loads((out / "environment.json").read_text())["device"] == "cpu"


def test_a_part_killed_by_its_limit_still_returns_what_it_finished(tmp_path):
    out = tmp_path / "out"
    proc = gpu_check(out, "e2e-first", E2E_FIRST_TIMEOUT="20", GPU_SMOKE_STALL_AFTER="ar")
    assert proc.returncode != 0  # a killed part fails the command ...
    line = (out / "summary.txt").read_text().splitlines()[-1]
    assert line.startswith("e2e-first: rc=124") and "partial results" in line
    result = json.loads((out / "gpu_e2e_first_cpu.json").read_text())  # ... but its finished sections are there
    assert result["done"] == ["ar"] and len(result["ar"]) == 3 and not result["spec"]


def test_the_second_command_runs_every_part_and_keeps_the_exactness_promises(tmp_path):
    """gpu-tests, e2e-second (every method on the all-accept copy, graphs through a stand-in
    capture, torch.compile with dynamo's eager backend), the kernel microbenchmarks' torch
    providers, a slice of the suite. The figures mean nothing; every section ran, wrote its rows
    and kept its promises."""
    out = tmp_path / "out"
    proc = gpu_check(out, "second")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["environment", "gpu-tests", "e2e-second", "kernels", "suite",
                                                         "suite-interpreter"]
    assert all("rc=0" in line for line in summary)
    assert len([f for f in out.rglob("*") if f.is_file()]) <= 8  # what one device command returns
    result = json.loads((out / "gpu_e2e_second_cpu.json").read_text())
    assert "errors" not in result
    assert result["done"] == ["allaccept", "invariant", "ar-variants", "compile"]
    spec = result["spec"]
    assert {r["pair"] for r in spec} == {"all-accept 1.5b/1.5b copy"}
    assert all(r["same_tokens_as_ar"] for r in spec if r["provider"] != "ar")  # lossless, every method
    assert [r["provider"] for r in spec] == ["ar"] + result["method_providers"] and len(spec) == 18
    # the all-accept copy accepts every draft: each sd:γ round commits γ+1 tokens (S.new = 6)
    sd2 = next(r for r in spec if r["pair"].startswith("all-accept") and r["provider"] == "sd:2")
    assert sd2["acceptance_rate"] == 1.0 and sd2["tokens_per_target_forward"] == 3.0
    assert {r["variant"] for r in result["ar"]} == {"unfused", "fused", "torch.compile"}
    compiled = [r for r in result["ar"] if r["variant"] == "torch.compile"]
    assert compiled and all(r["dynamo_graphs"] == 1 for r in compiled)  # one shape (batch 1, one context)
    check_invariant_rows(result["invariant"])


def check_invariant_rows(inv: list[dict]) -> None:
    """Mode off and auto always run (batch 1 and 2); mode on runs where the probe holds, and a
    refusal (kernels no padding makes invariant) is recorded with the probe's finding."""
    refused = [r for r in inv if "refused" in r]
    assert all(r["mode"] == "True" and "batch-invariant mode" in r["refused"] for r in refused)
    assert len(inv) == 6 - len(refused) and len(refused) <= 1
    assert all(r["sd_same_tokens_as_ar"] for r in inv if "refused" not in r)
    if os.environ.get("SPECENGINE_INVARIANT_PROBE") == "refuse":
        assert refused and all(not r["info"]["on"] for r in inv if "refused" not in r)


@pytest.mark.invariance_probe  # CI also runs this with the probe forced to refuse
def test_the_invariant_section_records_what_the_probe_found(tmp_path):
    out = tmp_path / "inv.json"
    proc = subprocess.run([sys.executable, "gpu_e2e.py", "--smoke", "--only", "invariant", "--out", str(out)],
                          cwd=ROOT / "bench", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["done"] == ["invariant"]
    check_invariant_rows(result["invariant"])


def test_a_method_config_past_its_limit_gives_the_next_its_time(tmp_path):
    """PEARL's warm-up outlasted two H100 runs' parts; a config now stops at its own limit, is
    recorded, and the section goes on with a fresh engine (here pearl:auto stalls).
    Every row is on disk as it lands (RowLog)."""
    out, pair = tmp_path / "spec.json", "all-accept 1.5b/1.5b copy"
    env = dict(os.environ, GPU_SMOKE_STALL_CONFIG=f"{pair} pearl:auto", GPU_CONFIG_LIMIT_S="8")
    proc = subprocess.run([sys.executable, "gpu_e2e.py", "--smoke", "--only", "allaccept", "--out", str(out)],
                          cwd=ROOT / "bench", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(t["pair"], t["provider"]) for t in result["config_timeouts"]] == [(pair, "pearl:auto")]
    done = [r["provider"] for r in result["spec"]]
    assert done == ["ar"] + [p for p in result["method_providers"] if p != "pearl:auto"]  # the rest ran after it
    assert result["done"] == ["allaccept"]
    assert all(r["same_tokens_as_ar"] for r in result["spec"] if r["provider"] != "ar")
    assert f"STOPPED {pair} pearl:auto" in out.with_suffix(".summary.txt").read_text()


def test_rows_are_on_disk_before_the_section_ends(tmp_path):
    """A part killed outright (SIGKILL, past the SIGTERM grace) keeps every row that landed:
    the JSON is written at each row, not at the section's end."""
    import signal
    import time

    out = tmp_path / "spec.json"
    pair = "all-accept 1.5b/1.5b copy"
    env = dict(os.environ, GPU_SMOKE_STALL_CONFIG=f"{pair} sd:3", GPU_CONFIG_LIMIT_S="600")
    proc = subprocess.Popen([sys.executable, "gpu_e2e.py", "--smoke", "--only", "allaccept", "--out", str(out)],
                            cwd=ROOT / "bench", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rows, deadline = [], time.time() + 120
        while time.time() < deadline and (pair, "sd:2") not in rows:
            time.sleep(0.5)
            if out.exists():
                try:
                    rows = [(r["pair"], r["provider"]) for r in json.loads(out.read_text())["spec"]]
                except ValueError:  # caught mid-write
                    continue
        assert proc.poll() is None  # still inside the section (stalled in sd:3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert rows == [(pair, "ar"), (pair, "sd:auto"), (pair, "sd:2")]
