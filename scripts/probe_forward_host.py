"""Where an eager flashsys forward *with grad* spends host time that the same call without grad does not (GPU probe
for #14; prints). Medians of 300 calls, µs, B = 1, 16 heads, N = 128, D = 64, bf16, causal.

Rows: the op with and without grad; Functions that do part of its forward (the planned launch alone; with
`save_for_backward`; with the ctx attributes too), SDPA, and whole forward + backward calls with the autograd engine's
device threads on and off (`torch.autograd.set_multithreading_enabled`).

    PYTHONPATH=$PWD python3 scripts/probe_forward_host.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from flashsys.ops.attention import eager_plans
from flashsys.ops.attention import flash_triton as ft

N, H, D, CALLS = 128, 16, 64, 300
g = torch.Generator(device="cpu").manual_seed(0)
q, k, v, do = (torch.randn(1, H, N, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
op = ft.FlashAttention2Triton.apply
op(q, k, v, True).backward(do)  # autotune, compile, record the plans
op(q, k, v, True).backward(do)
PLAN = eager_plans.forward_plans.get(eager_plans.forward_key(q, k, v, True, None, None))
assert PLAN is not None, "no forward plan was recorded"


class LaunchOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, window=None):
        return PLAN.launch(q, k, v)[0]

    @staticmethod
    def backward(ctx, do):
        return do, do, do, None, None, None


class LaunchSave(LaunchOnly):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, window=None):
        o, lse = PLAN.launch(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        return o


class LaunchSaveAttrs(LaunchOnly):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, window=None):
        o, lse = PLAN.launch(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window, ctx.scale, ctx.planned = PLAN.window, PLAN.scale, True
        return o


def median_call_us(fn) -> float:
    """Median µs of single calls (benchmarks.host_cost.per_call_us averages whole rounds instead)."""
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(CALLS):
        a = time.perf_counter()
        fn()
        times.append(time.perf_counter() - a)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def no_grad(fn):
    def call():
        with torch.no_grad():
            fn()
    return call


def main() -> int:
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, python {sys.version.split()[0]}; "
          f"B 1, H {H}, N {N}, D {D}, bf16, causal; median µs of {CALLS} calls")
    rows = [
        ("flashsys forward, no grad", no_grad(lambda: op(q, k, v, True))),
        ("flashsys forward, grad (no backward)", lambda: op(q, k, v, True)),
        ("Function: planned launch only, grad", lambda: LaunchOnly.apply(q, k, v, True)),
        ("Function: launch + save_for_backward, grad", lambda: LaunchSave.apply(q, k, v, True)),
        ("Function: launch + save + ctx attributes, grad", lambda: LaunchSaveAttrs.apply(q, k, v, True)),
        ("planned launch alone (no Function)", lambda: PLAN.launch(q, k, v)),
        ("SDPA forward, no grad", no_grad(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))),
        ("SDPA forward, grad (no backward)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("flashsys forward + backward", lambda: op(q, k, v, True).backward(do)),
        ("SDPA forward + backward", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)),
    ]
    for label, fn in rows:
        print(f"  {label:<52} {median_call_us(fn):8.1f}")
    with torch.autograd.set_multithreading_enabled(False):
        for label, fn in rows[-2:]:
            print(f"  {label + ', engine threads off':<52} {median_call_us(fn):8.1f}")
    for label, fn in rows[-2:]:  # once more, after: drift between the first and the last rows
        print(f"  {label + ' (again)':<52} {median_call_us(fn):8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
