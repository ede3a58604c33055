"""The slow tier's two workers (tests/helpers/scheduling.py): every memory-heavy file runs on the
same worker, so the suite never holds two real pairs at once; the light files go to the other."""
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]  # tests/: the plugin imports as helpers.scheduling
FILES = {  # path: (tests, memory-heavy)
    "tests/real/test_pair.py": (3, True), "tests/real/test_gguf.py": (2, True), "tests/serve/test_ray.py": (2, True),
    "tests/repo/test_rehearsal.py": (2, False), "tests/repo/test_packaging.py": (1, False)}
BODY = """import os, time
def test_{i}(request):
    time.sleep(0.1)
    with open({log!r}, "a") as f:
        f.write(request.node.nodeid + " " + os.environ["PYTEST_XDIST_WORKER"] + " " + os.environ["OMP_NUM_THREADS"] + "\\n")
"""


def test_heavy_files_share_one_worker_and_light_ones_take_the_other(tmp_path):
    log = tmp_path / "ran.txt"
    (tmp_path / "pyproject.toml").write_text("")  # the rootdir: node ids start with tests/
    for name, (n, _) in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(BODY.format(i=i, log=str(log)) for i in range(n)))
    env = {**os.environ, "PYTHONPATH": str(TESTS), "SPECENGINE_HEAVY_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "helpers.scheduling", "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "loadscope", "tests"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers, threads = defaultdict(set), {}
    for line in log.read_text().splitlines():
        nodeid, worker, omp = line.split()
        heavy = FILES[nodeid.split("::")[0]][1]
        workers[heavy].add(worker)
        threads[nodeid] = (heavy, omp)
    assert len(threads) == sum(n for n, _ in FILES.values())
    assert len(workers[True]) == 1 and workers[True].isdisjoint(workers[False])  # one real pair at a time
    assert all(omp == ("2" if heavy else "1") for heavy, omp in threads.values())
