#!/usr/bin/env bash
# One device call: GPU tests of the attention ops, then the leaderboard. Results go to $OUT (or /tmp/out).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
python3 scripts/dev/compile_probe.py 2>&1 | grep -v "^E1121" | tail -40
FLASHSYS_TRITON_AUTOTUNE=0 timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark --tb=short -rf -v tests/ops ${PYTEST_ARGS:-} 2>&1 | grep -E "PASSED|FAILED|ERROR|Error|assert|passed|failed" | tail -60 | tee "$OUT/pytest_ops.txt"
timeout ${LB_TIMEOUT:-220} python3 benchmarks/leaderboard.py ${LB_ARGS:-} --out "$OUT/leaderboard.md" 2>&1 | tail -30
