#!/usr/bin/env bash
# #14 device call: host cost before/after (an older tree in .old/, same process kind, same machine), the compile
# and fast-launch tests, the leaderboard, and a compiled-model smoke run. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
if [ -d .old ]; then
  (cd .old && PYTHONPATH=$PWD timeout -k 10 120 python3 -m benchmarks.host_cost --out "$OUT/host_cost" --name host_cost_gpu_before \
     > "$OUT/host_cost_before.log" 2>&1; echo "host_cost before exit: $?")
  grep -E "^\| " "$OUT/host_cost/host_cost_gpu_before.md"
fi
timeout -k 10 120 python3 -m benchmarks.host_cost --out "$OUT/host_cost" --breakdown > "$OUT/host_cost.log" 2>&1
echo "host_cost exit: $?"; grep -E "^\| " "$OUT/host_cost/host_cost_gpu.md" "$OUT/host_cost/host_cost_gpu_breakdown.md"
timeout -k 10 ${TEST_TIMEOUT:-300} python3 -m pytest -n 8 -p no:cacheprovider --tb=short -rf -q \
  tests/ops tests/nn > "$OUT/pytest_compile.log" 2>&1
echo "pytest exit: $?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/pytest_compile.log" | tail -25
timeout -k 10 160 python3 -m benchmarks.leaderboard --out "$OUT" > "$OUT/leaderboard.log" 2>&1
echo "leaderboard exit: $?"; grep -E "^\| |^- (fwd|bwd)" "$OUT/leaderboard.md"
if [ -n "${E2E_SMOKE:-}" ]; then
  timeout -k 10 200 python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" --presets small --contexts 512 \
    --dtype bf16 --attention flash sdpa --modes eager compiled --warmup 3 --iters 10 > "$OUT/end_to_end_smoke.log" 2>&1
  echo "e2e smoke exit: $?"; grep -E "^\| " "$OUT"/end_to_end/*.md | cut -c1-220
fi
