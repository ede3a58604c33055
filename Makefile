# Entry points used by the README and CI. Each target creates the virtual environment
# and installs the project on first use (torch 2.13.0 resolves to the local CPU wheel).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CORE   := $(VENV)/.core-installed
PYTEST_ARGS ?=

.PHONY: gpu-run trace gpu-check install demo test test-fast bench bench-gguf bench-gguf-avx2 bench-structured bench-suffix bench-serve bench-ray bench-ngram bench-grid bench-pearl bench-specdec bench-parallelspec bench-trees train-head train-parallel bench-kernels compile-check gpu-rehearsal fetch clean fuzz-server

# Two steps: what `make demo` needs (torch, the project with the GGUF reader, the compiled kernels:
# one translation unit per instruction set this CPU runs, in parallel), then the extras the tests,
# benchmarks and servers need, installed without compiling again (SPECENGINE_BUILD_EXT=0 keeps the
# extension built in the first step). A module compiled before on this machine from the same inputs
# (sources, compiler, torch, flags) is reused from the cache (tools/ext_build_cache.py): 154 -> 93 s
# for a clean clone's install on the AVX2 EPYC; SPECENGINE_EXT_CACHE=0 compiles regardless.
$(CORE): pyproject.toml setup.py tools/ext_build_cache.py $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu csrc/*.cuh csrc/cpu/*.cpp csrc/cpu/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 ninja
	# no build isolation: setup.py needs this torch to compile the extensions (csrc/)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[gguf]"
	touch $(CORE)

$(STAMP): $(CORE)
	SPECENGINE_BUILD_EXT=0 $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation \
	  -e ".[gguf,test,bench,triton,serve,structured,ray]"
	touch $(STAMP)

install: $(STAMP)

# Fetch the default real pair (sha256-checked, converted once) and compare ar vs sd.
demo: $(CORE)
	$(PY) -m specengine.demo

# The whole suite on CPU, real pair included (fetched into the cache on first run). The
# headers of a CUDA build of torch are extracted once (cached) so csrc/ is nvcc-checked
# against them; where they cannot be had, that one test skips (and fails CI, which allows
# only "needs CUDA" skips: SPECENGINE_NO_SKIPS=1 in .ci/run). The fast tier on two
# pytest-xdist workers (WORKERS), test by test, one torch thread each (438 s on a 2-core Zen 5;
# two threads each, four on two cores, was slower); then the slow tier (real models, GPU-command
# rehearsals, Ray) on two workers, a file at a time: every memory-heavy file (real models, Ray's
# cluster) in turn on one worker with every core's thread, the light ones (the rehearsals: mostly
# one busy thread) on the other with one (tests/helpers/scheduling.py); OpenMP's idle threads sleep
# (OMP_WAIT_POLICY=PASSIVE) instead of spinning on the core the other worker needs: the slow tier
# 667 -> 586 s on the AVX2 EPYC, the bf16 pair's test 136 -> 61 s (docs/tests.md). The slowest tests are
# listed at the end: CI is held to about 20 minutes, and each run states its peak memory.
# Then the tests that depend on what this machine makes `auto` choose run again with each
# choice forced, so a submission made on one CPU kind is checked for the others too.
WORKERS ?= 2
XDIST = -n $(WORKERS)
test: $(STAMP)
	$(PY) tools/ext_check.py --fetch-only
	SPECENGINE_TEST_THREADS=1 $(VENV)/bin/pytest -q $(XDIST) --dist load -m "not slow" --durations=10 $(PYTEST_ARGS)
	SPECENGINE_HEAVY_THREADS=$$(nproc) OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/pytest -q $(XDIST) --dist loadscope -m slow \
	  --durations=10 $(PYTEST_ARGS)
	SPECENGINE_CPU_DTYPE=bfloat16 $(VENV)/bin/pytest -q -m cpu_dtype_choice $(PYTEST_ARGS)
	SPECENGINE_CPU_DTYPE=float32 $(VENV)/bin/pytest -q -m cpu_dtype_choice $(PYTEST_ARGS)
	SPECENGINE_INVARIANT_PROBE=refuse $(VENV)/bin/pytest -q -m invariance_probe $(PYTEST_ARGS)

# Everything but the real-pair tests (no multi-GB download).
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not real" $(PYTEST_ARGS)

# The end-to-end benchmark on the real pair, every provider side by side in one run, dtype
# auto (measured on this machine); prints the CPU, threads and the measured matvec bound.
# About 40 minutes on 2 CPU cores. BENCH_OUT names the result file.
BENCH_OUT ?= bench/results/cpu_e2e_qwen25coder_1.5b_0.5b.json
bench: $(STAMP)
	$(VENV)/bin/specengine bench --draft qwen2.5-coder-0.5b-instruct \
	  --providers hf,hf-assisted,ar,sd:2,sd:3,sd:auto --baseline hf \
	  --n-prompts 8 --max-new-tokens 128 --out $(BENCH_OUT)

# dtype "auto" beside the grid it chooses from: target x draft dtype (fp32/bf16) x sd γ 1-6 and
# auto, ar in both dtypes; auto's distance from the best cell and the cost model's error
# (3 prompts x 64 tokens: about 40 minutes on 2 cores).
bench-grid: $(STAMP)
	$(PY) bench/dtype_grid.py --out bench/results/cpu_dtype_grid.json

# Weights kept as GGUF blocks beside llama.cpp on the same files, prompts and threads: our ar / sd
# (blocks, and float bf16 / fp32) and llama.cpp's ar, speculative (draft max 3, 6) and n-gram.
# Builds llama.cpp from the registry's llama-cpp-python source first (~8 minutes on 2 cores).
bench-structured: $(STAMP)  # structured output on the real pair: constrained methods, HF + xgrammar, schema validity
	$(PY) bench/structured.py --llamacpp --out bench/results/cpu_structured.json

bench-suffix: $(STAMP)  # suffix decoding on repeating agent-like sets, real pair, requests in sequence
	$(PY) bench/suffix.py --arctic --out bench/results/cpu_suffix.json

# The server under load (throughput, TTFT, ITL at concurrency 1-8) and a chat's second turn with
# and without prefix reuse, real pair, server in-process (about 25 minutes on 2 cores).
bench-serve: $(STAMP)
	$(PY) bench/serve_load.py --methods ar,sd:4 --concurrency 1,2,4,8 --requests 8 --max-tokens 32 \
	  --out bench/results/cpu_serve_load.json
	$(PY) bench/serve_multiturn.py --concurrency 1,2 --out bench/results/cpu_serve_multiturn.json

# Ray Serve replicas (1, 2 with Ray's default routing, 2 with ours) against one plain server, the
# same multi-turn load, the 0.5B model (about 10 minutes on 2 cores).
bench-ray: $(STAMP)
	$(PY) bench/serve_ray.py --out bench/results/cpu_serve_ray.json

# The stream rates per ISA copy, llama.cpp beside ours, the same interleaved prompt by prompt (the
# README's per-CPU row) on HumanEval, on MT-bench's prose and on ~1,000-token prompts (end to end: the
# draft's read of the prompt shows), and the first reply after warmup() against the next, in fresh processes.
# CPU_KIND (avx512_zen5, avx2_zen3, ...) and CPU_NAME (zen5, zen3, ...): asked when a recipe first expands
# them, after $(STAMP) made the venv, and kept (the eval: one ~2 s Python start, not one per use). No
# comment on a variable's line: make keeps the spaces before one in the value, and `--out
# x_$(CPU_KIND).json` split in two (tests/repo/test_bench_layout.py).
CPU_KIND = $(eval CPU_KIND := $$(shell $(PY) -c "from specengine.machine import cpu_kind; print(cpu_kind())"))$(CPU_KIND)
CPU_NAME = $(patsubst $(firstword $(subst _, ,$(CPU_KIND)))_%,%,$(CPU_KIND))
bench-gguf: $(STAMP)
	$(PY) bench/peers/llamacpp.py build
	$(PY) bench/gguf_cpu.py --streams --out bench/results/cpu_gguf_streams_$(CPU_KIND).json
	$(PY) bench/gguf_cpu.py --llamacpp --out bench/results/cpu_gguf_vs_llamacpp_$(CPU_KIND).json
	$(PY) bench/gguf_cpu.py --llamacpp --interleaved 2 --n-prompts 3 --max-new-tokens 64 \
	  --out bench/results/cpu_gguf_interleaved_$(CPU_KIND).json
	$(PY) bench/gguf_cpu.py --llamacpp --interleaved 2 --n-prompts 3 --max-new-tokens 64 --prompts mtbench \
	  --out bench/results/cpu_gguf_interleaved_mtbench_$(CPU_KIND).json
	$(PY) bench/gguf_cpu.py --llamacpp --interleaved 2 --n-prompts 3 --max-new-tokens 64 --prompts humaneval-long \
	  --out bench/results/cpu_gguf_interleaved_long_$(CPU_KIND).json
	$(PY) bench/gguf_cpu.py --first-reply 3 --max-new-tokens 64 --out bench/results/cpu_gguf_first_reply_$(CPU_KIND).json

# On a CPU with more than AVX2: both sides held to AVX2 alone (our kernels' AVX2 copy, llama.cpp built
# for AVX2 without AVX-512 or VNNI), interleaved as above on both prompt sets: an AVX2-only EPYC's
# instruction set (~20 min).
bench-gguf-avx2: $(STAMP)
	SPECENGINE_ISA=avx2 $(PY) bench/peers/llamacpp.py build
	SPECENGINE_ISA=avx2 $(PY) bench/gguf_cpu.py --llamacpp --interleaved 2 --n-prompts 3 --max-new-tokens 64 \
	  --out bench/results/cpu_gguf_interleaved_avx2copy_$(CPU_NAME).json
	SPECENGINE_ISA=avx2 $(PY) bench/gguf_cpu.py --llamacpp --interleaved 2 --n-prompts 3 --max-new-tokens 64 \
	  --prompts mtbench --out bench/results/cpu_gguf_interleaved_mtbench_avx2copy_$(CPU_NAME).json

# N-gram drafting on prompts that copy their input (specengine/prompts.py, COPY_PROMPTS) and on HumanEval:
# HF generate and its prompt lookup, our ar, n-gram chains and tree, the draft model, the hybrid
# Whole replies (each provider stops at EOS, up to 512 tokens; `--fixed-length` for 128 tokens, EOS
# ignored): 25-30 minutes on 2 cores, most of it transformers' fp32.
bench-ngram: $(STAMP)
	$(PY) bench/ngram_cpu.py --out bench/results/cpu_ngram.json

# PEARL vs ar and the best CPU sd on the real pair (about 15 minutes on 2 cores).
bench-pearl: $(STAMP)
	$(VENV)/bin/specengine bench --draft qwen2.5-coder-0.5b-instruct --providers ar,sd:3,pearl \
	  --n-prompts 8 --max-new-tokens 128 --out bench/results/cpu_e2e_pearl_qwen25coder_1.5b_0.5b.json

# Reproduce the SpecDec++ head shipped for the default pair (specengine/drafting/heads/; about 15
# minutes on 2 CPU cores, most of it the teacher-forced forwards; resumable).
HEAD_OUT ?= specengine/drafting/heads/qwen2.5-coder-0.5b-instruct.greedy.safetensors
train-head: $(STAMP)
	$(VENV)/bin/specengine train-head --draft qwen2.5-coder-0.5b-instruct --dtype float32 --mode greedy \
	  --out $(HEAD_OUT) --work-dir build/head-work

# SpecDec++ vs fixed γ and the training-free policies on the real pair: the default
# threshold from held-out corpus text first (about 8 min), then HumanEval, greedy and T=1
# (4 prompts x 128 tokens, 10 providers: about 25 min each).
SPECDEC_PROVIDERS := ar,sd:2,sd:3,sd:4,sd@heuristic,sd@confidence,sd:8@specdec++=0.1,sd:8@specdec++=0.2,sd:8@specdec++=0.5,sd:8@specdec++=0.7
bench-specdec: $(STAMP)
	$(PY) bench/specdec_threshold_sweep.py --out bench/results/cpu_specdec_threshold_sweep.json
	$(VENV)/bin/specengine bench --draft qwen2.5-coder-0.5b-instruct --dtype float32 \
	  --providers $(SPECDEC_PROVIDERS) --n-prompts 4 --max-new-tokens 128 \
	  --out bench/results/cpu_e2e_specdec_greedy.json
	$(VENV)/bin/specengine bench --draft qwen2.5-coder-0.5b-instruct --dtype float32 --temperature 1 --seed 7 \
	  --providers $(SPECDEC_PROVIDERS) --n-prompts 4 --max-new-tokens 128 \
	  --out bench/results/cpu_e2e_specdec_t1.json

# Reproduce the ParallelSpec drafter shipped for the default pair (specengine/drafting/drafters/;
# about 50 minutes on 2 CPU cores: ~11 min teacher forwards, 120 steps; resumable).
DRAFTER_OUT ?= specengine/drafting/drafters/qwen2.5-coder-0.5b-instruct.safetensors
train-parallel: $(STAMP)
	$(VENV)/bin/specengine train-parallel --draft qwen2.5-coder-0.5b-instruct --dtype float32 --k-max 6 --rank 4 \
	  --n-train 240 --n-val 8 --seq-len 128 --groups 96 --epochs 1 --out $(DRAFTER_OUT) --work-dir build/drafter-work

# ParallelSpec (k 2-6, and inside PEARL) vs ar, the best fixed-γ sd and transformers, then
# token trees vs chains, on the real pair, fp32 greedy, 4 HumanEval prompts x 128 tokens.
PARALLEL_PROVIDERS := hf,hf-assisted,ar,sd:3,sd:4,parallelspec:2,parallelspec:3,parallelspec:4,parallelspec:5,parallelspec:6,pearl,pearl@parallel
TREE_PROVIDERS := ar,sd:4,sd[tree=4x4],sd:8,sd[tree=4x4:8],sd[tree=2x4:4],parallelspec:4,parallelspec[tree=3x4:8],parallelspec[tree=4x4]
bench-parallelspec: $(STAMP)
	$(VENV)/bin/specengine bench --draft qwen2.5-coder-0.5b-instruct --dtype float32 --providers $(PARALLEL_PROVIDERS) \
	  --baseline ar --n-prompts 4 --max-new-tokens 128 --out bench/results/cpu_e2e_parallelspec.json
bench-trees: $(STAMP)
	$(VENV)/bin/specengine bench --draft qwen2.5-coder-0.5b-instruct --dtype float32 --providers "$(TREE_PROVIDERS)" \
	  --n-prompts 4 --max-new-tokens 128 --out bench/results/cpu_e2e_trees.json

# schemathesis --checks all against the server's /openapi.json, a longer pass than make test's
# (300 examples per operation, with and without an API key); JSON run reports committed.
fuzz-server: $(STAMP)
	FUZZ_EXAMPLES=300 FUZZ_REPORT=$(CURDIR)/bench/results/server_fuzz.json $(VENV)/bin/pytest -q -p no:cacheprovider \
	  tests/serve/test_server_fuzz.py

fetch: $(STAMP)
	$(VENV)/bin/specengine fetch

clean:
	rm -rf $(VENV) build dist *.egg-info

# Kernel microbenchmarks (pytest-benchmark, provider axis). Meant for a GPU; not in CI.
bench-kernels: $(STAMP)
	$(VENV)/bin/pytest bench/ops/verify_attention.py bench/ops/rejection_sampling.py bench/ops/fused_ops.py bench/ops/compact_kv.py \
	  -p no:cacheprovider -q --benchmark-only --benchmark-json bench/results/kernels_$$(hostname).json

# Every Triton kernel, every autotune config and variant, compiled ahead of time for sm_90
# and sm_80 (no GPU needed); registers / shared / local memory per variant. 906 compiles at
# about 2 s each on a 2-core CPU: roughly half an hour (make test runs 42 representative ones).
compile-check: $(STAMP)
	env -u TRITON_INTERPRET $(PY) -m specengine.kernels.compile_check --full \
	  --json bench/results/compile_check_full.json
	$(PY) tools/ext_check.py --fetch-only
	$(PY) tools/ext_check.py

# Before a GPU window, on this CPU: the kernels and the GPU command under the GPU machine's own
# packages (its image's, /work/.library/device/KINDS.md, 2026-11: Triton 3.6.0, transformers 5.17.0;
# ours are newer; its torch 2.11 CUDA wheel does not import without CUDA's libraries, so torch stays
# ours). Every Triton variant compiled for sm_90 / sm_80 (spills reported; exit 2 only where one does
# not compile), the kernel tests in that Triton's interpreter (with a NumPy it accepts), then
# scripts/gpu_run.sh rehearsed end to end (GPU_SMOKE=1). Installed once into build/device-py;
# about 7 minutes on 2 cores.
TRITON_DEVICE ?= 3.6.0
DEVICE_PKGS ?= triton==$(TRITON_DEVICE) transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 "numpy<2.3"
DEVICE_PY := $(CURDIR)/build/device-py
$(DEVICE_PY)/.installed: $(STAMP)
	rm -rf $(DEVICE_PY)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(DEVICE_PY) $(DEVICE_PKGS)
	touch $@

gpu-rehearsal: $(DEVICE_PY)/.installed
	env -u TRITON_INTERPRET PYTHONPATH=$(DEVICE_PY) $(PY) -m specengine.kernels.compile_check --full \
	  --json bench/results/compile_check_full_triton$(TRITON_DEVICE).json; test $$? -lt 2
	PYTHONPATH=$(DEVICE_PY) SPECENGINE_TEST_THREADS=1 $(VENV)/bin/pytest -q $(XDIST) -m "triton and not slow" tests/
	GPU_SMOKE=1 PYTHONPATH=$(DEVICE_PY) OUT=build/gpu-rehearsal bash scripts/gpu_run.sh

# GPU bring-up on a CUDA machine (its own python3 with torch, triton, transformers; no network):
# installs with the sm_90 extension, runs pytest -m gpu, the kernel and end-to-end GPU
# benchmarks, then the suite on CUDA; JSON under bench/results/. About 10 minutes on an H100.
gpu-check:
	SPECENGINE_COMMIT=$$(git rev-parse --short HEAD 2>/dev/null) bash scripts/gpu_check.sh $(GPU_PARTS)

# THE command for a GPU window (15 minutes of device time, start included): at most 8 minutes (6 on an
# H200, first run; scripts/gpu_run.sh): the ar step, every method replaying the real pair's acceptance
# trace on random weights of the 7B/0.5B and 1.5B/0.5B shapes, HF generate and a torch.compile'd
# ar beside them, PEARL last; each section's JSON into $$OUT as it ends. On the device, pass the
# commit: SPECENGINE_COMMIT=<sha> bash scripts/gpu_run.sh (its copied .git may be stale).
gpu-run:
	SPECENGINE_COMMIT=$${SPECENGINE_COMMIT:-$$(git rev-parse --short HEAD 2>/dev/null)} bash scripts/gpu_run.sh

# Record the real pair's acceptance trace that gpu-run replays (fp32 on this CPU, 4 HumanEval
# prompts x 128 tokens, about 12 minutes on 2 cores).
TRACE_OUT ?= bench/results/trace_qwen25coder_1.5b_0.5b.safetensors
trace: $(STAMP)
	$(PY) -m specengine.replay.record --n-prompts 4 --new 128 --out $(TRACE_OUT)
