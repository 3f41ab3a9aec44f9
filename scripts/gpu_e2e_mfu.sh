#!/usr/bin/env bash
# #14 device call: compile/fast-launch tests, the end-to-end comparison (flash vs SDPA, eager and compiled),
# the MFU run of `flashsys train`, and a host-time profile. Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
timeout -k 5 170 python3 -m pytest -n 6 -p no:cacheprovider -p no:pytest_benchmark --tb=line -rf -q \
  tests/ops/test_attention_contract.py tests/nn/test_modules.py > "$OUT/pytest.log" 2>&1
echo "pytest exit: $?"; grep -E "^FAILED|^ERROR|passed|failed|^/work.*Error" "$OUT/pytest.log" | tail -12
timeout -k 5 250 python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" --presets small --contexts 512 2048 \
  --dtype bf16 --attention flash sdpa --modes eager compiled --warmup 3 --iters 10 > "$OUT/end_to_end.log" 2>&1
echo "e2e exit: $?"; grep -E "^\| " "$OUT"/end_to_end/*.md | cut -d'|' -f2-8,12,15
timeout -k 5 110 python3 -m flashsys train --preset small --context-length 1024 --dtype bfloat16 --batch-size 64 \
  --steps 25 --out "$OUT/mfu_run" > "$OUT/mfu_run.log" 2>&1
echo "train exit: $?"; grep -E "throughput|peak memory|loss|error" "$OUT/mfu_run.log" | tail -5
timeout -k 5 30 python3 scripts/profile_host.py > "$OUT/profile.txt" 2>&1; head -45 "$OUT/profile.txt" | tail -32
