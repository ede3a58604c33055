"""The plan (specengine/planner.py): every measured choice of an engine in one immutable record,
read from the engine's own state, and one machine table (specengine/machine.py) that a second
load on the same machine measures nothing into."""
import dataclasses
import json

import pytest
import torch

from specengine import Engine, machine
from specengine.cli import main
from specengine.models import cpu_matmul
from helpers.cache import fresh_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    fresh_cache(monkeypatch, tmp_path)
    return tmp_path


def test_the_plan_says_what_the_engine_runs(tiny_dir, cache):
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128)  # dtype auto: measured
    plan = eng.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.ops = {}
    assert plan.key == machine.key() and machine.cache_path().exists()
    assert plan.precision["target"] in ("float32", "bfloat16") and plan.precision["why"] == "measured"
    assert plan.ops["target"] == dict(eng.ops.names) and set(plan.ops) == {"target", "draft"}
    # every Linear group's path per row count is the one its layers run
    for role, runner in (("target", eng.target), ("draft", eng.draft)):
        for group, layers in cpu_matmul.shape_groups(runner.model).items():
            entry = plan.linears[role][group]
            assert entry["storage"] == layers[0].plan.storage
            assert [entry["paths"][r] for r in sorted(entry["paths"])] == list(layers[0].plan.by_rows[1:])
            assert all(ms is not None and ms > 0 for ms in entry["ms"].values())
    assert plan.invariance["on"] == eng.batch_invariant and "why" in plan.invariance
    # float weights: the Python layer loop, and the plan names the layer and projections that keep it there
    assert plan.forward["target"].startswith("Python layer loop: layer 0's self_attn.qkv_proj, ")
    assert plan.step_costs == {}  # nothing has needed them yet
    eng.warmup()
    costs = eng.plan.step_costs["1"]
    assert costs["draft_s"] > 0 and len(costs["target_s"]) >= 2 and costs["draft_prefill_s"] > 0
    assert len(costs["draft_widths_s"]) == len(costs["target_s"]) and costs["draft_widths_s"][0] == costs["draft_s"]
    text = str(eng.plan)
    assert "precision: target" in text and "step costs (batch 1)" in text and "target linear" in text
    assert "draft prefill" in text  # what hybrid prices its deferred draft prefill at
    assert "target layers: Python layer loop" in text


def test_a_second_load_on_this_machine_measures_nothing(tiny_dir, cache, monkeypatch):
    calls = []
    real = cpu_matmul.measure_group
    monkeypatch.setattr(cpu_matmul, "measure_group", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128).plan
    assert calls
    calls.clear()
    again = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128).plan
    assert not calls
    assert again.linears == first.linears and again.precision == first.precision
    assert len(list((cache / "plan").glob("*.json"))) == 1  # one table for every measurement


def test_entries_taken_on_a_busier_machine_are_measured_again(tiny_dir, cache, monkeypatch):
    """A table measured while another process slowed the machine is not kept for good: an entry
    whose reference matvec ran STALE times slower than now is measured again and restamped; a table
    measured on a quiet machine is kept while the machine is busy."""
    calls, speed = [], {"ms": 10.0}
    real = cpu_matmul.measure_group
    monkeypatch.setattr(cpu_matmul, "measure_group", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(machine, "reference_ms", lambda: speed["ms"])
    load = lambda: Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128)  # noqa: E731

    def stamps():
        entries = json.loads(machine.cache_path().read_text())["entries"]
        return {v["ref_ms"] for v in entries.values()}
    load()
    assert calls and stamps() == {10.0}
    calls.clear()
    speed["ms"] = 10.0 * machine.STALE * 1.1  # busier now: the quiet table stands
    load()
    assert not calls and stamps() == {10.0}
    speed["ms"] = 10.0 / (machine.STALE * 1.1)  # faster now: what was measured at 10 ms is measured again
    load()
    assert calls and stamps() == {speed["ms"]}


def test_specengine_plan_prints_it(tiny_dir, cache, capsys):
    assert main(["plan", "--target", str(tiny_dir), "--max-seq-len", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["key"] == machine.key() and plan["machine"]["threads"] == torch.get_num_threads()
    assert plan["ops"]["target"]["attention"] and "draft" not in plan["ops"]
    assert main(["plan", "--target", str(tiny_dir), "--max-seq-len", "64"]) == 0
    assert capsys.readouterr().out.startswith("plan for ")


def test_a_draft_on_another_device_is_in_the_plan(tiny_dir, cache):
    """A draft on its own device is a CrossDeviceDraft over its runner: the plan reads that runner."""
    from specengine.runtime.cross_device import CrossDeviceDraft

    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=64, cpu_matmul="linear")
    runner = eng.draft
    eng.draft = CrossDeviceDraft(runner, eng.device)
    assert eng.plan.ops["draft"] == dict(runner.ops.names)


@pytest.mark.parametrize("vendor,family,flags,isa,kind", [
    ("AuthenticAMD", "25", "fma avx2", "AVX2", "avx2_zen3"),
    ("AuthenticAMD", "25", "avx2 avx512f avx512_vnni", "AVX512", "avx512_zen4"),
    ("AuthenticAMD", "26", "avx2 avx512f avx512_vnni", "AVX512", "avx512_zen5"),
    ("GenuineIntel", "6", "avx2 avx512f amx_tile", "AVX512", "avx512_xeon_amx"),
    ("GenuineIntel", "6", "avx2 avx512f", "AVX512", "avx512_xeon"),
    ("AuthenticAMD", "27", "avx2", "AVX2", "avx2_amd27"),
])
def test_the_cpu_kind_tells_zen_4_from_zen_5(monkeypatch, vendor, family, flags, isa, kind):
    """Result files are named by CPU kind: a VM calls Zen 4 and Zen 5 both "AMD EPYC" and both run
    AVX-512, so the ISA alone let one kind's benchmark overwrite the other's."""
    fields = {"vendor_id": vendor, "cpu family": family, "flags": flags}
    monkeypatch.setattr(machine, "cpuinfo", fields.get)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    assert machine.cpu_kind() == kind
