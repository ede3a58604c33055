#!/usr/bin/env bash
# GPU bring-up (docs/design.md "GPU check"), in two device commands of <= 10 minutes:
#   make gpu-check GPU_PARTS=first    install, check, e2e-first: kernels checked, the ar step (<= 6 min)
#   make gpu-check GPU_PARTS=second   (install,) gpu-tests, e2e-second, kernels, suite: the rest
# Parts:
#   install     editable install with the CUDA extension (sm_90); skipped when it is built
#               (134 s on the first H100 run, 77df1d5); GPU_NO_EXT=1 installs without it (3 s)
#   check       every Triton kernel against its torch reference on CUDA, bf16 included (the
#               kernel test files), before any timing is believed
#   e2e-first   bench/gpu_e2e.py --only first: the fused, graphed ar step of the 0.5B/1.5B/7B
#               shapes with kernel profiles (what each method gains: make gpu-run, which replays
#               the real pair's acceptance; random weights reject every draft)
#   gpu-tests   pytest -m gpu
#   e2e-second  bench/gpu_e2e.py --only second: every method's all-accept bound (draft = the
#               target: engine cost), batch-invariant mode, ar variants, torch.compile of ours last
#   kernels     kernel microbenchmarks (rejection sampling, verify attention vs SDPA, compact_kv)
#   suite       the rest of the suite on CUDA (two workers at most: few CUDA contexts), then
#               the tests marked `interpreter` (kernels on CPU tensors) in a process of their own
# Each part has its own limit (env <PART>_TIMEOUT, e.g. E2E_FIRST_TIMEOUT; a command's limits add
# up to under its 600 s) and, the moment it ends (also when its limit kills it), its JSON, a line
# of $OUT/summary.txt and its log (in $OUT/gpu_check_logs.tar) are in $OUT, so a command killed
# at the device's limit still returns everything finished before.
# GPU_SMOKE=1 rehearses every part on this CPU with tiny shapes (results under build/).
set -uo pipefail
PARTS=" ${*:-first second} "
PARTS=${PARTS/ first / install check e2e-first }
PARTS=${PARTS/ second / install gpu-tests e2e-second kernels suite }
PARTS=${PARTS/ bench / e2e-first e2e-second kernels }
SMOKE=${GPU_SMOKE:-}
if [ -n "$SMOKE" ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  RES=${GPU_RESULTS:-build/gpu-smoke/results}; E2E_FLAGS=--smoke
else
  PY=${PYTHON:-python3}; RES=${GPU_RESULTS:-bench/results}; E2E_FLAGS=
fi
OUT=${OUT:-}
LOGS=build/gpu-logs
mkdir -p "$RES" "$LOGS" ${OUT:+"$OUT"}
DEV=$($PY -c "import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else 'cpu')")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0

publish() {  # publish NAME RC SECONDS FILES...: into $OUT now, with a summary line
  local name=$1 rc=$2 secs=$3; shift 3
  local line="$name: rc=$rc in ${secs} s$([ "$rc" = 124 ] && echo ' (killed by its limit: partial results)')"
  echo "=== $line"
  [ -n "$OUT" ] || return 0
  echo "$line" >> "$OUT/summary.txt"
  # a device command returns at most 8 files: logs and junit files go into one tar, appended
  # part by part; the results (JSON, summaries) come back as files of their own
  [ -f "$LOGS/$name.log" ] && tar -rf "$OUT/gpu_check_logs.tar" -C "$LOGS" "$name.log"
  for f in "$@"; do
    [ -f "$f" ] || continue
    case $f in
      *.json|*.txt) cp "$f" "$OUT/" ;;
      *) tar -rf "$OUT/gpu_check_logs.tar" -C "$(dirname "$f")" "$(basename "$f")" ;;
    esac
  done
  return 0
}
step() {  # step NAME LIMIT_S "FILES" CMD...: run under its limit, log, publish, keep going
  local name=$1 limit=$2 files=$3; shift 3
  echo "=== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=20 "$limit" "$@" > >(tee "$LOGS/$name.log") 2>&1
  local rc=$?
  [ "$rc" = 0 ] || status=1
  # shellcheck disable=SC2086
  publish "$name" "$rc" $((SECONDS - t0)) $files
}
has() { [[ $PARTS == *" $1 "* ]]; }


EXT_CHECK="from specengine.runtime import kv_compact as k; assert k.extension_available(), 'KV extension not built'; \
print('kv extension:', k._kvext.__file__)"
# a warm machine (the second command right after the first) keeps the build: install only when it is missing.
# GPU_NO_EXT=1: install without the KV extension (3 s instead of 134 s on the first H100 run; only
# compact_kv's "ext" backend needs it, and its CUDA test then skips): for short device windows
if has install && [ -z "$SMOKE" ] && [ -n "${GPU_NO_EXT:-}" ]; then
  SPECENGINE_BUILD_EXT=0 step install 60 "" $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e .
elif has install && [ -z "$SMOKE" ] && ! $PY -c "$EXT_CHECK" >/dev/null 2>&1; then
  export TORCH_CUDA_ARCH_LIST=9.0 SPECENGINE_BUILD_EXT=1 MAX_JOBS=${MAX_JOBS:-16}
  step install 200 "" $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e .
  step ext 30 "" $PY -c "$EXT_CHECK"
fi
# after the install: the package must import (on a bare machine it does not before)
$PY - > "$LOGS/environment.json" <<'PY'
import json, subprocess, torch
from specengine.benchmark import environment
env = environment()
if torch.cuda.is_available():
    env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                        "clocks.max.mem", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(json.dumps(env, indent=1))
PY
publish environment $? 0 "$LOGS/environment.json"
KERNEL_TESTS="tests/ops/test_fused_step_ops.py tests/ops/test_verify_attention.py tests/ops/test_commit_tokens.py
  tests/ops/test_draft_sampling.py tests/ops/test_rejection_sampling.py tests/ops/test_quant_matmul_triton.py"
if has check; then  # smoke: one op, under the interpreter
  SELECT=(); [ -n "$SMOKE" ] && SELECT=(-k silu_and_mul)
  # shellcheck disable=SC2086
  step check ${CHECK_TIMEOUT:-100} "$LOGS/check_$DEV.xml" $PY -m pytest -q -p no:cacheprovider $KERNEL_TESTS \
    "${SELECT[@]}" --durations=15 --junitxml="$LOGS/check_$DEV.xml"
fi
if has e2e-first; then
  step e2e-first ${E2E_FIRST_TIMEOUT:-250} "$RES/gpu_e2e_first_$DEV.json $RES/gpu_e2e_first_$DEV.summary.txt" \
    $PY bench/gpu_e2e.py $E2E_FLAGS --only first --out "$RES/gpu_e2e_first_$DEV.json"
fi
if has gpu-tests; then
  step gpu-tests ${GPU_TESTS_TIMEOUT:-90} "$LOGS/gpu_tests_$DEV.xml" $PY -m pytest -q -p no:cacheprovider -m gpu \
    ${SMOKE:+tests/ops/test_verify_attention.py} --junitxml="$LOGS/gpu_tests_$DEV.xml"
fi
if has e2e-second; then
  step e2e-second ${E2E_SECOND_TIMEOUT:-240} "$RES/gpu_e2e_second_$DEV.json $RES/gpu_e2e_second_$DEV.summary.txt" \
    $PY bench/gpu_e2e.py $E2E_FLAGS --only second --out "$RES/gpu_e2e_second_$DEV.json"
fi
if has kernels; then
  if [ -n "$SMOKE" ]; then  # each microbenchmark's torch provider, one shape each, on the CPU
    step kernels ${KERNELS_TIMEOUT:-120} "" env SPECENGINE_BENCH_CPU=1 $PY -m pytest -q -p no:cacheprovider \
      bench/ops/fused_ops.py bench/ops/verify_attention.py bench/ops/rejection_sampling.py --benchmark-disable \
      -k "torch and not compile and ([1-0.5B-torch] or [chain-1-4-512-qwen2.5-1.5b-torch] or [tree-1-4-512-qwen2.5-1.5b-torch] or 1-4-32000-torch])"
  else
    step kernels ${KERNELS_TIMEOUT:-60} "$RES/gpu_kernels_$DEV.json" $PY bench/gpu_kernels.py --out "$RES/gpu_kernels_$DEV.json"
  fi
fi
if has suite; then  # two workers at most (two CUDA contexts), where xdist is installed; smoke: one file, one process
  FLAGS=$($PY -c "import importlib.util as u; print(('--timeout 120 ' if u.find_spec('pytest_timeout') else '') + \
('-n 2' if u.find_spec('xdist') and not '$SMOKE' else ''))")
  # shellcheck disable=SC2086
  step suite ${SUITE_TIMEOUT:-120} "$LOGS/gpu_suite_$DEV.xml" $PY -m pytest -q -p no:cacheprovider \
    -m "not real and not gpu and not interpreter" ${SMOKE:+tests/runtime/test_config.py} $FLAGS --junitxml="$LOGS/gpu_suite_$DEV.xml"
  # the tests that run kernels on CPU tensors, under the interpreter in a process of their own
  # (smoke: one quick file of them; the launch-count tests take minutes there and run in the suite)
  # shellcheck disable=SC2086
  step suite-interpreter ${SUITE_INTERPRETER_TIMEOUT:-60} "$LOGS/gpu_suite_interpreter_$DEV.xml" env \
    SPECENGINE_TEST_INTERPRETER=1 CUDA_VISIBLE_DEVICES= $PY -m pytest -q -p no:cacheprovider -m interpreter \
    ${SMOKE:+tests/ops/test_attention_window.py} $FLAGS --junitxml="$LOGS/gpu_suite_interpreter_$DEV.xml"
fi
exit $status
