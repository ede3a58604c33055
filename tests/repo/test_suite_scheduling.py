"""`make test`'s two workers (tests/helpers/scheduling.py): every memory-heavy file runs on the
same worker, first, so the suite never holds two real pairs at once; the other worker starts on
the light slow files, and the fast files come last, on either."""
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: the plugin imports as helpers.scheduling
FILES = {  # path: (tests, kind)
    "tests/fast/test_a.py": (3, "fast"), "tests/real/test_pair.py": (3, "heavy"), "tests/fast/test_b.py": (5, "fast"),
    "tests/real/test_gguf.py": (2, "heavy"), "tests/serve/test_ray.py": (2, "heavy"),
    "tests/repo/test_rehearsal.py": (2, "light"), "tests/repo/test_packaging.py": (1, "light")}
BODY = """import os, time
import pytest
{mark}
def test_{i}(request):
    time.sleep(0.1)
    with open({log!r}, "a") as f:
        f.write(request.node.nodeid + " " + os.environ["PYTEST_XDIST_WORKER"] + " " + os.environ["OMP_NUM_THREADS"] + "\\n")
"""


def test_heavy_files_share_one_worker_first_and_the_light_slow_ones_start_the_other(tmp_path):
    log = tmp_path / "ran.txt"
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\nmarkers = ['slow: minutes']\n")
    for name, (n, kind) in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        mark = "" if kind == "fast" else "pytestmark = pytest.mark.slow"
        path.write_text("\n".join(BODY.format(i=i, log=str(log), mark=mark) for i in range(n)))
    env = {**os.environ, "PYTHONPATH": str(TESTS), "SPECENGINE_HEAVY_THREADS": "2"}
    conftest = "from helpers.scheduling import order, pytest_runtest_setup, pytest_xdist_make_scheduler\n" \
               "def pytest_collection_modifyitems(config, items):\n    items[:] = order(items)\n"
    (tmp_path / "tests" / "conftest.py").write_text(conftest)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadscope", "--no-loadscope-reorder", "tests"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = [line.split() for line in log.read_text().splitlines()]  # in the order the tests ended
    assert len(ran) == sum(n for n, _ in FILES.values())
    kind = {nodeid: FILES[nodeid.split("::")[0]][1] for nodeid, _, _ in ran}
    by_worker = defaultdict(list)
    for nodeid, worker, omp in ran:
        by_worker[worker].append(kind[nodeid])
        assert omp == ("2" if kind[nodeid] == "heavy" else "1"), nodeid  # every core for a real pair's matmuls
    heavy = [w for w, kinds in by_worker.items() if "heavy" in kinds]
    assert len(heavy) == 1  # one real pair at a time
    first = by_worker[heavy[0]]
    assert first[:7] == ["heavy"] * 7 and "light" not in first  # the group first, then fast files
    other = next(kinds for w, kinds in by_worker.items() if w != heavy[0])
    assert other[:3] == ["light"] * 3  # the long light units start the other worker
