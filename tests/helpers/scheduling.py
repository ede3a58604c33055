"""How `make test` shares the machine (a pytest plugin: tests/conftest.py imports its hooks).

Two pytest runs side by side (Makefile, `test`): the *heavy* files (real models, Ray's cluster:
each holds GBs, so they run one after another in a process of their own, and the suite holds one
real pair at a time) and everything else on two xdist workers, one torch thread each, the slow
light files (GPU-command rehearsals, SmolLM2) last. Side by side, no core waits: the heavy run's
single-threaded stretches (a reference model's load, tokenizers, the trace's bookkeeping) and
the light tests fill each other's gaps, where one tier after the other left a core idle.

The heavy run takes one torch thread while the other run goes on (its file SHARE_MARK_ENV names
exists: three busy threads on two cores already; a second OpenMP thread would wait on a preempted
sibling), then every core: set per test, before its fixtures, so a module's model loads with it."""
import os

import pytest

HEAVY_PATHS = ("tests/real/", "tests/serve/test_ray.py")
SHARE_MARK_ENV = "SPECENGINE_SHARE_MARK"  # a file that exists while the other tier runs


def is_heavy(nodeid: str) -> bool:
    return nodeid.startswith(HEAVY_PATHS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the heavy files' tests `heavy` before `-m` selects (`-m heavy`, `-m "not heavy"`)."""
    for item in items:
        if is_heavy(item.nodeid):
            item.add_marker(pytest.mark.heavy)


def threads_now() -> int | None:
    """The heavy run's torch threads for the next test: 1 while the other tier runs, else every
    core; None outside the heavy run (no mark file named)."""
    mark = os.environ.get(SHARE_MARK_ENV)
    if not mark:
        return None
    return 1 if os.path.exists(mark) else os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    threads = threads_now()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the children it starts (the reference models)
