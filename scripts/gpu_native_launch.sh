#!/usr/bin/env bash
# #14, native launcher on one GPU: build it, run its tests and the eager-plan tests, then the host-cost table
# (flashsys with the native launcher and with the Python path, beside SDPA, in turns).
#   bash scripts/gpu_native_launch.sh [build] [tests] [host_cost]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(build tests host_cost)
for s in "${sections[@]}"; do
  case $s in
  build)
    python3 - <<'PY' 2>&1 | tee "$OUT/native_build.txt"
import time, torch, triton
from flashsys.ops.attention import native_launch
t = time.time()
ok = native_launch.wait()
print(f"native launcher: {native_launch.status()} after {time.time() - t:.1f} s (torch {torch.__version__}, triton {triton.__version__})")
PY
    ;;
  tests)
    timeout -k 10 ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -p no:pytest_benchmark --tb=short -rf -q \
      tests/ops/test_native_launch.py tests/ops/test_eager_plans.py > "$OUT/pytest_native.log" 2>&1
    echo "pytest exit: $?"; tail -25 "$OUT/pytest_native.log" ;;
  host_cost)
    timeout -k 10 ${HOST_TIMEOUT:-240} python3 -m benchmarks.host_cost --out "$OUT/host_cost" --rounds 21 --no-progress \
      > "$OUT/host_cost.log" 2>&1
    echo "host_cost exit: $?"; grep -E "^\| |^- " "$OUT"/host_cost/host_cost_gpu.md ;;
  esac
done
