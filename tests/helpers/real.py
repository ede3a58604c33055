"""What the real-model tests share beyond fixtures."""

# The real models' tests (fp32, bf16 and GGUF pairs, Gemma's float engine) load their weights in small
# pages (`huge_pages=False`). Which pages hold a weight never changes a token, and the first touch of
# fresh 2 MiB pages costs 3-12 s/GiB on a VM whose host takes freed guest memory back (2-vCPU AVX2 EPYC,
# 2026-12-04/05: 2 GiB 6-10 s against 0.7 s in small pages; the GGUF pair's 1.6 GB hold 19 of its
# test's 78 s, Gemma's 25 of 66) on CI's critical path, and the copy doubles the weights in memory while
# it runs (the bf16 test's peak 8.5 -> 5.3 GiB without it). The hold itself, the compiled layer stack
# rebuilt on held GGUF blocks included, is tested in tests/runtime/test_huge_pages.py, and the SmolLM2
# GGUF tests (tests/runtime/test_real_smollm2.py) load with the default, as users do.
HUGE_PAGES_IN_TESTS = False
