"""bench/llamacpp.py's build flags: llama.cpp's AMX path is left out where GCC 12 or older compiles
it (its _tile_loadconfig drops the tile configuration's stores: SIGILL at the first tile op)."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import llamacpp  # noqa: E402


def test_gcc_major_reads_the_compilers_own_version():
    probe = subprocess.run(["c++", "--version"], capture_output=True, text=True, check=True)
    if "clang" in probe.stdout.lower():
        assert llamacpp.gcc_major() == 99
    else:  # -dumpfullversion is GCC's "12.2.0" (-dumpversion may print only "12")
        full = subprocess.run(["c++", "-dumpfullversion"], capture_output=True, text=True).stdout
        assert llamacpp.gcc_major() == int(full.split(".")[0])
