"""Shared helpers for the kernel microbenchmarks (pytest-benchmark; not part of CI).

Run on a GPU: `make bench-kernels` (writes bench/results/kernels_<device>.json).
On a CPU they only make sense for the torch providers: set SPECENGINE_BENCH_CPU=1.
"""
import os

import pytest
import torch

# Peak HBM bandwidth (bytes/s) of the devices we measure on, from the vendors' data sheets.
PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def peak_bandwidth() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BW.items() if key in name), None)


def device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("SPECENGINE_BENCH_CPU") == "1":
        return "cpu"
    pytest.skip("kernel microbenchmarks need a GPU (or SPECENGINE_BENCH_CPU=1 for torch providers)")


def timed(benchmark, fn, nbytes: int):
    """Benchmark fn with device syncs; record µs and achieved GB/s (and % of peak) in extra_info."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def call():
        fn()
        sync()

    fn()  # compile / autotune outside the timing
    sync()
    benchmark.pedantic(call, rounds=50 if torch.cuda.is_available() else 10, warmup_rounds=3)
    if benchmark.stats is None:  # --benchmark-disable: each case ran once, as a check
        return
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(us=mean * 1e6, gbps=nbytes / mean / 1e9)
    if peak_bandwidth():
        benchmark.extra_info["roofline_fraction"] = nbytes / mean / peak_bandwidth()
        benchmark.extra_info["device"] = torch.cuda.get_device_name()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Record what the numbers were measured with: device, library versions, the command."""
    import sys

    from specengine.benchmark import environment

    env = environment()
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["command"] = "pytest " + " ".join(sys.argv[1:])
    output_json["environment"] = env
