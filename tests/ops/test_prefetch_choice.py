"""The cache the kernels prefetch their weight stream into (L1 or L2), and how far ahead, are the
machine's choice, not the kernel's: the planner times a pass over the model's GGUF layers under each
setting once per machine, files it in the machine's table and sets it (models/quant_plan.py
`choose_prefetch`). Checked with given timings (which setting wins is the machine's), and on the real
extension: no setting changes a result, on any copy, and the timing leaves the setting it found."""
import platform
import shutil
import subprocess

import pytest
import torch

from specengine import machine
from specengine.kernels.cpu_ext import EXT
from specengine.kernels.quant_matmul import random_blocks
from specengine.kernels.quant_pack import pack_x8
from specengine.models import cpu_matmul, quant_plan
from specengine.models.quant_linear import QuantLinear
from specengine.models.quant_plan import PREFETCH_ENTRY, choose_prefetch

pytestmark = pytest.mark.skipif(EXT is None, reason="the CPU extension is not built")  # CI builds it


class FakeExt:
    """The extension's prefetch switch alone."""

    def __init__(self):
        self.level, self.ahead = "l1", 4096

    def prefetch(self):
        return self.level

    def set_prefetch(self, level):
        assert level in ("l1", "l2"), level
        self.level = level

    def prefetch_distance(self):
        return self.ahead

    def set_prefetch_distance(self, ahead):
        self.ahead = ahead


def model(rows=64, cols=256):
    return torch.nn.Sequential(QuantLinear([("Q4_K", random_blocks("Q4_K", rows, cols))]),
                               QuantLinear([("Q6_K", random_blocks("Q6_K", rows, cols))]))


def timer(ms: dict, calls: list):
    def time_prefetch(ext, layers):
        calls.append(len(layers))
        return {level: {"1": v, "4": 2 * v} for level, v in ms.items()}
    return time_prefetch


@pytest.fixture
def streams_from_memory(monkeypatch):
    """The tiny model's blocks count as larger than the caches (a real one is hundreds of MB)."""
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: 1)
    monkeypatch.setattr(cpu_matmul, "MIN_PASS_BYTES", 1)


def test_the_faster_setting_is_set_and_filed_once(tmp_path, monkeypatch, streams_from_memory):
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path / "a"))
    ext, calls = FakeExt(), []
    timings = {"l1@4096": 3.0, "l2@2048": 2.0, "l2@4096": 2.5}
    assert choose_prefetch(model(), ext, timer=timer(timings, calls)) == "l2@2048"
    assert (ext.level, ext.ahead) == ("l2", 2048)
    assert calls == [2] and set(cpu_matmul._load_table()[PREFETCH_ENTRY]["ms"]) == set(timings)
    again = FakeExt()  # a later process: the table decides, nothing is timed
    assert choose_prefetch(model(), again, timer=timer({"l1@1024": 1.0}, calls)) == "l2@2048" and calls == [2]
    assert (again.level, again.ahead) == ("l2", 2048)
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path / "b"))  # another machine, where L1 8 KiB ahead wins
    other = FakeExt()
    other.level = "l2"
    assert choose_prefetch(model(), other, timer=timer({"l1@8192": 2.0, "l2@2048": 3.0}, calls)) == "l1@8192"
    assert (other.level, other.ahead) == ("l1", 8192)


def test_the_level_is_timed_in_the_pages_the_weights_will_run_from(tmp_path, monkeypatch, streams_from_memory):
    """With the weights to be held in 2 MiB pages (huge_pages.py) the level waits for the hold: timed on
    weights still in small pages, it would be filed for pages it never runs from."""
    from specengine import huge_pages

    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    monkeypatch.setattr(huge_pages, "_enabled", True)
    big = torch.nn.Sequential(QuantLinear([("Q4_K", random_blocks("Q4_K", 8192, 512))]))  # 2.4 MB
    ext, calls = FakeExt(), []
    if huge_pages.support() is not None:  # no huge pages here: nothing to wait for
        assert choose_prefetch(big, ext, timer=timer({"l1@4096": 3.0, "l2@4096": 2.0}, calls)) == "l2@4096"
        return
    assert choose_prefetch(big, ext, timer=timer({"l1@4096": 3.0, "l2@4096": 2.0}, calls)) is None and calls == []
    huge_pages.hold(big)
    assert choose_prefetch(big, ext, timer=timer({"l1@4096": 3.0, "l2@4096": 2.0}, calls)) == "l2@4096"
    assert calls == [1]


def test_a_refused_hold_does_not_leave_the_setting_waiting(tmp_path, monkeypatch, streams_from_memory):
    """Where the kernel refuses the block (huge_pages.hold gets none), the setting is timed on the small
    pages the weights stay in, at the engine's hold, instead of waiting for a hold that never comes."""
    from specengine import huge_pages

    def refuse(nbytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    monkeypatch.setattr(huge_pages, "_enabled", True)
    monkeypatch.setattr(huge_pages, "_block", refuse)
    big = torch.nn.Sequential(QuantLinear([("Q4_K", random_blocks("Q4_K", 8192, 512))]))  # 2.4 MB
    ext, calls, timed = FakeExt(), [], []
    if huge_pages.support() is None:
        assert choose_prefetch(big, ext, timer=timer({"l2@2048": 2.0}, calls)) is None  # waits for the hold
    monkeypatch.setattr(quant_plan, "choose_prefetch", lambda model: timed.append(model))
    quant_plan.hold(big)
    assert not huge_pages.held(big) and timed == ([big] if huge_pages.support() is None else [])
    assert choose_prefetch(big, ext, timer=timer({"l2@2048": 2.0}, calls)) == "l2@2048" and calls == [1]


def test_a_model_that_fits_in_cache_is_not_timed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    ext, calls = FakeExt(), []
    assert choose_prefetch(model(), ext, timer=timer({"l1@4096": 3.0, "l2@2048": 2.0}, calls)) is None
    assert calls == [] and (ext.level, ext.ahead) == ("l1", 4096) and PREFETCH_ENTRY not in cpu_matmul._load_table()
    assert choose_prefetch(model(), None) is None


def test_the_real_settings_are_timed_and_the_setting_found_is_kept():
    before = quant_plan.prefetch_setting(EXT)
    ms = quant_plan.time_prefetch(EXT, list(model()), rounds=1)
    assert set(ms) == set(quant_plan.PREFETCH_SETTINGS) and all(0 < v < 1e3 for by in ms.values() for v in by.values())
    assert quant_plan.prefetch_setting(EXT) == before
    with pytest.raises(RuntimeError, match="'l1' or 'l2'"):
        EXT.set_prefetch("l3")
    for bad in (0, 100, 1 << 20):
        with pytest.raises(RuntimeError, match="whole 64-byte lines from 64 to 65536"):
            EXT.set_prefetch_distance(bad)
    assert quant_plan.prefetch_setting(EXT) == before


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q4_K", "Q6_K"])
def test_the_setting_never_changes_a_result(qtype):
    """Both layouts' kernels, every copy this CPU runs, 1-9 rows (chunk edges), odd row counts."""
    n, k = 37, 512
    w = random_blocks(qtype, n, k, seed=3)
    wp = pack_x8(w, qtype)
    code = EXT.formats()[qtype][0]
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    isa, setting = EXT.isa(), quant_plan.prefetch_setting(EXT)
    try:
        for copy in EXT.isas():
            EXT.set_isa(copy)
            for m in (1, 5, 9):
                got = []
                for s in ("l1@4096", "l2@4096", "l2@64", "l1@65536"):
                    quant_plan.set_prefetch(EXT, s)
                    got.append((EXT.quant_matmul(x[:m], w, code), EXT.quant_matmul_x8(x[:m], wp, code, n)))
                assert all(torch.equal(a, b) for g in got[1:] for a, b in zip(got[0], g)), (copy, m)
    finally:
        EXT.set_isa(isa)
        quant_plan.set_prefetch(EXT, setting)


def test_the_plan_says_where_the_stream_is_prefetched(tmp_path, monkeypatch, tiny_pair, tokenizer):
    import dataclasses

    from specengine import Engine

    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    plan = Engine(tiny_pair[0], tokenizer, max_seq_len=64).plan
    assert plan.prefetch is None  # a float model streams no GGUF blocks
    timed = dataclasses.replace(plan, prefetch={"running": "l2@2048", "ms": {"l1@4096": {"1": 41.8, "4": 51.4},
                                                                             "l2@2048": {"1": 38.1, "4": 47.2}}})
    assert "weight stream prefetched into l2, 2048 bytes ahead; a pass over the GGUF layers at 1 / 4 rows: " \
           "l2@2048 38.1 / 47.2 ms, l1@4096 41.8 / 51.4 ms" in str(timed)
    untimed = dataclasses.replace(plan, prefetch={"running": "l1", "ms": None})
    assert "weight stream prefetched into l1 (not timed" in str(untimed)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
                    reason="x86 copies only; objdump comes with the binutils that built the extension")
@pytest.mark.parametrize("kernel, lines", [("dot_q4k_x8<1>", 18), ("dot_q6k_x8<1>", 27), ("dot_q4k_x8<5>", 4)])
def test_the_avx2_weight_loops_keep_their_prefetches(kernel, lines):
    """The compiled one-row loops still ask for every line of a group (Q4_K 18, Q6_K 27; a verify
    width's Q4_K loop, whose sub-blocks stay a loop, for its scales and one sub-block's). GCC 12 had
    deleted the sub-blocks' prefetch builtins as dead code, so the Q4_K stream ran without them
    (dot_impl.h, prefetch_line); nothing else would notice: results do not change."""
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", EXT.__file__], capture_output=True,
                             text=True, check=True).stdout
    head = f"<void se::avx2::{kernel}(unsigned char const*, long, se::Act const&, float*)>:"
    bodies = [b for b in listing.split("\n\n") if head in b.splitlines()[0]]
    assert bodies, f"no {kernel} in the avx2 copy"
    prefetches = bodies[0].count("prefetcht")
    assert prefetches >= lines, f"{kernel} issues {prefetches} prefetches, fewer than its {lines} lines"
