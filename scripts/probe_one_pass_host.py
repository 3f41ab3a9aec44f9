"""Host time of a backward that runs the one pass (GPU probe for #16; prints). Since stop 40 the one pass is
recorded as a launch plan (prologue, Gluon kernel, epilogue) and replayed, as the two passes are; before, every such
backward took the Python path (checks, choice look-up, descriptors, three launches). Does the host keep ahead of
the GPU where the one pass is chosen?

Per shape (bf16, 16 heads, causal, forward + backward of one eager call, MIN_WORK 0 so that the Gluon path takes
every shape) and per backward forced (the two passes, the deterministic one pass with its plans kept from being
made, as before stop 40, and each one pass with its plan):
- host µs: the time to issue 10 calls, divided by 10, with the GPU idle at the start (no sync inside);
- wall µs: per call over many calls with one sync at the end. Where host < wall the GPU sets the pace.

    python scripts/probe_one_pass_host.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(fn, calls: int, rounds: int = 5) -> tuple[float, float]:
    """(host µs per call issuing 10 calls on an idle GPU, wall µs per call over `calls` calls), medians."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        host.append((time.perf_counter() - t) / 10 * 1e6)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(host), statistics.median(wall)


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_one_pass_host runs CUDA kernels")
        return 0
    import triton

    from flashsys.ops.attention import (eager_plans, flash_attention, flash_gluon, native_launch,
                                        set_deterministic_backward)

    flash_gluon.MIN_WORK = 0
    native_launch.wait()
    remember, offer = eager_plans.backward_plans.remember, native_launch.offer_backward
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"native launcher {native_launch.status()}")
    print("shape (B, H, N, D) | backward | host µs/call | wall µs/call | host/wall")
    for batch, n, d in ((1, 1024, 128), (8, 2048, 128), (4, 4096, 128), (1, 16384, 128), (1, 1024, 64)):
        q, k, v = (torch.randn(batch, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        det = flash_gluon.DETERMINISTIC_ONE_PASS_VARIANTS[d][1]
        for label, kind, variant, planned in (
                ("two passes (plan)", "one_pass_det", flash_gluon.TL_KERNEL, True),
                ("deterministic one pass, no plan", "one_pass_det", det, False),
                ("deterministic one pass (plan)", "one_pass_det", det, True),
                ("one pass, determinism off (plan)", "one_pass", flash_gluon.ONE_PASS_VARIANTS[d][1], True)):
            set_deterministic_backward(kind == "one_pass_det")
            flash_gluon._chosen.clear()
            eager_plans.clear()
            flash_gluon._chosen[flash_gluon.ChoiceKey.of(q, k, (-1, 0), kind)] = variant
            eager_plans.backward_plans.remember = remember if planned else (lambda key, plan: None)
            native_launch.offer_backward = offer if planned else (lambda *args: None)

            def call():
                flash_attention(q, k, v, causal=True).backward(do)

            host, wall = measure(call, calls=max(5, int(2e5 // (batch * n * d ** 0.5))))
            print(f"({batch}, 16, {n}, {d}) | {label} | {host:.0f} | {wall:.0f} | {host / wall:.2f}", flush=True)
    eager_plans.backward_plans.remember, native_launch.offer_backward = remember, offer
    set_deterministic_backward(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
