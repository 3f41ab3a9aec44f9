#!/usr/bin/env bash
# One device call: GPU tests of the attention ops, then the leaderboard. Results go to $OUT (or /tmp/out).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  FLASHSYS_TRITON_AUTOTUNE=0 timeout -k 10 ${TEST_TIMEOUT:-330} python3 -m pytest -n 8 -p no:cacheprovider -p no:pytest_benchmark \
    --tb=short -rf -v --durations=12 tests/ops ${PYTEST_ARGS:-} > "$OUT/pytest_ops.log" 2>&1
  echo "pytest exit: $?"
  grep -E "FAILED|passed|failed" "$OUT/pytest_ops.log" | grep -v "^\[gw" | tail -30
  grep -E "^[0-9.]+s (call|setup)" "$OUT/pytest_ops.log" | head -12
fi
if [ "${SKIP_LB:-0}" != 1 ]; then
  timeout -k 10 ${LB_TIMEOUT:-240} python3 benchmarks/leaderboard.py ${LB_ARGS:-} --out "$OUT/leaderboard.md" > "$OUT/leaderboard.log" 2>&1
  grep -vE "^E1121|Warning|warn\(" "$OUT/leaderboard.log" | tail -25
fi
