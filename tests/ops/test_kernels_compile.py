"""Every Triton kernel compiles ahead of time for sm_90 and sm_80 with the real compiler
(no GPU needed), and its registers / shared memory / local memory are read from the cubin.

Runs `python -m specengine.kernels.compile_check` in a subprocess: under the interpreter
(TRITON_INTERPRET=1, how the other kernel tests run here) `triton.jit` gives no
compilable function."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("cc") / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "specengine.kernels.compile_check", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-2000:]
    return json.loads(out.read_text())["results"]


KERNELS = {"verify_attention", "merge_splits", "rejection_sample", "split_stats", "split_accept", "split_race",
           "split_finalize", "draft_sample", "add_rms_norm", "silu_and_mul", "rope_kv_write", "commit_tokens",
           "quant_matmul", "fused_linear"}
INTEGER_ONLY = {"split_finalize", "commit_tokens"}  # no float operand: compiled once, dtype "any"


def test_every_kernel_variant_compiles_for_both_targets(report):
    failed = [(v["kernel"], v["target"], v["params"], v["error"]) for v in report if v["error"]]
    assert not failed
    assert {v["kernel"] for v in report} == KERNELS
    for kernel in KERNELS:
        targets = {v["target"] for v in report if v["kernel"] == kernel}
        dtypes = {v["params"]["dtype"] for v in report if v["kernel"] == kernel}
        assert targets == {"sm_90", "sm_80"}
        assert dtypes == ({"any"} if kernel in INTEGER_ONLY else {"fp32", "fp16", "bf16"})
    assert {(v["params"]["HAS_TREE"], v["params"]["SPLIT"]) for v in report if v["kernel"] == "verify_attention"} \
        == {(False, False), (False, True), (True, False), (True, True)}


def test_resources_are_read_and_fit_the_targets(report):
    limits = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
    for v in report:
        assert 0 < v["regs"] <= 255 and 0 <= v["shared"] <= limits[v["target"]], v  # elementwise: none


def test_no_kernel_spills(report):
    """The stated limit (compile_check.LOCAL_LIMIT_BYTES) is zero bytes of local memory."""
    spills = [(v["kernel"], v["target"], v["params"], v["local"]) for v in report if v["local"] > 0]
    assert not spills


def test_every_block_m_the_launcher_picks_has_a_spill_free_config():
    """The autotuner prunes to the SPILL_FREE table: it must leave a config for each BLOCK_M
    the launcher can pick (fp32 never gets BLOCK_M 64, for which none compiles spill-free)."""
    import torch

    from specengine.kernels import verify_attention as va

    for dtype, kind in ((torch.float16, "half"), (torch.bfloat16, "half"), (torch.float32, "fp32")):
        for rows in range(1, 257):  # every packed row count (32 once had no config: GPU bring-up)
            bm = va.block_m_for(rows, dtype)
            assert any(va.spill_free(kind, bm, n, w) for n in (16, 32, 64) for w in (4, 8)), (dtype, rows)


def test_exit_status_tells_spills_from_variants_that_do_not_compile(monkeypatch, capsys):
    """0: all pass; 1: some spill (reported, as under the GPU machine's older Triton); 2: some do not
    compile (what `make gpu-rehearsal` fails on)."""
    from specengine.kernels import compile_check as cc

    ok = cc.Variant("k", "sm_90", {"dtype": "fp32"}, regs=32, shared=0, local=0)
    spill = cc.Variant("k", "sm_90", {"dtype": "fp16"}, regs=128, shared=0, local=16)
    broken = cc.Variant("k", "sm_80", {"dtype": "bf16"}, error="ptxas failed")
    for results, rc in (([ok], 0), ([ok, spill], 1), ([ok, spill, broken], 2), ([broken], 2)):
        monkeypatch.setattr(cc, "run", lambda full, r=results: r)
        assert cc.main([]) == rc
    assert "do not compile" in capsys.readouterr().err
