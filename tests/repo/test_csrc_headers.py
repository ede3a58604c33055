"""csrc/cpu is laid out like llama.cpp's CPU backend: one common header (block formats, argument
structs, size checks), one translation unit per instruction set, headers that each compile on
their own (no header relies on what its includer defined before it)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADERS = sorted((ROOT / "csrc" / "cpu").glob("*.h"))


@pytest.mark.parametrize("header", HEADERS, ids=[h.name for h in HEADERS])
def test_every_cpu_header_compiles_on_its_own(header):
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed to check the headers (the extension's build needs it too)")
    from torch.utils.cpp_extension import include_paths

    flags = [f"-I{p}" for p in include_paths()]
    proc = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-x", "c++", *flags, str(header)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_one_translation_unit_per_instruction_set_in_the_build():
    setup = (ROOT / "setup.py").read_text()
    units = sorted(p.name for p in (ROOT / "csrc" / "cpu").glob("isa_*.cpp"))
    assert units == ["isa_avx2.cpp", "isa_avx512.cpp", "isa_baseline.cpp", "isa_vnni.cpp"]
    assert all(f"csrc/cpu/{u}" in setup for u in units)
    assert not list((ROOT / "csrc").glob("*_impl.h"))  # the hot loops live in csrc/cpu only
