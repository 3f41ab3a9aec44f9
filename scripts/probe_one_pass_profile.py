"""Where a one-pass backward's time goes on a GPU: each kernel's mean time per backward (the prologue, the Gluon
kernel, the epilogue) under torch.profiler (`probe_fwd_bwd_gap.kernel_profile`), for the given one-pass variants,
beside SDPA-cuDNN's backward kernels.

    python scripts/probe_one_pass_profile.py --head-dim 64 --seq 16384 --variants one_pass_det,128,128,2,240
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.probe_one_pass_backward import OnePass, variant_spec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--causal", choices=["yes", "no"], default="yes")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--variants", nargs="+", required=True, type=variant_spec,
                    metavar="KIND,BLOCK_M,BLOCK_N,NBUF,REGS[,STAGES]")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_one_pass_profile runs CUDA kernels")
        return 0
    from scripts.probe_fwd_bwd_gap import kernel_profile
    from scripts.probe_gluon_backward import BackwardCell

    cell = BackwardCell(args.head_dim, args.seq, args.causal == "yes")
    print(f"device {torch.cuda.get_device_name()}, D {args.head_dim}, N {args.seq}, B {cell.b}, H 16, "
          f"causal {args.causal}, mean µs per backward over {args.runs}")
    runs = {"SDPA cuDNN backward": cell.cudnn_backward}
    for variant in args.variants:
        runs[variant.label()] = OnePass(variant, cell.q, cell.k, cell.v, cell.o, cell.lse, cell.do, cell.window,
                                        cell.scale)
    for label, fn in runs.items():
        for _ in range(2):  # compiled and warm before the profile
            fn()
        kernels = kernel_profile(fn, args.runs)["kernels"]  # name: (launches per backward, mean µs)
        per_call = {name: count * mean for name, (count, mean) in kernels.items()}
        print(f"\n{label}: {sum(per_call.values()):.1f} µs of GPU work")
        for name, us in sorted(per_call.items(), key=lambda kv: -kv[1]):
            print(f"  {us:9.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
