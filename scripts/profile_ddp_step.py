"""Profile the data-parallel step of chosen `benchmarks.ddp` variants (GPU probe; rank 0 prints, writes $OUT traces).

Why: `benchmarks.ddp` shows where a variant's extra time goes by phase (forward, backward, step); this names the
kernels and collectives inside: torch.profiler over two steps per variant after two warm-up steps.

    python scripts/profile_ddp_step.py "BucketedDDP (default: auto)" "ZeRO-2: BucketedDDP + ZeRO2Optimizer"
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's benchmarks, flashsys

from benchmarks.ddp import VARIANTS, train_step  # noqa: E402
from benchmarks.harness import distributed_model_config, token_batch  # noqa: E402
from flashsys.dist import spawn  # noqa: E402
from flashsys.nn import TransformerLM  # noqa: E402


def worker(rank, world, device, names):
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = distributed_model_config(SimpleNamespace(preset="xl", context=512))
    x = token_batch(cfg, 16, device, torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = TransformerLM.from_config(cfg, device=device)
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    for name in names:
        built = VARIANTS[name](model, device)

        for _ in range(2):
            train_step(built, x, autocast)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                train_step(built, x, autocast)
            if hasattr(built.opt, "wait_for_parameters"):
                built.opt.wait_for_parameters()
            torch.cuda.synchronize()
        if rank == 0:
            print(f"\n===== {name}: 2 steps =====")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
            out = os.environ.get("OUT")
            if out:
                prof.export_chrome_trace(os.path.join(out, f"trace_{names.index(name)}.json"))
        for undo in built.teardown:
            undo()
        del built
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", choices=list(VARIANTS), metavar="VARIANT",
                    help="variants of benchmarks.ddp to profile, one after the other: " + "; ".join(VARIANTS))
    names = ap.parse_args().variants
    if torch.cuda.device_count() < 2:
        ap.error(f"needs 2 CUDA GPUs (NCCL), found {torch.cuda.device_count()}")
    spawn(worker, 2, names, backend="nccl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
