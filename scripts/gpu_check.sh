#!/usr/bin/env bash
# GPU bring-up in one script (issue: GPU bring-up; docs/design.md "GPU check").
#   scripts/gpu_check.sh tests   install (CUDA extension for sm_90), pytest -m gpu
#   scripts/gpu_check.sh bench   kernel microbenchmarks + end-to-end GPU benchmark (after tests)
#   scripts/gpu_check.sh suite   the rest of the suite with every kernel on CUDA (after tests)
#   scripts/gpu_check.sh         tests bench suite, in that order (about 10 minutes on an H100)
# Runs with the machine's own python3 (torch/triton/transformers preinstalled, no network).
# Every result is JSON under bench/results/ (and copied to $OUT when that is set).
set -uo pipefail
PARTS=" ${*:-tests bench suite} "
PY=${PYTHON:-python3}
RES=bench/results
mkdir -p "$RES" build/gpu-logs
DEV=$($PY -c "import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else 'nogpu')")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0
step() {  # step NAME CMD...: run, log, remember failures, keep going
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "build/gpu-logs/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}

$PY - <<'PY'
import json, subprocess, torch
from specengine.benchmark import environment
env = environment()
env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                                    "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(json.dumps(env, indent=1))
PY

if [[ $PARTS == *" tests "* ]]; then
  export TORCH_CUDA_ARCH_LIST=9.0 SPECENGINE_BUILD_EXT=1
  step install $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e .
  step ext $PY -c "from specengine.runtime import kv_compact as k; assert k.extension_available(), 'KV extension not built'; print('kv extension:', k._kvext.__file__)"
  step gpu-tests timeout ${GPU_TESTS_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -m gpu --junitxml=build/gpu-logs/gpu_tests_$DEV.xml tests
fi
if [[ $PARTS == *" bench "* ]]; then
  step kernels timeout ${KERNELS_TIMEOUT:-300} $PY bench/gpu_kernels.py --out $RES/gpu_kernels_$DEV.json
  step e2e timeout ${E2E_TIMEOUT:-400} $PY bench/gpu_e2e.py --out $RES/gpu_e2e_$DEV.json
fi
if [[ $PARTS == *" suite "* ]]; then
  step suite-on-cuda timeout ${SUITE_TIMEOUT:-330} $PY -m pytest -q -p no:cacheprovider -m "not real and not gpu" -n 8 --timeout 120 -v \
    --junitxml=build/gpu-logs/gpu_suite_$DEV.xml tests
fi
if [ -n "${OUT:-}" ]; then cp $RES/gpu_* "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" build/gpu-logs; fi
exit $status
