"""CI fails on a skip that is not 'needs CUDA', with the reason printed (tests/helpers/strict_skips.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo_tools import TOOLS

TESTS = Path(__file__).resolve().parents[1]  # tests/: helpers.strict_skips imports from there


def run(tmp_path, body: str, strict: bool):
    (tmp_path / "test_x.py").write_text("import pytest\n" + body)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "SPECENGINE_NO_SKIPS": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "helpers.strict_skips", "-p", "no:cacheprovider",
                           str(tmp_path / "test_x.py")], capture_output=True, text=True, env=env, cwd=tmp_path)


OTHER = "def test_a():\n    pytest.skip('no CUDA torch headers')\n"
CUDA = "@pytest.mark.skipif(True, reason='needs CUDA')\ndef test_b():\n    pass\n"


def test_a_skip_for_another_reason_fails_ci_and_names_it(tmp_path):
    proc = run(tmp_path, OTHER, strict=True)
    assert proc.returncode != 0 and "no CUDA torch headers" in proc.stdout and "not allowed" in proc.stdout


@pytest.mark.parametrize("body,strict", [(CUDA, True), (OTHER, False)])
def test_cuda_skips_and_local_runs_pass(tmp_path, body, strict):
    assert run(tmp_path, body, strict).returncode == 0


def test_the_cuda_headers_fetch_works_on_an_empty_cache(tmp_path):
    """`ext_check --fetch-only` with an empty SPECENGINE_CACHE finds the headers (it once asked
    pip for the spec 'None', and the csrc nvcc test skipped on every fresh machine)."""
    env = {**os.environ, "SPECENGINE_CACHE": str(tmp_path)}
    env.pop("SPECENGINE_CUDA_TORCH_INCLUDE", None)
    proc = subprocess.run([sys.executable, str(TOOLS / "ext_check.py"), "--fetch-only"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    root = Path(proc.stdout.split("CUDA torch headers: ", 1)[1].strip())
    assert (root / "include" / "torch" / "extension.h").exists(), proc.stdout + proc.stderr
    import torch

    if torch.version.cuda is None:  # a CPU build of torch (CI's): fetched into the empty cache; a CUDA
        assert tmp_path in root.parents, root  # build's own headers serve as they are (a GPU user's make test)
