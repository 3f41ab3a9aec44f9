#!/usr/bin/env bash
# Device calls for the Gluon kernels (#16): their GPU tests, the host-cost probe that sets flash_gluon.MIN_WORK, the
# backward's timings.
#   bash scripts/gpu_gluon.sh tests host backward
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
for s in "$@"; do
  case $s in
  tests)
    timeout -k 10 ${TEST_TIMEOUT:-300} python3 -m pytest -n 4 -p no:cacheprovider -p no:pytest_benchmark --tb=short -rf \
      -v tests/ops/test_gluon_forward.py tests/ops/test_gluon_backward.py > "$OUT/gluon_tests.log" 2>&1
    echo "gluon tests exit: $?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/gluon_tests.log" | grep -v "^\[gw" | tail -25 ;;
  host)
    timeout -k 10 150 python3 scripts/probe_gluon_host.py 2>&1 | tee "$OUT/gluon_host.txt" ;;
  backward)
    timeout -k 10 ${PROBE_TIMEOUT:-240} python3 scripts/probe_gluon_backward.py --head-dims 64 128 --seqs 4096 16384 2>&1 \
      | tee "$OUT/gluon_backward.txt" ;;
  esac
done
