"""How `make test` shares the machine (tests/helpers/scheduling.py): the heavy files are marked
`heavy` for a run of their own, which takes one torch thread while the other run's mark file
exists and every core once it is gone."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: the plugin imports as helpers.scheduling
FILES = {"tests/real/test_pair.py": 2, "tests/serve/test_ray.py": 1, "tests/serve/test_server.py": 1,
         "tests/repo/test_rehearsal.py": 1}
BODY = """import os
def test_{i}():
    with open({log!r}, "a") as f:
        f.write(os.environ.get("PYTEST_CURRENT_TEST").split(" ")[0] + " " + os.environ.get("OMP_NUM_THREADS", "-") + "\\n")
    mark = os.environ.get("SPECENGINE_SHARE_MARK")
    if mark and os.path.exists(mark):
        os.remove(mark)  # the other run ends
"""


def _run(tmp_path, log, marks, env=None):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "helpers.scheduling", "-p", "no:cacheprovider", "-m", marks,
           "tests"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(TESTS), **(env or {})},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line.split() for line in log.read_text().splitlines()]
    log.unlink()
    return lines


def test_the_heavy_files_run_apart_on_one_thread_beside_the_rest_then_on_every_core(tmp_path):
    log = tmp_path / "ran.txt"
    (tmp_path / "pyproject.toml").write_text("")  # the rootdir: node ids start with tests/
    for name, n in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(BODY.format(i=i, log=str(log)) for i in range(n)))
    rest = _run(tmp_path, log, "not heavy")
    assert sorted(n.split("::")[0] for n, _ in rest) == ["tests/repo/test_rehearsal.py", "tests/serve/test_server.py"]
    assert all(omp == "-" for _, omp in rest)  # no mark file named: threads left as they were
    mark = tmp_path / "beside"
    mark.touch()
    heavy = _run(tmp_path, log, "heavy", {"SPECENGINE_SHARE_MARK": str(mark)})
    assert [n for n, _ in heavy] == ["tests/real/test_pair.py::test_0", "tests/real/test_pair.py::test_1",
                                     "tests/serve/test_ray.py::test_0"]
    assert [omp for _, omp in heavy] == ["1"] + [str(os.cpu_count())] * 2  # the mark gone after the first
