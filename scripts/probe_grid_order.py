"""How the kernels' program order changes their time, for grid_order.py: forward and backward of flashsys at several
head-group sizes (programs per head group, per SM), beside SDPA's cuDNN backend. 16 heads, 16k tokens per cell, bf16;
median ms over interleaved rounds of triton.testing.do_bench.

    python scripts/probe_grid_order.py --per-sm 0 2 4 8 1000 --head-dims 64 128 --seqs 1024 4096 16384

--per-sm 0 runs one head at a time (the order before grid_order.py); a large value runs every head at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-sm", type=int, nargs="+", default=[0, 2, 4, 8, 1000])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_grid_order times CUDA kernels")
        return 0
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashsys.ops.attention import flash_triton, grid_order

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__};"
          f" H 16, B = 16384 // N, bf16; median ms of {args.rounds} interleaved do_bench rounds")
    causal_values = {"yes": (True,), "no": (False,), "both": (True, False)}[args.causal]
    for d in args.head_dims:
        for n in args.seqs:
            for causal in causal_values:
                b = 16384 // n
                q, k, v, do = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                window, scale = ((-1, 0) if causal else (-1, -1)), d ** -0.5
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

                def cudnn_fwd():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def cudnn_fwd_bwd():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        torch.autograd.grad(o, (qg, kg, vg), do)  # no .grad to add into

                def ours(per_sm):
                    grid_order.group_programs = lambda device, p=per_sm: p * sms
                    o, lse = flash_triton.flash_forward_triton(q, k, v, window, scale)
                    fwd = lambda: flash_triton.flash_forward_triton(q, k, v, window, scale)  # noqa: E731
                    bwd = lambda: flash_triton.flash_backward_triton(q, k, v, o, lse, do, window, scale)  # noqa: E731
                    return fwd, bwd

                times: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for per_sm in args.per_sm:
                        fwd, bwd = ours(per_sm)
                        times.setdefault(f"{per_sm} fwd", []).append(triton.testing.do_bench(fwd, warmup=25, rep=100))
                        times.setdefault(f"{per_sm} bwd", []).append(triton.testing.do_bench(bwd, warmup=25, rep=100))
                    cf = triton.testing.do_bench(cudnn_fwd, warmup=25, rep=100)
                    times.setdefault("cudnn fwd", []).append(cf)
                    times.setdefault("cudnn bwd", []).append(
                        triton.testing.do_bench(cudnn_fwd_bwd, warmup=25, rep=100) - cf)
                med = {key: statistics.median(vals) for key, vals in times.items()}
                cudnn = med["cudnn fwd"] + med["cudnn bwd"]
                cells = []
                for p in args.per_sm:
                    f, g = med[f"{p} fwd"], med[f"{p} bwd"]
                    cells.append(f"{p}: {f:.3f}+{g:.3f}={f + g:.3f} ({(f + g) / cudnn:.3f})")
                print(f"D {d} N {n} {'causal' if causal else 'full'}: cuDNN {med['cudnn fwd']:.3f}+"
                      f"{med['cudnn bwd']:.3f}={cudnn:.3f} | per SM " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
