"""All-reduce latency, algorithm bandwidth and bus bandwidth: gloo on CPU, NCCL on GPU.

Sizes 1 MB ... 1 GB of float32, world sizes as the machine allows. Every rank times its own calls; the times are
gathered with all_gather_object and the slowest rank's mean is reported (a collective ends when its last rank
does). bus bandwidth = algorithm bandwidth x 2(n-1)/n, the ring all-reduce's traffic per rank.
Runs under torchrun (one world) or spawns its own processes for each world size.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.distributed as dist

from benchmarks.harness import (
    ON_GPU, add_common_args, environment, pyplot, read_result, result_path, save_plot, spawn_for_result, write_result,
    write_table,
)
from flashsys.dist import init_from_env, launched_by_torchrun, shutdown
from flashsys.timing import repeat


def worker(rank, world, device, sizes_mb, warmup, iters, out_json):
    rows = []
    for mb in sizes_mb:
        n = int(mb * 2**20) // 4
        buf = torch.randn(n, device=device)
        times = repeat(functools.partial(dist.all_reduce, buf), warmup=warmup, iters=iters, device=device, barrier=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, statistics.fmean(times))
        if rank == 0:
            ms = max(gathered)
            alg = mb * 2**20 / (ms / 1e3) / 1e9
            rows.append({"backend": dist.get_backend(), "world_size": world, "size_MB": mb, "latency_ms": ms,
                         "per_rank_ms": " / ".join(f"{g:.3f}" for g in gathered),
                         "algbw_GBps": alg, "busbw_GBps": alg * 2 * (world - 1) / world})
        del buf
    write_result(rank, out_json, rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "allreduce")
    p.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 10, 100, 1024] if ON_GPU else [1, 10, 64])
    n_gpu = torch.cuda.device_count() if ON_GPU else 0
    p.add_argument("--world-sizes", nargs="+", type=int,
                   default=[w for w in (2, 4, 6, 8) if w <= n_gpu] if ON_GPU else [2, 4])
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if ON_GPU else "gloo")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    if launched_by_torchrun():
        rank, world, device = init_from_env(args.backend)
        tmp = result_path(args.out)
        worker(rank, world, device, args.sizes_mb, args.warmup, args.iters, tmp)
        shutdown()
        if rank != 0:
            return 0
        rows = read_result(tmp)
    else:
        for world in args.world_sizes:
            rows += spawn_for_result(worker, world, args.sizes_mb, args.warmup, args.iters, backend=args.backend,
                                     scratch_dir=args.out)
    path = write_table(rows, args.out, f"allreduce_{args.backend}", "All-reduce (float32, SUM)",
                       [f"{args.iters} timed calls after {args.warmup} warm-up, each after a barrier; latency is the "
                        "slowest rank's mean."], environment())
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for world in sorted({r["world_size"] for r in rows}):
        pts = [(r["size_MB"], r["busbw_GBps"]) for r in rows if r["world_size"] == world]
        ax.plot(*zip(*pts), marker="o", label=f"{world} ranks")
    ax.set_xscale("log")
    ax.set_xlabel("message size (MB)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"all-reduce, {args.backend}")
    ax.legend()
    save_plot(fig, args.out, f"allreduce_{args.backend}")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
