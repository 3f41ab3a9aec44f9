"""Where a one-pass backward's time goes on a GPU: each kernel's mean time (the prologue, the Gluon kernel, the
epilogue) under torch.profiler, for the given one-pass variants and cells, beside SDPA-cuDNN's backward kernels.

    python scripts/probe_one_pass_profile.py --head-dim 64 --seq 16384 --variants one_pass_det,128,128,2,240
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def profile(fn, runs: int) -> dict[str, float]:
    """Mean µs per call of each CUDA kernel `fn` launches, over `runs` calls after two warm-up calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:70]] += event.device_time / runs
    return dict(totals)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--causal", choices=["yes", "no"], default="yes")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--variants", nargs="+", required=True, metavar="KIND,BLOCK_M,BLOCK_N,NBUF,REGS[,STAGES]")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_one_pass_profile runs CUDA kernels")
        return 0
    from flashsys.ops.attention import flash_gluon
    from scripts.probe_gluon_backward import BackwardCell
    from scripts.probe_one_pass_backward import OnePass

    cell = BackwardCell(args.head_dim, args.seq, args.causal == "yes")
    print(f"device {torch.cuda.get_device_name()}, D {args.head_dim}, N {args.seq}, B {cell.b}, H 16, "
          f"causal {args.causal}, mean µs per backward over {args.runs}")
    runs = {"SDPA cuDNN backward": cell.cudnn_backward}
    for spec in args.variants:
        kind, *numbers = spec.split(",")
        variant = flash_gluon.Variant(kind, *(int(x) for x in numbers))
        runs[variant.label()] = OnePass(variant, cell.q, cell.k, cell.v, cell.o, cell.lse, cell.do, cell.window,
                                        cell.scale)
    for label, fn in runs.items():
        kernels = profile(fn, args.runs)
        print(f"\n{label}: {sum(kernels.values()):.1f} µs of kernels")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
