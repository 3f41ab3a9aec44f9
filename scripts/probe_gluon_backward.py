"""Backward times on a GPU for #16: SDPA's cuDNN backward, flashsys's backward with the `tl` kernels only and with
the library's choices (Gluon dQ and dK/dV where they timed faster), and the whole backward with each candidate of
one kernel forced and the `tl` kernel for the other (each Gluon dQ variant's output checked against the `tl` kernel's
first). Whole backwards, not kernels alone: a kernel timed alone read up to 8% slower than in sequence, and not by the
same amount for every kernel. H 16, 16k tokens per cell, bf16; median ms over interleaved rounds of
triton.testing.do_bench (the GPUs drift between passes).

    python scripts/probe_gluon_backward.py --head-dims 64 128 --seqs 4096 16384
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class BackwardCell:
    """One cell of the backward probes (this one and probe_one_pass_backward): H 16, B = 16384 // N, bf16 inputs;
    SDPA-cuDNN's forward graph to differentiate; flashsys's O and L, and the buffers its backward writes."""

    def __init__(self, d: int, n: int, causal: bool):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from flashsys.ops.attention import flash_triton

        self.flash_triton = flash_triton
        self.b = 16384 // n
        self.q, self.k, self.v, self.do = (torch.randn(self.b, 16, n, d, device="cuda", dtype=torch.bfloat16)
                                           for _ in range(4))
        self.window = (-1, 0) if causal else (-1, -1)
        self.scale = d ** -0.5
        self.flops = 10 * self.b * 16 * n * n * d / (2 if causal else 1)  # five products of 2·N²·D per head
        self.leaves = tuple(t.clone().requires_grad_() for t in (self.q, self.k, self.v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            self.o_ref = F.scaled_dot_product_attention(*self.leaves, is_causal=causal)
        self.o, self.lse = flash_triton.flash_forward_triton(self.q, self.k, self.v, self.window, self.scale)
        self.g = flash_triton._geometry_of(self.q.shape, self.k.shape, self.q.dtype)
        self.dq, self.dk, self.dv = (torch.empty_like(t) for t in (self.q, self.k, self.v))
        self.lse_delta = torch.empty((*self.q.shape[:-1], 2), dtype=torch.float32, device="cuda")

    def cudnn_backward(self):
        return torch.autograd.grad(self.o_ref, self.leaves, self.do, retain_graph=True)

    def backward(self, gluon: bool, one_pass: bool = False) -> None:
        """flashsys's backward into dq, dk, dv (the Gluon kernels where `gluon` and they take the call): the two
        passes, or with `one_pass` whatever the library chooses (the deterministic one pass is a candidate)."""
        if not one_pass:
            from flashsys.ops.attention import flash_gluon

            flash_gluon._chosen[flash_gluon.ChoiceKey.of(self.q, self.k, self.window, "one_pass_det")] = \
                flash_gluon.TL_KERNEL
        self.flash_triton._launch_backward(self.g, self.q, self.k, self.v, self.o, self.lse, self.do, self.dq, self.dk,
                                           self.dv, self.lse_delta, self.q, self.k, self.window, self.scale, False,
                                           gluon)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_gluon_backward times CUDA kernels")
        return 0
    import triton

    from flashsys.ops.attention import flash_gluon

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; H 16, "
          f"B = 16384 // N, bf16, backward only, median ms of {args.rounds} interleaved do_bench rounds")
    for d in args.head_dims:
        for n in args.seqs:
            for causal in (True, False):
                cell = BackwardCell(d, n, causal)
                q, k, v, do, o, lse, window, scale = (cell.q, cell.k, cell.v, cell.do, cell.o, cell.lse, cell.window,
                                                      cell.scale)
                dq, lse_delta, backward = cell.dq, cell.lse_delta, cell.backward
                backward(False)

                flash_gluon._chosen.clear()
                backward(True)  # the library's choice, timed on this first call and restored before each of its runs
                choice = flash_gluon.chosen_variants()
                key_of = {kernel: flash_gluon.ChoiceKey.of(q, k, window, kernel) for kernel in ("dq", "dkdv")}

                def with_choice(chosen):
                    # The whole backward with these variants chosen, as the library would run them: in sequence, so
                    # each kernel sees the other's cache and clock state (a kernel timed alone read up to 8% slower).
                    def run():
                        flash_gluon._chosen.clear()
                        flash_gluon._chosen.update(chosen)
                        backward(True)
                    return run

                def forced(dq_variant, dkdv_variant):
                    return with_choice({key_of["dq"]: dq_variant, key_of["dkdv"]: dkdv_variant})

                tl = flash_gluon.TL_KERNEL
                runs = {"SDPA cuDNN backward": cell.cudnn_backward,
                        "flashsys backward, tl kernels": lambda: backward(False)}
                if flash_gluon.takes_backward(q, k, v, o, do, window):
                    runs["flashsys backward, the library's choices"] = with_choice(choice)
                    for var in [tl, *(var for var in flash_gluon.DKDV_VARIANTS.get(d, ()) if var.kind != "tl")]:
                        runs[f"  dQ tl + dK/dV {var.label()}"] = forced(tl, var)
                    for var in [var for var in flash_gluon.DQ_VARIANTS.get(d, ()) if var.kind != "tl"]:
                        runs[f"  dQ {var.label()} + dK/dV tl"] = forced(var, tl)
                # Each Gluon dQ variant against the `tl` dQ kernel's output (dq and the pairs it wrote above).
                dq_tl, pairs_tl = dq.clone(), lse_delta.clone()
                dq_g, pairs_g = torch.empty_like(dq), torch.empty_like(lse_delta)
                for var in [var for var in flash_gluon.gluon_variants(d) if var.kind == "dq"]:
                    try:
                        flash_gluon._launch(var, q, k, v, do, o, dq_g, lse, pairs_g, window, scale)
                        torch.cuda.synchronize()
                        err = ((dq_g.float() - dq_tl.float()).abs().max() / dq_tl.float().abs().max()).item()
                        pair_err = (pairs_g - pairs_tl).abs().max().item()
                        print(f"  Gluon dQ {var.label()}: max |dQ - tl dQ| / max |tl dQ| {err:.2e}, "
                              f"max |pairs - tl pairs| {pair_err:.2e}")
                    except Exception:  # noqa: BLE001
                        print(f"  Gluon dQ {var.label()} FAILED: {traceback.format_exc()[-800:]}")
                times: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for label, fn in runs.items():
                        if any(math.isnan(t) for t in times.get(label, [])):  # failed in an earlier round
                            continue
                        try:
                            times.setdefault(label, []).append(triton.testing.do_bench(fn))
                        except Exception:  # noqa: BLE001
                            print(f"{label} FAILED: {traceback.format_exc()[-800:]}")
                            times[label] = [float("nan")]
                picked = [f"{k.kernel}: {v.label()}" for k, v in choice.items()]
                print(f"\nD={d} N={n} B={cell.b} causal={causal}; the library's choice: {picked}")
                cudnn = statistics.median(times["SDPA cuDNN backward"])
                for label, ts in times.items():
                    ms = statistics.median(ts)
                    print(f"  {label:<52} {ms:8.3f} ms  {cell.flops / ms / 1e9:7.1f} TFLOP/s  {ms / cudnn:5.2f}x cuDNN",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
