#!/usr/bin/env bash
# Two-GPU device call: NCCL parity tests, then the DDP, sharded-optimizer and all-reduce benchmarks.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee "$OUT/device.txt"
timeout -k 5 80 python3 -m pytest -p no:cacheprovider -p no:pytest_benchmark -q -rf tests/dist -k nccl > "$OUT/pytest_nccl.log" 2>&1
echo "nccl tests exit: $?"; tail -3 "$OUT/pytest_nccl.log"
timeout -k 5 90 python3 benchmarks/ddp.py --warmup 2 --iters 5 --out "$OUT/ddp" > "$OUT/ddp.log" 2>&1
echo "ddp exit: $?"; grep -E "^\|" "$OUT/ddp/ddp_nccl.md" | cut -c1-160; grep -E "o = " "$OUT/ddp/ddp_nccl.md" | cut -c1-400
timeout -k 5 100 python3 benchmarks/sharded_optimizer.py --warmup 1 --iters 3 --out "$OUT/sharded" > "$OUT/sharded.log" 2>&1
echo "sharded exit: $?"; grep -E "^\|" "$OUT/sharded/sharded_optimizer_nccl.md" | cut -c1-240
timeout -k 5 45 python3 benchmarks/allreduce.py --warmup 3 --iters 10 --out "$OUT/allreduce" > "$OUT/allreduce.log" 2>&1
echo "allreduce exit: $?"; grep -E "^\|" "$OUT/allreduce/allreduce_nccl.md"
