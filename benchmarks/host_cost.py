"""Host cost of one attention call: microseconds of Python and dispatch per call, flashsys vs SDPA, in one process.

At small shapes the GPU finishes each kernel before the host has queued the next, so what a call costs is the
host's time, not the GPU's. Each cell queues `--calls` calls back to back (forward without grad, or forward +
backward) and divides the host time by the number of calls; the GPU time per call (CUDA events over the same
loop, after a sync) is beside it, so a cell where `gpu_us` is larger than `host_us` is GPU-bound, not host-bound.
`--breakdown` adds where flashsys's microseconds go, part by part.

    python -m benchmarks.host_cost --seqs 128 1024 --breakdown
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import DEVICE, ON_GPU, add_common_args, environment, sync, write_table
from flashsys.ops.attention import ATTENTION_BACKENDS
from flashsys.ops.attention.triton_env import interpreter_active


def _inputs(n: int, heads: int, head_dim: int, dtype: torch.dtype, grad: bool):
    g = torch.Generator(device="cpu").manual_seed(n)
    q, k, v, do = (torch.randn(1, heads, n, head_dim, generator=g).to(DEVICE, dtype) for _ in range(4))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, do


def per_call_us(call, calls: int, rounds: int = 5) -> tuple[float, float]:
    """(host µs, GPU µs) per call: the median over `rounds` of `calls` back-to-back calls."""
    host, gpu = [], []
    for _ in range(rounds):
        sync()
        start_event = torch.cuda.Event(enable_timing=True) if ON_GPU else None
        end_event = torch.cuda.Event(enable_timing=True) if ON_GPU else None
        if ON_GPU:
            start_event.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        if ON_GPU:
            end_event.record()
            end_event.synchronize()
            gpu.append(start_event.elapsed_time(end_event) / calls * 1e3)
    host.sort()
    gpu.sort()
    return host[len(host) // 2], (gpu[len(gpu) // 2] if gpu else float("nan"))


def headline(args) -> list[dict]:
    rows = []
    dtype = getattr(torch, args.dtype)
    for n in args.seqs:
        for what in ("forward", "forward+backward"):
            grad = what != "forward"
            q, k, v, do = _inputs(n, args.heads, args.head_dim, dtype, grad)
            cells = {}
            for name in args.backends:
                fn = ATTENTION_BACKENDS[name].fn

                def call(fn=fn):
                    if grad:
                        fn(q, k, v, True, None).backward(do)
                    else:
                        with torch.no_grad():
                            fn(q, k, v, True, None)

                for _ in range(args.warmup + 2):  # first calls autotune and compile
                    call()
                cells[name] = per_call_us(call, args.calls)
            base = cells.get("sdpa", (float("nan"),))[0]
            for name, (host, gpu) in cells.items():
                rows.append({"N": n, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
                             "pass": what, "attention": name, "host_us": host, "gpu_us": gpu,
                             "host_vs_sdpa": host / base})
    return rows


CAUSAL = (-1, 0)  # the (left, right) window of causal attention


def breakdown(args) -> list[dict]:
    """Where one eager flashsys forward + backward spends host time, part by part (flashsys internals). The
    forward + backward is about: forward + the engine's cost for any Function + the backward alone + the rest."""
    from flashsys.ops.attention import eager_plans
    from flashsys.ops.attention import flash_triton as ft
    from flashsys.ops.attention.validation import check_attention_inputs

    dtype = getattr(torch, args.dtype)
    n = min(args.seqs)
    q, k, v, do = _inputs(n, args.heads, args.head_dim, dtype, grad=True)
    op = ft.FlashAttention2Triton
    for _ in range(3):  # autotune, then make the plans
        op.apply(q, k, v, True).backward(do)
    with torch.no_grad():
        o_plain, lse = ft.flash_forward_triton(q.detach(), k.detach(), v.detach(), CAUSAL, 0.125)
    g = ft._cached_geometry(q.shape, k.shape, q.dtype)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    named = ft.forward_arguments(g, qd, kd, vd, o_plain, lse, qd, kd, CAUSAL, 0.125)
    prepared = ft._prepare("fwd", ft._fwd_kernels, g, CAUSAL, named)
    meta = ft._chosen_configs[prepared.key]
    grid = (-(-g.n_q // meta["BLOCK_M"]), g.n_bh)
    handle = prepared.handle

    forward_plan = eager_plans.forward_plans.get(eager_plans.forward_key(q, k, v, True, None, None))
    o = op.apply(q, k, v, True)  # held: a saved output is only readable while the output lives
    saved = o.grad_fn.saved_tensors
    backward_key = eager_plans.backward_key(CAUSAL, forward_plan.scale, *saved, do) if forward_plan else None
    backward_plan = eager_plans.backward_plans.get(backward_key)
    replay = {}
    if forward_plan is not None and backward_plan is not None:  # bf16 under the interpreter is not planned
        replay = {
            "forward plan: signature (key) + look-up": lambda: eager_plans.forward_plans.get(
                eager_plans.forward_key(q, k, v, True, None, None)),
            "forward plan: allocations + launch (ForwardPlan.launch)": lambda: forward_plan.launch(qd, kd, vd),
            "backward plan: signature (key) + look-up": lambda: eager_plans.backward_plans.get(
                eager_plans.backward_key(CAUSAL, forward_plan.scale, *saved, do)),
            "backward plan: allocations + 2 launches (BackwardPlan.launch)": lambda: backward_plan.launch(*saved, do),
        }
    parts = {
        "autograd.Function.apply of an identity": lambda: _Identity.apply(q),
        "input checks": lambda: check_attention_inputs(q, k, v, True, None, op="x", max_head_dim=256),
        "geometry, cached": lambda: ft._cached_geometry(q.shape, k.shape, q.dtype),
        "geometry, computed": lambda: ft._geometry_of(q.shape, k.shape, q.dtype),
        "two output allocations": lambda: (torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device)),
        "launch arguments by name": lambda: ft._prepare("fwd", ft._fwd_kernels, g, CAUSAL, named),
        "launch signature (cache key)": lambda: ft._launch_signature(prepared, q.device.index, (*grid, 1)),
        "forward launch: Triton autotuner (Autotuner.run)": lambda: handle[lambda m: grid](*prepared.args,
                                                                                           **prepared.constexprs),
        "forward launch: JITFunction.run, config given": lambda: handle.fn[grid](*prepared.args, **prepared.constexprs,
                                                                                 **meta),
        "forward launch: compiled kernel (flashsys full path)": lambda: ft._launch_eager(
            "fwd", ft._fwd_kernels, g, CAUSAL, ft._tile_grid(g.n_q, "BLOCK_M", g.n_bh), named),
        **replay,
        "flashsys forward, no grad": lambda: _no_grad(op.apply, q, k, v),
        "autograd engine: forward + backward of an identity Function": lambda: _Identity.apply(q).backward(do),
        "backward, full path: allocations + dQ and dK/dV launches (flash_backward_triton)": lambda: ft.flash_backward_triton(
            qd, kd, vd, o_plain, lse, do, CAUSAL, 0.125),
        "flashsys forward + backward": lambda: op.apply(q, k, v, True).backward(do),
    }
    rows = []
    for name, fn in parts.items():
        for _ in range(3):
            fn()
        host, _ = per_call_us(fn, args.calls)
        rows.append({"part": name, "host_us": host})
    return rows


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args, True)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "host_cost")
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 1024])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--calls", type=int, default=200, help="calls per timed round (5 rounds, median)")
    p.add_argument("--backends", nargs="+", default=["flash", "sdpa"], choices=list(ATTENTION_BACKENDS))
    p.add_argument("--breakdown", action="store_true",
                   help="also time the parts of a flashsys call (CUDA, or TRITON_INTERPRET=1 on a CPU)")
    p.add_argument("--name", default=None, help="file name of the table (default host_cost_<device>)")
    args = p.parse_args(argv)
    env = environment()
    name = args.name or f"host_cost_{'gpu' if ON_GPU else 'cpu'}"
    notes = [f"B=1, causal, {args.dtype}; median of 5 rounds of {args.calls} back-to-back calls. host_us: host time "
             "per call (the loop's wall time before any sync); gpu_us: GPU time per call over the same loop. "
             "host_us > gpu_us: the call is host-bound."]
    path = write_table(headline(args), args.out, name, "Attention host cost per call", notes, env)
    print(path.read_text())
    if args.breakdown and not (ON_GPU or interpreter_active()):
        print("--breakdown times the Triton op: it needs CUDA (or TRITON_INTERPRET=1 on a CPU, at tiny shapes)")
    elif args.breakdown:
        path = write_table(breakdown(args), args.out, f"{name}_breakdown", "Where the host time of a flashsys call goes",
                           [f"B=1, H={args.heads}, N={min(args.seqs)}, D={args.head_dim}, {args.dtype}, causal; "
                            "host µs per call, median of 5 rounds."], env)
        print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
