"""How `make test` shares two workers (a pytest plugin: tests/conftest.py imports its hooks).

The slow tier runs with `--dist loadscope`: a file's tests on one worker, and every memory-heavy
file's (real models, Ray's cluster) on the same one, in turn, so one real pair is in memory at a
time (two ran the 24 GiB machine out of memory) while the other worker takes the light files
(the GPU-command rehearsals, mostly one busy Python thread). xdist's `loadgroup` cannot do this
here: it renames items through `item._nodeid`, which pytest 9.2 no longer reads, so its groups are
silently ignored (tests/repo/test_suite_scheduling.py)."""
import os

import pytest

HEAVY_PATHS = ("tests/real/", "tests/serve/test_ray.py")


def is_heavy(nodeid: str) -> bool:
    return nodeid.startswith(HEAVY_PATHS)


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
    """SPECENGINE_HEAVY_THREADS (the slow tier): the heavy files' worker runs that many torch
    threads, the light worker one (its children too, through OMP_NUM_THREADS): the light tests
    are mostly one busy Python thread, the real pair's matmuls want every core."""
    heavy_threads = os.environ.get("SPECENGINE_HEAVY_THREADS")
    if heavy_threads and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        threads = int(heavy_threads) if is_heavy(item.nodeid) else 1
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
