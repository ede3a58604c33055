"""csrc/cpu is laid out like llama.cpp's CPU backend: one common header (block formats, argument
structs, size checks), one translation unit per instruction set, headers that each compile on
their own (no header relies on what its includer defined before it)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADERS = sorted((ROOT / "csrc" / "cpu").glob("*.h"))


# the plain C++ parts, and the SIMD parts as the widest copy (isa_vnni.cpp) sees them: the loops sit in
# `#ifdef SE_AVX2` / `SE_VNNI` blocks, which a header compiled with no macro would never parse
COPIES = {"plain": [], "simd": ["-DSE_AVX2", "-DSE_WIDE", "-DSE_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]}


@pytest.mark.parametrize("copy", list(COPIES))
@pytest.mark.parametrize("header", HEADERS, ids=[h.name for h in HEADERS])
def test_every_cpu_header_compiles_on_its_own(header, copy):
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed to check the headers (the extension's build needs it too)")
    from torch.utils.cpp_extension import include_paths

    flags = [f"-I{p}" for p in include_paths()] + COPIES[copy]
    proc = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-w", "-x", "c++", *flags, str(header)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_one_translation_unit_per_instruction_set_in_the_build():
    setup = (ROOT / "setup.py").read_text()
    units = sorted(p.name for p in (ROOT / "csrc" / "cpu").glob("isa_*.cpp"))
    assert units == ["isa_avx2.cpp", "isa_avx512.cpp", "isa_baseline.cpp", "isa_vnni.cpp"]
    assert all(f"csrc/cpu/{u}" in setup for u in units)
    assert not list((ROOT / "csrc").glob("*_impl.h"))  # the hot loops live in csrc/cpu only


def test_the_build_compiles_every_copy_this_cpu_runs(monkeypatch):
    """setup.py's `isa_units`: baseline and avx2 always, avx512 / vnni where /proc/cpuinfo says the CPU
    runs them (or SPECENGINE_ISAS=all), each with the macro that puts it in the dispatch; the compiled
    extension offers every copy this CPU can run (its CPUID list), so nothing runnable was left out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specengine_setup_probe", ROOT / "setup.py")
    src = (ROOT / "setup.py").read_text().split("\ncmdclass, ext_modules = extensions()")[0]
    ns = {"__name__": "probe"}
    exec(compile(src, str(ROOT / "setup.py"), "exec"), ns)
    monkeypatch.setenv("SPECENGINE_ISAS", "all")
    units, macros = ns["isa_units"]()
    assert [u.split("/")[-1] for u in units] == ["isa_baseline.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "isa_vnni.cpp"]
    assert [m for m, _ in macros] == ["SE_BUILT_AVX512", "SE_BUILT_VNNI"]
    monkeypatch.setenv("SPECENGINE_ISAS", "native")
    units, macros = ns["isa_units"]()
    flags = set(open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split())
    assert ("csrc/cpu/isa_avx512.cpp" in units) == ({"avx512f", "avx512bw", "avx512vl"} <= flags)
    monkeypatch.setenv("SPECENGINE_ISAS", "avx9")
    with pytest.raises(SystemExit, match="SPECENGINE_ISAS must be 'native' or 'all'"):
        ns["isa_units"]()
    from specengine.kernels.cpu_ext import EXT

    if EXT is not None:  # the copies this CPU runs, widest first, all compiled here
        runs = ["avx2"] * ("avx2" in flags) + ["baseline"]
        assert set(runs) <= set(EXT.isas())
        assert ("avx512" in EXT.isas()) == ({"avx512f", "avx512bw", "avx512vl"} <= flags)


def test_csrc_files_stay_small():
    """The Python modules' budget (test_package_layout.py) holds for the C++ and CUDA sources too."""
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")}
    assert len(sizes) >= 15 and all(n <= 400 for n in sizes.values()), {p: n for p, n in sizes.items() if n > 400}
