#!/usr/bin/env bash
# GPU bring-up in one script (docs/design.md "GPU check"). Parts, run in the order given:
#   tests    install (CUDA extension for sm_90), pytest -m gpu
#   ar       bench/gpu_e2e.py --only ar: the target step unfused / fused / torch.compile, MBU,
#            kernels per layer (issue 25's figures; after tests)
#   spec     bench/gpu_e2e.py: every method, HF peers, all-accept bound, batch-invariant,
#            projections (issue 26's figures)
#   kernels  kernel microbenchmarks (rejection sampling, verify attention vs SDPA, compact_kv)
#   suite    the rest of the suite with every kernel on CUDA
#   bench    = ar spec kernels
# Default: tests ar spec kernels suite. Each part has its own time limit (env *_TIMEOUT), so
# two device commands of <= 10 minutes are `GPU_PARTS="tests ar"` (<= 540 s of limits plus the
# install) then `GPU_PARTS="spec kernels suite"` (<= 590 s)
# (timings on an H100 not measured yet: lower the limits if the second runs long).
# Runs with the machine's own python3 (torch/triton/transformers preinstalled, no network).
# Every result is JSON under bench/results/, written row by row (copied to $OUT when set).
set -uo pipefail
PARTS=" ${*:-tests ar spec kernels suite} "
PARTS=${PARTS/ bench / ar spec kernels }
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

install() {  # editable install with the CUDA extension (a fresh machine has neither)
  export TORCH_CUDA_ARCH_LIST=9.0 SPECENGINE_BUILD_EXT=1
  step install $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e .
  step ext $PY -c "from specengine.runtime import kv_compact as k; assert k.extension_available(), 'KV extension not built'; print('kv extension:', k._kvext.__file__)"
}
PYBIN=$(cd "$(dirname "$(command -v "$PY")")" && pwd)/$(basename "$PY")  # absolute, venv kept
if [[ $PARTS == *" tests "* ]] || ! (cd / && "$PYBIN" -c "import specengine" 2>/dev/null); then
  install
fi
if [[ $PARTS == *" tests "* ]]; then
  step gpu-tests timeout ${GPU_TESTS_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider -m gpu --junitxml=build/gpu-logs/gpu_tests_$DEV.xml tests
fi
if [[ $PARTS == *" ar "* ]]; then
  step e2e-ar timeout ${E2E_AR_TIMEOUT:-300} $PY bench/gpu_e2e.py --only ar --out $RES/gpu_e2e_ar_$DEV.json
fi
if [[ $PARTS == *" spec "* ]]; then
  step e2e-spec timeout ${E2E_SPEC_TIMEOUT:-300} $PY bench/gpu_e2e.py --only spec,peers,allaccept,invariant \
    --out $RES/gpu_e2e_$DEV.json
fi
if [[ $PARTS == *" kernels "* ]]; then
  step kernels timeout ${KERNELS_TIMEOUT:-120} $PY bench/gpu_kernels.py --out $RES/gpu_kernels_$DEV.json
fi
if [[ $PARTS == *" suite "* ]]; then
  step suite-on-cuda timeout ${SUITE_TIMEOUT:-170} $PY -m pytest -q -p no:cacheprovider -m "not real and not gpu" -n 16 --timeout 120 -v \
    --junitxml=build/gpu-logs/gpu_suite_$DEV.xml tests
fi
if [ -n "${OUT:-}" ]; then cp $RES/gpu_* "$OUT"/ 2>/dev/null; tar czf "$OUT/logs.tgz" build/gpu-logs; fi
exit $status
