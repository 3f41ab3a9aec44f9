"""Host time per eager attention call: the Gluon kernels (replayed from plans after the first calls) against the `tl`
kernels alone (native launcher) and SDPA, at shapes too small for the GPU to hide it (GPU probe for #16; prints). Sets
flash_gluon.MIN_WORK.

Each call is timed on the host over many calls with one sync at the end; at these sizes the GPU waits for the host,
so the time per call is the host's. MIN_WORK = 0 makes the Gluon forward take every call.

    python scripts/probe_gluon_host.py
    python scripts/probe_gluon_host.py --profile   # where the Gluon path's host time goes (cProfile)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_call_us(fn, calls: int = 300, rounds: int = 7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(samples)


def profile(n: int = 1024, d: int = 64) -> None:
    """cProfile of 300 forward and 300 forward+backward calls through the Gluon path: where its host time goes."""
    import cProfile
    import pstats

    from flashsys.ops.attention import flash_attention, flash_gluon

    flash_gluon.MIN_WORK = 0
    q, k, v = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for label, fn in (("forward", lambda: flash_attention(q.detach(), k.detach(), v.detach(), causal=True)),
                      ("forward+backward", lambda: flash_attention(q, k, v, causal=True).backward(do))):
        per_call_us(fn, calls=20, rounds=1)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        print(f"== {label}: N {n} D {d}, 300 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_gluon_host times CUDA calls")
        return 0
    from flashsys.ops.attention import eager_plans, flash_attention, flash_gluon, native_launch

    native_launch.wait()
    if "--profile" in sys.argv:
        profile()
        return 0
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; B 1, H 16, bf16, causal; "
          "host-bound µs per call (median of 7 rounds of 300 calls)")
    for n, d in ((128, 64), (512, 64), (1024, 64), (2048, 64), (1024, 128), (2048, 128)):
        q, k, v = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        rows = []
        # Plans (Python and native) are made per signature by whichever kernel ran it first: cleared for each row.
        for label, min_work in (("gluon forward", 0), ("tl + native launcher", 1 << 62)):
            flash_gluon.MIN_WORK = min_work
            eager_plans.clear()
            native_launch.clear()
            with torch.no_grad():
                fwd = per_call_us(lambda: flash_attention(q, k, v, causal=True))
            train = per_call_us(lambda: flash_attention(q, k, v, causal=True).backward(do))
            rows.append((label, fwd, train))
        with torch.no_grad():
            fwd = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        rows.append(("SDPA", fwd, per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                                              .backward(do))))
        print(f"N {n} D {d} ({16 * n * n} scores)")
        for label, fwd, train in rows:
            print(f"  {label:<22} forward {fwd:8.1f} µs   forward+backward {train:8.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
