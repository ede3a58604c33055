"""What the real-model tests share beyond fixtures."""

# The fp32 and bf16 real pairs and Gemma's float engine (25 of its file's 66 s) load their weights in small pages (`huge_pages=False`). Which pages
# hold a weight never changes a token, and the first touch of fresh 2 MiB pages costs 3-5 s/GiB on a
# VM whose host takes freed guest memory back (2 GiB: 6-10 s against 0.7 s in small pages, 2-vCPU
# AVX2 EPYC, 2026-12-04): at that rate up to 25-40 s for the fp32 pair's 8 GB and 12-22 s for bf16's
# 4 GB on CI's critical path (less where the guest reuses memory just freed), and the copy doubles
# the weights in memory while it runs (the bf16 test's peak 8.5 -> 5.3 GiB without it). The hold itself is
# tested in tests/runtime/test_huge_pages.py; the real GGUF pair (test_real_gguf.py), the default
# as users run it, keeps the default.
HUGE_PAGES_IN_TESTS = False
