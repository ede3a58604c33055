#!/usr/bin/env bash
# The one GPU command (docs/design.md, "The GPU run"): fits a 15-minute device window, at most
# 8 minutes with the install by its sections' limits (6 min 3 s on an H200 at 6e30035, the machine's
# start ~35 s more; no extension build; the device's own torch/triton; `make gpu-rehearsal` runs it
# here under those versions):
#   SPECENGINE_COMMIT=<sha> bash scripts/gpu_run.sh        (make gpu-run passes the commit)
# Sections, each under its own limit, each JSON into $OUT the moment it ends:
#   step         the fused, graphed ar step of the 0.5B / 1.5B / 7B shapes, cuBLAS's linears and
#                our fused few-row ones (gemv), then warmup()'s timed choice between them (first: short)
#   replay_7b    every method on 7B/0.5B shapes replaying the real pair's trace, then γ auto and the
#   replay_1.5b  hybrid with every proposal rejected, then ar / γ auto / hybrid with the fused gemv
#                linears; the same on 1.5B/0.5B
#   peers        HF generate (bf16, sdpa) and a torch.compile'd ar (gpt-fast) on the same prompts
#   pearl        PEARL last, in a process of its own (it hung once on a GPU), real and rejecting traces
# then one screen (summary.txt), the logs (logs.tar) and the Triton cache (triton_cache.tar.gz:
# bring it back as build/triton-cache.tar.gz, carried, and the next run skips its compiles).
# GPU_SMOKE=1 rehearses the whole command on this CPU (tiny layers, the real trace); with
# GPU_SMOKE_STALL=<section> that section hangs and its limit must stop it (tests/repo/test_gpu_run.py).
set -uo pipefail
SMOKE=${GPU_SMOKE:-}
OUT=${OUT:-build/gpu-run}
LOGS=build/gpu-logs
mkdir -p "$OUT" "$LOGS"
rm -f "$LOGS"/*.log; : > "$LOGS/sections.txt"  # this run's logs only
if [ -n "$SMOKE" ]; then
  PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  FLAGS=(--smoke); SCALE=1
else
  PY=${PYTHON:-python3}; FLAGS=(); SCALE=1
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_CACHE_DIR=$PWD/build/triton-cache
export GPU_CONFIG_LIMIT_S=${GPU_CONFIG_LIMIT_S:-40}  # one method's warm-up + timed calls
T0=$SECONDS
[ -f build/triton-cache.tar.gz ] && tar -xzf build/triton-cache.tar.gz -C build && echo "triton cache: carried"
if [ -z "$SMOKE" ]; then
  SPECENGINE_BUILD_EXT=0 timeout 120 $PY -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . \
    > "$LOGS/install.log" 2>&1 || { echo "install failed"; cat "$LOGS/install.log"; }
fi
status=0
section() {  # section NAME LIMIT_S ARGS...: run under its limit; its JSON is already in $OUT
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit} s)"
  if [ "${GPU_SMOKE_STALL:-}" = "$name" ] && [ -n "$SMOKE" ]; then  # a section that never ends, cut short
    limit=15; timeout -k 5 "$limit" "$PY" -c "import time; time.sleep(3600)" > "$LOGS/$name.log" 2>&1
  else
    timeout -k 10 "$limit" "$PY" bench/gpu_replay.py "$@" "${FLAGS[@]}" --out "$OUT/$name.json" 2>&1 \
      | tee "$LOGS/$name.log"
  fi
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || status=1
  echo "$name: rc=$rc in $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (stopped by its limit: rows so far kept)')" \
    | tee -a "$LOGS/sections.txt"
}
section step 90 step
section replay_7b 140 replay --pair 7b
section replay_1.5b 100 replay --pair 1.5b
section peers 90 peers
section pearl 60 pearl
{ $PY bench/gpu_replay.py table "$OUT"; echo; cat "$LOGS/sections.txt"; echo "total: $((SECONDS - T0)) s"; } \
  | tee "$OUT/summary.txt"
tar -cf "$OUT/logs.tar" -C "$LOGS" .
[ -d build/triton-cache ] && tar -czf "$OUT/triton_cache.tar.gz" -C build triton-cache
exit $status
