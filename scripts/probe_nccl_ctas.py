"""One 300 MB all-reduce on 2 GPUs at each NCCL `max_ctas` cap: time and bandwidth (GPU probe for #17; prints).

The groups are `benchmarks.ddp`'s own (`_nccl_group`), so the caps timed here are the ones its rows use. Run with
`NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING` to see the transport and protocol NCCL picks as well.

    PYTHONPATH=$PWD python3 scripts/probe_nccl_ctas.py
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from benchmarks.ddp import _nccl_group
from flashsys.dist import spawn
from flashsys.timing import repeat

NBYTES = 300 * 2**20


def worker(rank: int, world: int, device: torch.device) -> None:
    x = torch.randn(NBYTES // 4, device=device)
    for max_ctas in (None, 2, 4, 8, 16, 32):
        group = None if max_ctas is None else _nccl_group(max_ctas)
        ms = statistics.median(repeat(lambda: dist.all_reduce(x, group=group), warmup=3, iters=10, device=device,
                                      barrier=True, group=group))
        if rank == 0:
            print(f"max_ctas={max_ctas or 'default'}: 300 MB all-reduce {ms:.2f} ms, "
                  f"algbw {NBYTES / ms / 1e6:.1f} GB/s", flush=True)


if __name__ == "__main__":
    spawn(worker, 2, backend="nccl")
