"""Where the host time of an eager flashsys backward goes (GPU probe; prints, writes nothing but $OUT files).

Stamps: t0 main thread calls .backward(); t1 the Function's backward is entered (autograd worker thread);
t2 it returns; t3 .backward() returns on the main thread. cProfile runs inside the backward body only.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

from benchmarks.host_cost import _Identity
from flashsys.ops.attention import flash_triton as ft

N, H, D, CALLS = 128, 16, 64, 300
dev = "cuda"
g = torch.Generator(device="cpu").manual_seed(0)
q, k, v, do = (torch.randn(1, H, N, D, generator=g).to(dev, torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))

stamps: dict[str, list[float]] = {"enter": [], "exit": [], "thread": []}
prof = cProfile.Profile()
PROFILE = [False]

orig_backward = ft._FlashAttention2TritonFunction.backward


def timed_backward(ctx, do):
    stamps["enter"].append(time.perf_counter())
    stamps["thread"].append(threading.get_ident())
    if PROFILE[0]:
        prof.enable()
    out = orig_backward(ctx, do)
    if PROFILE[0]:
        prof.disable()
    stamps["exit"].append(time.perf_counter())
    return out


ft._FlashAttention2TritonFunction.backward = staticmethod(timed_backward)


class Identity(_Identity):
    """host_cost's identity Function, stamping its backward."""

    @staticmethod
    def backward(ctx, g):
        stamps["enter"].append(time.perf_counter())
        stamps["exit"].append(time.perf_counter())
        return g


def run(label, forward):
    for _ in range(20):
        forward().backward(do)
    torch.cuda.synchronize()
    for key in stamps:
        stamps[key].clear()
    t_fwd, t_call, t_ret = [], [], []
    for _ in range(CALLS):
        a = time.perf_counter()
        o = forward()
        b = time.perf_counter()
        o.backward(do)
        c = time.perf_counter()
        t_fwd.append(b - a)
        t_call.append(b)
        t_ret.append(c)
    torch.cuda.synchronize()
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731  microseconds
    fwd = med(t_fwd)
    total = med([r - c for r, c in zip(t_ret, t_call)])
    if stamps["enter"]:
        handoff = med([e - c for e, c in zip(stamps["enter"], t_call)])
        body = med([x - e for x, e in zip(stamps["exit"], stamps["enter"])])
        after = med([r - x for r, x in zip(t_ret, stamps["exit"])])
        same = all(t == threading.get_ident() for t in stamps["thread"]) if stamps["thread"] else None
        print(f"{label:28s} fwd {fwd:7.1f}  backward() {total:7.1f} = handoff {handoff:7.1f} + body {body:7.1f}"
              f" + after {after:7.1f}  (main thread runs body: {same})")
    else:
        print(f"{label:28s} fwd {fwd:7.1f}  backward() {total:7.1f}")


print("torch", torch.__version__, "switchinterval", sys.getswitchinterval(), "python", sys.version.split()[0])
run("identity Function", lambda: Identity.apply(q) * 1.0)
run("identity Function bare", lambda: Identity.apply(q))
run("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
run("flashsys", lambda: ft.FlashAttention2Triton.apply(q, k, v, True))
PROFILE[0] = True
run("flashsys (profiled body)", lambda: ft.FlashAttention2Triton.apply(q, k, v, True))
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue())
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
print(s.getvalue())

# The torch profiler's view of one iteration (CPU ops and their host time).
from torch.profiler import ProfilerActivity, profile  # noqa: E402

PROFILE[0] = False
with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as p:
    for _ in range(50):
        ft.FlashAttention2Triton.apply(q, k, v, True).backward(do)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
out = os.environ.get("OUT")
if out:
    p.export_chrome_trace(os.path.join(out, "flashsys_fwd_bwd_trace.json"))
