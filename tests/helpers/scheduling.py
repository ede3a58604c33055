"""How `make test` shares two workers (a pytest plugin: tests/conftest.py imports its hooks).

The whole suite is one run with `--dist loadscope`: a file's tests on one worker, and every
memory-heavy file's (real models, Ray's cluster) on the same one, in turn, so one real pair is in
memory at a time (two ran the 24 GiB machine out of memory). The longest units go first, so the
two workers end together (`order`): the heavy group takes one worker for most of the run while the
other runs the light slow files (the GPU-command rehearsals, mostly one busy Python thread, some
of it waiting on a stalled section) and then the fast files, which the first joins when its group
ends. Run as two tiers (fast, then slow), the light worker sat idle for the heavy group's last
minutes. xdist's `loadgroup` cannot do this here: it renames items through `item._nodeid`, which
pytest 9.2 no longer reads, so its groups are silently ignored (tests/repo/test_suite_scheduling.py)."""
import os
from collections import Counter

import pytest

HEAVY_PATHS = ("tests/real/", "tests/serve/test_ray.py")


def is_heavy(nodeid: str) -> bool:
    return nodeid.startswith(HEAVY_PATHS)


def order(items: list) -> list:
    """The run's order. On xdist workers (`make test`): the heavy group, the light slow files,
    then the fast files, those with the most tests first (a file's tests keep their order; run
    with --no-loadscope-reorder, which would sort by test count alone): the longest units first.
    In one process: the fast tests first and the slow ones (real models, the GPU-command
    rehearsals, the nvcc compile) last, in their order, so a broken change fails in minutes."""
    slow = [i for i in items if "slow" in i.keywords]
    fast = [i for i in items if "slow" not in i.keywords]
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # (a worker's own `dist` option reads "no")
        return fast + slow
    tests_in = Counter(_file(i.nodeid) for i in fast)
    fast.sort(key=lambda i: -tests_in[_file(i.nodeid)])  # stable
    return [i for i in slow if is_heavy(i.nodeid)] + [i for i in slow if not is_heavy(i.nodeid)] + fast


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope`: a file is a unit, and every heavy file is one unit together."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class HeavyTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if is_heavy(nodeid) else super()._split_scope(nodeid)

    return HeavyTogether(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """SPECENGINE_HEAVY_THREADS (`make test`): a heavy file's tests run that many torch threads,
    every other test one (its children too, through OMP_NUM_THREADS): the light tests are mostly
    one busy Python thread beside the other worker, the real pair's matmuls want every core."""
    heavy_threads = os.environ.get("SPECENGINE_HEAVY_THREADS")
    if heavy_threads and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        threads = int(heavy_threads) if is_heavy(item.nodeid) else 1
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
