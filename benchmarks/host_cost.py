"""Host cost of one attention call: microseconds of Python and dispatch per call, flashsys vs SDPA, in one process.

At small shapes the GPU finishes each kernel before the host has queued the next, so what a call costs is the
host's time, not the GPU's. A round queues `--calls` calls back to back (forward without grad, or forward +
backward) and divides the host time by the number of calls; the GPU time per call (CUDA events over the same
loop, after a sync) is beside it, so a cell where `gpu_us` is larger than `host_us` is GPU-bound, not host-bound.
The backends run in turns, one round each, for `--rounds` rounds: a shared host's speed drifts by 2x within a
minute (SDPA's forward + backward read 157 to 285 µs in one process on an H100 machine), so each round's ratio
to SDPA is taken against the SDPA round beside it, and the table reports the median of those ratios.
`--compiled` adds each backend compiled by torch.compile (a compiled graph launches Inductor's kernels itself,
but calls the Gluon kernels through opaque ops). `--breakdown` adds where flashsys's microseconds go, part by
part. On a GPU, flashsys runs twice: with its native launcher (the default: a C++ autograd node launching the
compiled kernels) and with it suspended (the Python path, the Python plans' replays through Triton's launcher), column
`launcher`.

    python -m benchmarks.host_cost --seqs 128 1024 --breakdown
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from benchmarks.harness import DEVICE, ON_GPU, add_common_args, environment, sync, write_table
from flashsys.ops.attention import ATTENTION_BACKENDS
from flashsys.ops.attention.replay import native as native_launch
from flashsys.ops.attention.triton_env import interpreter_active


def _inputs(n: int, heads: int, head_dim: int, dtype: torch.dtype, grad: bool):
    g = torch.Generator(device="cpu").manual_seed(n)
    q, k, v, do = (torch.randn(1, heads, n, head_dim, generator=g).to(DEVICE, dtype) for _ in range(4))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, do


def _round_us(call, calls: int) -> tuple[float, float]:
    """(host µs, GPU µs) per call over `calls` back-to-back calls."""
    sync()
    start_event = torch.cuda.Event(enable_timing=True) if ON_GPU else None
    end_event = torch.cuda.Event(enable_timing=True) if ON_GPU else None
    if ON_GPU:
        start_event.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) / calls * 1e6
    gpu = float("nan")
    if ON_GPU:
        end_event.record()
        end_event.synchronize()
        gpu = start_event.elapsed_time(end_event) / calls * 1e3
    return host, gpu


def per_call_us(call, calls: int, rounds: int = 5) -> tuple[float, float]:
    """(host µs, GPU µs) per call: the median over `rounds` of `calls` back-to-back calls."""
    host, gpu = zip(*(_round_us(call, calls) for _ in range(rounds)))
    return statistics.median(host), statistics.median(gpu)


def headline(args) -> list[dict]:
    rows = []
    dtype = getattr(torch, args.dtype)
    for n in args.seqs:
        for what in ("forward", "forward+backward"):
            grad = what != "forward"
            q, k, v, do = _inputs(n, args.heads, args.head_dim, dtype, grad)
            calls = {}
            for name in args.backends:
                fn = ATTENTION_BACKENDS[name].fn
                launchers = ["native", "python"] if name == "flash" and native_launch.status() == "ready" else [None]
                if args.compiled:
                    launchers.append("compiled")
                for launcher in launchers:
                    def call(fn=torch.compile(fn, dynamic=False) if launcher == "compiled" else fn):
                        if grad:
                            fn(q, k, v, True, None).backward(do)
                        else:
                            with torch.no_grad():
                                fn(q, k, v, True, None)

                    if launcher == "python":
                        call = functools.partial(_python_path, call)

                    for _ in range(args.warmup + 2):  # first calls autotune and compile
                        call()
                    calls[(name, launcher)] = call
            rounds = {name: [] for name in calls}
            for _ in range(args.rounds):  # in turns, so that drift reaches every backend alike
                for name, call in calls.items():
                    rounds[name].append(_round_us(call, args.calls))
            for (name, launcher), timed in rounds.items():
                base = rounds.get(("sdpa", "compiled" if launcher == "compiled" else None))  # like with like
                host = [h for h, _ in timed]
                ratio = statistics.median(h / b for h, (b, _) in zip(host, base)) if base else float("nan")
                q10, *_, q90 = statistics.quantiles(host, n=10) if len(host) > 1 else host * 2
                rows.append({"N": n, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
                             "pass": what, "attention": name, "launcher": launcher or "-",
                             "host_us": statistics.median(host),
                             "host_p10_us": q10, "host_p90_us": q90,
                             "gpu_us": statistics.median(g for _, g in timed), "host_vs_sdpa": ratio})
    return rows


CAUSAL = (-1, 0)  # the (left, right) window of causal attention


def breakdown(args) -> list[dict]:
    """Where one eager flashsys forward + backward spends host time, part by part (flashsys internals). The
    forward + backward is about: forward + the engine's cost for any Function + the backward alone + the rest.
    Where a compiled graph would call opaque ops for these inputs, their parts too (`_opaque_op_parts`)."""
    from flashsys.ops.attention import FlashAttention2Triton, launcher
    from flashsys.ops.attention.replay import plans as eager_plans
    from flashsys.ops.attention.triton import launch
    from flashsys.ops.attention.validation import check_attention_inputs

    dtype = getattr(torch, args.dtype)
    n = min(args.seqs)
    q, k, v, do = _inputs(n, args.heads, args.head_dim, dtype, grad=True)
    op = FlashAttention2Triton
    for _ in range(3):  # autotune, then make the plans
        op.apply(q, k, v, True).backward(do)
    with torch.no_grad():
        o_plain, lse, _ = launcher.forward(q.detach(), k.detach(), v.detach(), CAUSAL, 0.125)
    g = launch.cached_geometry(q.shape, k.shape, q.dtype)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    tensors = launcher.ForwardTensors(qd, kd, vd, o_plain, lse)
    named = launcher.forward_arguments(g, tensors, launcher.Offsets(qd, kd), CAUSAL, 0.125)
    tile_grid = launch.tile_grid(g.n_q, "BLOCK_M", g.n_bh)
    # The `tl` forward's parts: where the Gluon forward takes these inputs (Hopper), the `tl` one never ran above, so
    # launch it once here to have its config chosen.
    launch.run("fwd", g, CAUSAL, tile_grid, named, traced=False)
    prepared = launch.prepare("fwd", g, CAUSAL, named)
    meta = launch.chosen_configs()[prepared.key]
    grid = tile_grid(meta)
    handle = prepared.handle

    scale = check_attention_inputs(q, k, v, True, None, op="x", max_head_dim=256)  # the op's default, as it takes it
    forward_plan = eager_plans.forward_plans.get(eager_plans.forward_key(q, k, v, True, None, None))
    o = op.apply(q, k, v, True)  # held: a saved output is only readable while the output lives
    saved = o.grad_fn.saved_tensors
    backward_plan = eager_plans.backward_plans.get(eager_plans.backward_key(CAUSAL, scale, *saved, do))
    replay = {}
    if forward_plan is not None:
        replay["forward plan: signature (key) + look-up"] = lambda: eager_plans.forward_plans.get(
            eager_plans.forward_key(q, k, v, True, None, None))
        replay["forward plan: allocations + launch (ForwardPlan.launch)"] = lambda: forward_plan.launch(qd, kd, vd)
    if backward_plan is not None:
        replay["backward plan: signature (key) + look-up"] = lambda: eager_plans.backward_plans.get(
            eager_plans.backward_key(CAUSAL, scale, *saved, do))
        replay["backward plan: allocations + its launches (BackwardPlan.launch)"] = lambda: backward_plan.launch(
            *saved, do)
    # A plan not found under the key built here (bf16 under the interpreter makes none; a key built unlike the op's
    # finds none) gets a row that says so, with its table's size, rather than its replay rows silently missing.
    missing = [{"part": f"{what} plan: none under the key built here ({len(table)} in its table), not timed",
                "host_us": float("nan")}
               for what, plan, table in (("forward", forward_plan, eager_plans.forward_plans),
                                         ("backward", backward_plan, eager_plans.backward_plans)) if plan is None]
    parts = {
        "autograd.Function.apply of an identity": lambda: _Identity.apply(q),
        "input checks": lambda: check_attention_inputs(q, k, v, True, None, op="x", max_head_dim=256),
        "geometry, cached": lambda: launch.cached_geometry(q.shape, k.shape, q.dtype),
        "geometry, computed": lambda: launch.geometry_of(q.shape, k.shape, q.dtype),
        "two output allocations": lambda: (torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device)),
        "launch arguments by name": lambda: launch.prepare("fwd", g, CAUSAL, named),
        "launch signature (cache key)": lambda: launch._launch_signature(prepared, q.device.index, (*grid, 1, 1)),
        "forward launch: Triton autotuner (Autotuner.run)": lambda: handle[lambda m: grid](*prepared.args,
                                                                                           **prepared.constexprs),
        "forward launch: JITFunction.run, config given": lambda: handle.fn[grid](*prepared.args, **prepared.constexprs,
                                                                                 **meta),
        "forward launch: compiled kernel (flashsys full path)": lambda: launch.run("fwd", g, CAUSAL, tile_grid, named,
                                                                                   traced=False),
        **replay,
        "flashsys forward, no grad, Python path": lambda: _python_path(_no_grad, op.apply, q, k, v),
        "autograd engine: forward + backward of an identity Function": lambda: _Identity.apply(q).backward(do),
        "backward, full path: allocations + its launches (launcher.backward)": lambda: launcher.backward(
            qd, kd, vd, o_plain, lse, launcher.dense_do(do, qd.dtype), CAUSAL, 0.125),
        "flashsys forward + backward, Python path": lambda: _python_path(lambda: op.apply(q, k, v, True).backward(do)),
    }
    parts.update(_opaque_op_parts(qd, kd, vd, do, args.head_dim ** -0.5))
    if native_launch.status() == "ready":
        parts.update({
            "native launcher: signature (C++ key) + look-up, a miss": lambda: native_launch.forward(
                q, k, v, True, None, (3, 0)),
            "flashsys forward, no grad, native launcher": lambda: _no_grad(op.apply, q, k, v),
            "flashsys forward + backward, native launcher": lambda: op.apply(q, k, v, True).backward(do),
        })
    rows = []
    for name, fn in parts.items():
        for _ in range(3):
            fn()
        host, _ = per_call_us(fn, args.calls)
        rows.append({"part": name, "host_us": host})
    return rows + missing


def _opaque_op_parts(q, k, v, do, scale) -> dict:
    """The parts of a compiled graph's call where it goes through opaque ops (the Gluon kernels on Hopper, the
    interpreter on a CPU): each op as the graph calls it (the dispatcher, then its body replaying a plan) and its
    body alone, so their difference is the op's own dispatch cost. Empty where the graph would launch the `tl` kernels
    itself (Inductor re-emits them: no flashsys Python runs per call)."""
    from flashsys.ops.attention import library_ops as ops

    forward_op, backward_op = ops.traced_forward(q, k, v, CAUSAL), ops.traced_backward(q, k, v, CAUSAL)
    if forward_op not in (ops.gluon_forward_op, ops.interpreted_forward_op):
        return {}
    for _ in range(2):  # the plans are made by the first calls that do not autotune, and offered to the native side
        o, lse = forward_op(q, k, v, *CAUSAL, scale)
        backward_op(q, k, v, o, lse, do, *CAUSAL, scale)
    parts = {
        "compiled graph's forward op: dispatch + body (a plan replay)": lambda: forward_op(q, k, v, *CAUSAL, scale),
        "compiled graph's forward op: its body alone (opaque_forward)": lambda: ops.opaque_forward(
            q, k, v, *CAUSAL, scale),
        "compiled graph's backward op: dispatch + body (a plan replay)": lambda: backward_op(
            q, k, v, o, lse, do, *CAUSAL, scale),
        "compiled graph's backward op: its body alone (opaque_backward)": lambda: ops.opaque_backward(
            q, k, v, o, lse, do, *CAUSAL, scale),
    }
    if native_launch.status() != "ready" or not q.is_cuda:  # interpreted calls keep the Python path
        return parts
    # Both launchers: the native one replays the plans it was offered, the Python one Triton's launchers.
    return {**{f"{name}, native launcher": fn for name, fn in parts.items()},
            **{f"{name}, Python path": functools.partial(_python_path, fn) for name, fn in parts.items()}}


def _python_path(fn, *args):
    with native_launch.suspended():
        return fn(*args)


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
    # Without a GPU the flashsys call is the tiled PyTorch op, whose cost grows with the shape where a GPU call's
    # does not: the CPU defaults keep the sweep to seconds, as `benchmarks.attention`'s do.
    p.add_argument("--seqs", nargs="+", type=int, default=[128, 1024] if ON_GPU else [32, 128])
    p.add_argument("--heads", type=int, default=16 if ON_GPU else 4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--calls", type=int, default=200 if ON_GPU else 20, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=15 if ON_GPU else 5,
                   help="timed rounds per backend, taken in turns")
    p.add_argument("--backends", nargs="+", default=["flash", "sdpa"], choices=list(ATTENTION_BACKENDS))
    p.add_argument("--breakdown", action="store_true",
                   help="also time the parts of a flashsys call (CUDA, or TRITON_INTERPRET=1 on a CPU)")
    p.add_argument("--compiled", action="store_true",
                   help="also each backend under torch.compile (launcher `compiled`; its first calls compile)")
    p.add_argument("--name", default=None, help="file name of the table (default host_cost_<device>)")
    args = p.parse_args(argv)
    env = environment()
    name = args.name or f"host_cost_{'gpu' if ON_GPU else 'cpu'}"
    notes = [f"B=1, causal, {args.dtype}; {args.rounds} rounds of {args.calls} back-to-back calls per backend, the "
             "backends in turns. host_us: host time per call (the loop's wall time before any sync), median over "
             "rounds, with p10/p90; gpu_us: GPU time per call over the same loop. host_us > gpu_us: the call is "
             "host-bound. host_vs_sdpa: the median over rounds of the ratio to the SDPA round beside it (compiled: "
             "to compiled SDPA's)."]
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
