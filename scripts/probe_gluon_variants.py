"""Forward times of every Gluon variant as the library launches it (flash_gluon._launch), beside the `tl` forward and
SDPA's cuDNN forward, and the variant the library's own choice picks (GPU probe for #16; prints). H 16, 16k tokens
per cell, bf16; a variant that fails prints its error.

    python scripts/probe_gluon_variants.py --head-dims 64 128 --seqs 4096 16384
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_gluon_variants times CUDA kernels")
        return 0
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashsys.ops.attention import flash_gluon, native_launch
    from flashsys.ops.attention.flash_triton import flash_forward_triton

    native_launch.wait()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; H 16, "
          "B = 16384 // N, bf16, forward only, median ms of triton.testing.do_bench")
    for d in args.head_dims:
        for n in args.seqs:
            for causal in (True, False):
                b = 16384 // n
                q, k, v = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                window = (-1, 0) if causal else (-1, -1)
                scale = d ** -0.5
                flops = 4 * b * 16 * n * n * d / (2 if causal else 1)
                rows = []
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    rows.append(("SDPA cuDNN", triton.testing.do_bench(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))))
                saved = flash_gluon.MIN_WORK
                flash_gluon.MIN_WORK = 1 << 62
                flash_forward_triton(q, k, v, window, scale)
                rows.append(("flashsys tl forward", triton.testing.do_bench(
                    lambda: flash_forward_triton(q, k, v, window, scale))))
                flash_gluon.MIN_WORK = saved
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)
                for var in flash_gluon.VARIANTS[d]:
                    try:
                        rows.append((f"gluon {var.label()}", triton.testing.do_bench(
                            lambda: flash_gluon._launch(var, q, k, v, o, lse, window, scale))))
                    except Exception:  # noqa: BLE001
                        rows.append((f"gluon {var.label()} FAILED: {traceback.format_exc()[-600:]}", float("nan")))
                flash_gluon._chosen.clear()
                flash_gluon.forward(q, k, v, o, lse, window, scale)
                picked = next(iter(flash_gluon.chosen_variants().values())).label()
                print(f"\nD={d} N={n} B={b} causal={causal}; the library's choice: {picked}")
                for label, ms in rows:
                    print(f"  {label:<45} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
