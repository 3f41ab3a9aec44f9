#!/usr/bin/env bash
# Multi-GPU device call (2 or 4 GPUs). Sections run in the order given (default: tests ddp, which fits one
# 10-minute device call on 2 x H200; the DDP benchmark alone takes ~4 minutes there, twice that with 4 GPUs):
#   bash scripts/gpu_multi.sh tests ddp          # NCCL parity tests, then the interleaved DDP benchmark
#   bash scripts/gpu_multi.sh sharded allreduce  # ZeRO-1 memory/time and the all-reduce sweep
# The DDP and sharding runs use 2 ranks and, with 4 GPUs, 4 ranks too.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
nvidia-smi -L | tee "$OUT/device.txt"
n_gpu=$(nvidia-smi -L | wc -l)
worlds=(2); [ "$n_gpu" -ge 4 ] && worlds=(2 4)
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(tests ddp)
for s in "${sections[@]}"; do
  case $s in
  tests)
    timeout -k 5 150 python3 -m pytest -p no:cacheprovider -p no:pytest_benchmark -q -rf tests/dist tests/optim -k nccl \
      > "$OUT/pytest_nccl.log" 2>&1
    echo "nccl tests exit: $?"; tail -3 "$OUT/pytest_nccl.log" ;;
  ddp)
    # Every world size in one run: the per-world tables and the weak-scaling one (ddp_nccl_scaling.md).
    timeout -k 5 ${DDP_TIMEOUT:-440} python3 -m benchmarks.ddp --world-size "${worlds[@]}" --rounds 3 --iters 7 \
      --out "$OUT/ddp" > "$OUT/ddp.log" 2>&1
    echo "ddp exit: $?"; grep -hE "^\|" "$OUT"/ddp/ddp_nccl_*.md | cut -c1-200 ;;
  sharded)
    for w in "${worlds[@]}"; do
      timeout -k 5 110 python3 -m benchmarks.sharded_optimizer --world-size $w --warmup 1 --iters 3 \
        --out "$OUT/sharded_w$w" > "$OUT/sharded_w$w.log" 2>&1
      echo "sharded world $w exit: $?"; grep -E "^\|" "$OUT/sharded_w$w/sharded_optimizer_nccl.md" | cut -d'|' -f2-9,12
    done ;;
  allreduce)
    timeout -k 5 60 python3 -m benchmarks.allreduce --warmup 3 --iters 10 --out "$OUT/allreduce" > "$OUT/allreduce.log" 2>&1
    echo "allreduce exit: $?"; grep -E "^\|" "$OUT/allreduce/allreduce_nccl.md" ;;
  *) echo "unknown section $s"; exit 2 ;;
  esac
done
