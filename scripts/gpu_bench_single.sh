#!/usr/bin/env bash
# One-GPU device call: GPU tests of ops and nn, the leaderboard, and the attention/end-to-end benchmarks.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
FLASHSYS_TRITON_AUTOTUNE=0 timeout -k 10 ${TEST_TIMEOUT:-280} python3 -m pytest -n 8 -p no:cacheprovider -p no:pytest_benchmark \
  --tb=short -rf -v tests/ops tests/nn > "$OUT/pytest_gpu.log" 2>&1
echo "pytest exit: $?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_gpu.log" | grep -v "^\[gw" | tail -15
grep -c PASSED "$OUT/pytest_gpu.log"
timeout -k 10 200 python3 benchmarks/leaderboard.py --out "$OUT/leaderboard.md" > "$OUT/leaderboard.log" 2>&1
grep -E "^\| " "$OUT/leaderboard.md"; grep -E "^- (fwd|bwd)" "$OUT/leaderboard.md"
timeout -k 10 ${ATT_TIMEOUT:-200} python3 benchmarks/attention.py --no-progress --out "$OUT/attention" \
  --impls flash-triton sdpa-flash sdpa-cudnn --head-dims 64 128 --seq-lens 1024 2048 4096 8192 16384 \
  --dtypes bf16 --causal both --rep 50 > "$OUT/attention.log" 2>&1
echo "attention exit: $?"; grep -E "^\| flash-triton" "$OUT/attention/attention_gpu.md" | cut -d'|' -f2-6,9,10,12 | head -24
