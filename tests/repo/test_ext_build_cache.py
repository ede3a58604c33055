"""The compiled extensions' machine-wide cache (tools/ext_build_cache.py, used by setup.py): a build
is reused only when every input is the same, and a change to any of them is a new key."""
import shutil
from pathlib import Path
from types import SimpleNamespace

from helpers.repo_tools import TOOLS, load_tool

cache = load_tool("ext_build_cache")


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "csrc" / "cpu").mkdir(parents=True)
    (root / "tools").mkdir()
    (root / "csrc" / "cpu" / "common.h").write_text("struct Block { int q; };\n")
    (root / "csrc" / "ops.cpp").write_text('#include "cpu/common.h"\n')
    (root / "setup.py").write_text("setup()\n")
    shutil.copy(TOOLS / "ext_build_cache.py", root / "tools")
    return root


def _ext(**kw):
    base = dict(name="specengine._quantext", sources=["csrc/ops.cpp"], define_macros=[("SE_BUILT_AVX512", None)],
                extra_compile_args={"cxx": ["-O3"]}, extra_link_args=["-fopenmp"])
    return SimpleNamespace(**{**base, **kw})


def test_the_key_changes_with_every_input_and_only_then(tmp_path, monkeypatch):
    root = _checkout(tmp_path)
    k0 = cache.key(_ext(), "2.13.0", None, root)
    assert cache.key(_ext(), "2.13.0", None, root) == k0  # nothing changed: the same build
    changed = {
        "a header nothing names as a source": lambda: (root / "csrc" / "cpu" / "common.h").write_text("struct Block { short q; };\n"),
        "setup.py": lambda: (root / "setup.py").write_text("setup(ext_modules=[])\n"),
    }
    seen = {k0}
    for what, change in changed.items():
        change()
        k = cache.key(_ext(), "2.13.0", None, root)
        assert k not in seen, what
        seen.add(k)
    k1 = cache.key(_ext(), "2.13.0", None, root)
    for what, k in {"macros (the ISA copies built)": cache.key(_ext(define_macros=[]), "2.13.0", None, root),
                    "flags": cache.key(_ext(extra_compile_args={"cxx": ["-O2"]}), "2.13.0", None, root),
                    "torch": cache.key(_ext(), "2.14.0", None, root)}.items():
        assert k != k1, what
    monkeypatch.setenv("CXXFLAGS", "-march=native")
    assert cache.key(_ext(), "2.13.0", None, root) != k1, "CXXFLAGS"


def test_a_kept_build_is_fetched_whole_and_never_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "build" / "_quantext.so"
    built.parent.mkdir()
    built.write_bytes(b"\x7fELF binary")
    target = tmp_path / "site" / "specengine" / "_quantext.so"
    assert not cache.fetch("k1", str(target))  # nothing kept yet: compile
    cache.keep("k1", str(built))
    assert [p.name for p in (tmp_path / "cache" / "ext-build" / "k1").iterdir()] == ["_quantext.so"]  # no part file left
    assert not cache.fetch("k2", str(target)) and not target.exists()  # another key: compile
    assert cache.fetch("k1", str(target)) and target.read_bytes() == b"\x7fELF binary"
    target.unlink()
    monkeypatch.setenv("SPECENGINE_EXT_CACHE", "0")
    assert not cache.fetch("k1", str(target)) and not target.exists()


def test_only_the_most_recently_used_builds_are_kept(tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "_kvext.so"
    built.write_bytes(b"so")
    now = time.time()
    for i in range(cache.KEEP):
        cache.keep(f"k{i}", str(built))
        os.utime(tmp_path / "cache" / "ext-build" / f"k{i}", (now - 100 + i, now - 100 + i))
    assert cache.fetch("k0", str(tmp_path / "site" / "_kvext.so"))  # the oldest, used again: kept
    cache.keep("new", str(built))
    kept = {d.name for d in (tmp_path / "cache" / "ext-build").iterdir()}
    assert len(kept) == cache.KEEP and {"new", "k0"} <= kept and "k1" not in kept
