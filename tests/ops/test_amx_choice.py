"""The extension's AMX copy (its VNNI copy with the interleaved kernel's 16-row chunks on AMX tiles: the
same bits) is chosen by measurement in the planner, once per machine, and filed in the machine's table
(models/quant_plan.py `choose_tiles`); the extension itself only lists it. Checked with a stand-in
extension whose copies' speeds are given, since few machines have tiles, and on the real extension's
copies this CPU runs."""
import time

import torch

from specengine import machine
from specengine.kernels import cpu_ext
from specengine.models import cpu_matmul, quant_plan
from specengine.kernels.cpu_ext import TILES, VECTOR
from specengine.models.quant_plan import TILES_ENTRY, choose_tiles


class FakeExt:
    """The extension's copy switch and interleaved kernel; a copy's call sleeps its given seconds."""

    def __init__(self, seconds: dict, isas=(VECTOR, TILES, "avx512", "avx2", "baseline")):
        self.seconds, self._isas, self.current, self.timed = seconds, list(isas), isas[0], []

    def isas(self):
        return self._isas

    def isa(self):
        return self.current

    def set_isa(self, name):
        assert name in self._isas, name
        self.current = name

    def formats(self):
        return {"Q4_K": (12, 256, 144)}

    def quant_matmul_x8(self, x, w, code, n):
        self.timed.append(self.current)
        time.sleep(self.seconds.get(self.current, 0.0))
        return torch.zeros(x.shape[0], n)


def test_the_faster_copy_is_set_and_filed_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path / "a"))
    fast_tiles = FakeExt({VECTOR: 0.004, TILES: 0.001})
    assert choose_tiles(fast_tiles) == TILES and fast_tiles.isa() == TILES
    assert set(fast_tiles.timed) == {VECTOR, TILES}
    assert set(cpu_matmul._load_table()[TILES_ENTRY]["ms"]) == {VECTOR, TILES}
    again = FakeExt({VECTOR: 0.001, TILES: 0.004})  # a later process: the table decides, nothing is timed
    assert choose_tiles(again) == TILES and again.timed == []
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path / "b"))  # another machine, where the vector loop wins
    slow_tiles = FakeExt({VECTOR: 0.001, TILES: 0.004})
    assert choose_tiles(slow_tiles) == VECTOR and slow_tiles.isa() == VECTOR


def test_no_choice_without_tiles_or_when_a_copy_is_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    plain = FakeExt({}, isas=(VECTOR, "avx512", "avx2", "baseline"))
    assert choose_tiles(plain) is None and plain.isa() == VECTOR and plain.timed == []
    forced = FakeExt({VECTOR: 0.004, TILES: 0.001})
    forced.set_isa("avx2")  # a test or benchmark running another copy keeps it
    assert choose_tiles(forced) is None and forced.isa() == "avx2" and forced.timed == []
    monkeypatch.setenv(cpu_ext.FORCE_ENV, VECTOR)  # SPECENGINE_ISA names a copy the choice could move
    named = FakeExt({VECTOR: 0.004, TILES: 0.001})
    assert choose_tiles(named) is None and named.isa() == VECTOR and named.timed == []
    assert choose_tiles(None) is None


def test_either_copy_files_into_one_table(monkeypatch):
    """The choice is filed in the table whose key names the kernels' copy: both copies name one table,
    or setting the copy would move the table the choice is in; another copy names its own."""
    machine.kernel_digest()  # cached from the real extension first: the stand-in has no file to digest
    keys = {}
    for isa in (VECTOR, TILES, "avx2"):
        monkeypatch.setattr(cpu_ext, "EXT", FakeExt({}, isas=(isa,)))
        keys[isa] = machine.key()
    assert keys[VECTOR] == keys[TILES] != keys["avx2"]


def test_the_real_extensions_copies_are_timed_and_the_running_copy_kept():
    ext = cpu_ext.EXT
    assert ext is not None  # CI builds the extension
    before, copies = ext.isa(), ext.isas()[:2]
    ms = quant_plan.time_copies(ext, copies, reps=2)
    assert set(ms) == set(copies) and all(0 < v < 1e3 for v in ms.values()) and ext.isa() == before


def test_the_plan_says_which_copy_runs_and_what_each_measured(tmp_path, monkeypatch, tiny_pair, tokenizer):
    from specengine import Engine

    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=64)
    assert eng.plan.tiles is None  # nothing measured: no tiles here, or not yet
    choose_tiles(FakeExt({VECTOR: 0.001, TILES: 0.004}))
    plan = eng.plan
    assert plan.tiles["running"] == cpu_ext.EXT.isa() and set(plan.tiles["ms"]) == {VECTOR, TILES}
    assert f"kernel copy: {cpu_ext.EXT.isa()}" in str(plan)
