"""Experiment (#16, stop 32): the single-pass backward with dQ's shares summed by a 2-CTA cluster in distributed
shared memory (DQ_PAIR 2) against the two passes, stop 30's single pass (DQ_PAIR 0: every share reduced by TMA),
a timing-only proxy with half the traffic and no exchange (DQ_PAIR 1: wrong dQ) and SDPA's cuDNN backward.
H 16, B = 16384 // N, bf16; kernels alone unless said; median ms of interleaved do_bench rounds.

    python scripts/probe_dsmem_pair.py
"""
import argparse, os, statistics, sys, traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CELLS = {"d128c16k": (128, 16384, True), "d128f16k": (128, 16384, False), "d128c4k": (128, 4096, True),
         "d64c16k": (64, 16384, True), "d64f16k": (64, 16384, False)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=list(CELLS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flashsys.ops.attention import flash_gluon, flash_triton
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ptx_dir = os.environ.get("OUT", "/tmp") + "/pair_ptx"
    os.makedirs(ptx_dir, exist_ok=True)
    for cell in args.cells:
        d, n, causal = CELLS[cell]
        b = 16384 // n
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        window = (-1, 0) if causal else (-1, -1)
        scale = d ** -0.5
        flops = 10 * b * 16 * n * n * d / (2 if causal else 1)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o_ref = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        o, lse = flash_triton.flash_forward_triton(q, k, v, window, scale)
        g = flash_triton._geometry_of(q.shape, k.shape, q.dtype)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device="cuda")

        def two_pass():
            flash_triton._launch_backward(g, q, k, v, o, lse, do, dq, dk, dv, lse_delta, q, k, window, scale,
                                          False, d in flash_gluon.DKDV_VARIANTS)
        two_pass()
        torch.cuda.synchronize()
        runs = {"SDPA cuDNN backward": lambda: torch.autograd.grad(o_ref, (qg, kg, vg), do, retain_graph=True),
                "two passes (library)": two_pass}
        dq_sum = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        fdk, fdv = torch.empty_like(k), torch.empty_like(v)
        pairs = torch.stack((-lse * flash_gluon.LOG2E, (do.float() * o.float()).sum(-1)), -1)
        for bn in ((128,) if d == 128 else (128, 64)):
            var = flash_gluon.Variant("dkdv", 64, bn, 2)
            for mode in (0, 1, 2):
                label = f"{var.label()} DQ_PAIR {mode}"
                try:
                    kernel, grid, a, kw = flash_gluon._dkdv_launch_parts(var, q, k, v, do, fdk, fdv, pairs, window,
                                                                         scale, dq_sum, mode)
                    if mode == 2:
                        c = kernel.warmup(*a, **kw, grid=grid)
                        path = f"{ptx_dir}/{cell}_{bn}.ptx"
                        with open(path, "w") as f:
                            f.write(flash_gluon.pair_ptx(c.asm["ptx"], d))
                        kw = dict(kw, ir_override=path)
                    dq_sum.zero_()
                    kernel[grid](*a, **kw)
                    torch.cuda.synchronize()
                    fdq = (dq_sum * scale).to(q.dtype)
                    err = [((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                           for x, y in ((fdq, dq), (fdk, dk), (fdv, dv))]
                    print(f"{cell} {label}: max|diff|/max|two-pass| dQ {err[0]:.2e} dK {err[1]:.2e} dV {err[2]:.2e}"
                          + ("  (timing only: half of dQ dropped)" if mode == 1 else ""), flush=True)
                except Exception:  # noqa: BLE001
                    print(f"{cell} {label} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
                    continue
                runs[f"  kernel alone: {label}"] = lambda kernel=kernel, grid=grid, a=a, kw=kw: kernel[grid](*a, **kw)
                if mode != 1:
                    def whole(kernel=kernel, grid=grid, a=a, kw=kw):
                        pairs.copy_(torch.stack((-lse * flash_gluon.LOG2E, (do.float() * o.float()).sum(-1)), -1))
                        dq_sum.zero_()
                        kernel[grid](*a, **kw)
                        return (dq_sum * scale).to(q.dtype)
                    runs[f"single pass, prologue/epilogue in torch: {label}"] = whole
        times = {}
        for _ in range(args.rounds):
            for label, fn in runs.items():
                try:
                    times.setdefault(label, []).append(triton.testing.do_bench(fn))
                except Exception:  # noqa: BLE001
                    print(f"{label} FAILED: {traceback.format_exc()[-800:]}")
                    times[label] = [float("nan")]
        cudnn = statistics.median(times["SDPA cuDNN backward"])
        print(f"\n{cell}: D={d} N={n} B={b} causal={causal}")
        for label, ts in times.items():
            ms = statistics.median(ts)
            print(f"  {label:<62} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {ms / cudnn:5.2f}x cuDNN", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
