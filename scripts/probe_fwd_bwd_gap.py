"""Why does flashsys's forward+backward take longer than its forward plus its backward, when cuDNN's takes less?

In the headline sweep (benchmarks/attention.py) the backward alone is timed with retain_graph=True into existing
.grad tensors, so it pays three gradient accumulations that forward+backward does not: fwd_bwd should come in
under fwd + bwd, as it does for SDPA-cuDNN. flashsys's came in 2-8% over it at D 64 full 16k and D 128 causal
16k-32k. This probe times the three modes as the benchmark does, then profiles each (torch.profiler, CUDA
kernels only) and prints per mode: span per iteration, GPU busy time, idle time, and every kernel's mean time.
It also runs one forward+backward under torch.cuda.set_sync_debug_mode("warn"), so a host-device sync in the
op's eager path shows as a warning. Each profile is taken twice: back to back, and with do_bench's L2 flush
before each step.

--leaderboard first runs the leaderboard's exact step (benchmarks/leaderboard.py) for flashsys and SDPA-cuDNN:
profiles, the CUDA runtime calls per step and one step's GPU timeline; with --sustain instead, 100-ms against 3-s
timings with the SM clock and power; with --events instead, forward and backward split by CUDA events over 300
steps. Results of 2026-11-24: kernel_experiments.md, "Why the leaderboard step lost 5% ... (stop 33)".

--launch instead prints, per cell and implementation, each kernel of one forward + backward with its launch shape as
the profiler records it (grid, threads a block, registers a thread, shared memory, blocks an SM): how cuDNN's kernels
are laid out beside ours, where their names only hint at it.

    python scripts/probe_fwd_bwd_gap.py [--cells 64:0:16384 128:1:16384 ...]
    python scripts/probe_fwd_bwd_gap.py --leaderboard [--sustain | --events] --cells
    python scripts/probe_fwd_bwd_gap.py --launch --cells 64:0:16384 128:0:16384
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import warnings

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention import NONDETERMINISTIC, implementation  # noqa: E402
from flashsys.ops.attention import ATTENTION_BACKENDS, set_deterministic_backward  # noqa: E402


def modes(fn, q, k, v, do, causal) -> dict:
    """The sweep's three timed steps (benchmarks/attention.py `measure`): forward; backward alone, into existing
    grads, through one graph kept with retain_graph; forward + backward into fresh grads."""
    out = fn(q, k, v, causal)

    def fwd():
        fn(q, k, v, causal)

    def bwd():
        out.backward(do, retain_graph=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v, causal).backward(do)

    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd_bwd}


def trace_events(step, iters: int, host: bool = False, flush: bool = False) -> list[dict]:
    """The chrome-trace events of `iters` steps under torch.profiler: CUDA activity, and the host's too with `host`;
    with `flush`, each step after a 256 MB zero_() that clears L2, as triton.testing.do_bench does."""
    from torch.profiler import ProfilerActivity, profile

    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda") if flush else None
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        for _ in range(iters):
            if cache is not None:
                cache.zero_()
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return events


def gpu_work(events: list[dict]) -> list[dict]:
    """The kernels, memsets and copies among trace events, in start order."""
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e),
                  key=lambda e: e["ts"])


def kernel_profile(step, iters: int, flush: bool = False) -> dict:
    """Span per iteration, busy and idle GPU time, and each kernel's mean duration (microseconds). With `flush`,
    each iteration starts, as in triton.testing.do_bench, with a 256 MB zero_() that clears L2; span is do_bench's
    window (a flush's end to the step's last kernel) and `lead_us` the gap from a flush's end to the step's first
    kernel (the GPU waiting for the host)."""
    kernels = gpu_work(trace_events(step, iters, flush=flush))
    if not kernels:
        return {}
    if flush:  # do_bench's window: from a flush's end to the last kernel before the next flush
        flushes = [e for e in kernels if "FillFunctor" in e["name"] and e["dur"] > 50]
        bounds = [f["ts"] + f["dur"] for f in flushes] + [float("inf")]
        window = busy = lead = 0.0
        steps = []
        for lo, hi in zip(bounds, bounds[1:]):
            inside = [e for e in kernels if lo <= e["ts"] < hi and not any(e is f for f in flushes)]
            if inside:
                window += max(e["ts"] + e["dur"] for e in inside) - lo
                busy += sum(e["dur"] for e in inside)
                lead += inside[0]["ts"] - lo
                steps += inside
        n = len(flushes)
        return {"span_us": window / n, "busy_us": busy / n, "idle_us": (window - busy) / n, "lead_us": lead / n,
                "kernels": _per_name(steps, n)}
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    return {"span_us": (end - start) / iters, "busy_us": busy / iters, "idle_us": (end - start - busy) / iters,
            "kernels": _per_name(kernels, iters)}


def _per_name(kernels: list, iters: int) -> dict:
    per_name = collections.defaultdict(list)
    for e in kernels:
        per_name[e["name"][:90]].append(e["dur"])
    return {n: (len(d) / iters, sum(d) / len(d)) for n, d in per_name.items()}


def print_profiles(name: str, step, iters: int) -> None:
    for flush in (False, True):
        prof = kernel_profile(step, iters, flush)
        print(f"  [{name}{', L2 flushed' if flush else ''}] span {prof['span_us']:.1f} us, busy "
              f"{prof['busy_us']:.1f}, idle {prof['idle_us']:.1f}"
              + (f" (of which before the first kernel {prof['lead_us']:.1f})" if flush else ""))
        for kname, (count, mean) in sorted(prof["kernels"].items(), key=lambda x: -x[1][0] * x[1][1]):
            print(f"      {count:4.1f} x {mean:9.1f} us  {kname}")


LAUNCH_FIELDS = ("grid", "block", "registers per thread", "shared memory", "blocks per SM")


def launch_shapes(step) -> list[tuple[str, str]]:
    """(name, launch shape) of each distinct kernel one `step` runs, in start order: the profiler's record of its
    grid, block, registers a thread, shared memory (bytes, static and dynamic) and blocks an SM."""
    seen: dict[str, str] = {}
    for e in gpu_work(trace_events(step, 1)):
        args = e.get("args", {})
        if e.get("cat") == "kernel" and e["name"] not in seen:
            seen[e["name"]] = ", ".join(f"{f} {args[f]}" for f in LAUNCH_FIELDS if f in args)
    return list(seen.items())


def leaderboard(args) -> None:
    """The leaderboard's step (benchmarks/leaderboard.py) for flashsys (compiled) and SDPA-cuDNN: do_bench in two
    interleaved rounds, then the profile with and without the L2 flush."""
    from flashsys.ops.attention import FlashAttention2Triton

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 16, 16384, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True).unbind(0)
    flash = torch.compile(FlashAttention2Triton.apply)
    cudnn = ATTENTION_BACKENDS["sdpa-cudnn"]
    steps = {"flashsys compiled": lambda: flash(q, k, v, True).sum().backward(),
             "flashsys eager": lambda: FlashAttention2Triton.apply(q, k, v, True).sum().backward(),
             "sdpa-cudnn": lambda: cudnn(q[None], k[None], v[None], True).sum().backward()}
    for step in steps.values():
        step()
    times = collections.defaultdict(list)
    for _ in range(3):
        for name, step in steps.items():
            times[name].append(triton.testing.do_bench(step, rep=2000, warmup=200))
    print("## leaderboard step, do_bench mean ms, three interleaved rounds: "
          + "; ".join(f"{n}: " + ", ".join(f"{t:.3f}" for t in ts) for n, ts in times.items()))
    if args.events:
        split = {"flashsys eager": lambda: FlashAttention2Triton.apply(q, k, v, True),
                 "sdpa-cudnn": lambda: cudnn(q[None], k[None], v[None], True)}
        for _ in range(2):
            for name, forward in split.items():
                event_split(name, forward, 300)
        return
    if args.sustain:
        for _ in range(2):
            for name, step in steps.items():
                sustained(name, step)
        return
    for name, step in steps.items():
        print_profiles(name, step, args.iters)
        host_calls(name, step, args.iters)


def event_split(name: str, forward, iters: int) -> None:
    """The leaderboard step timed by CUDA events alone (no profiler), split at the forward's end: each of `iters`
    iterations clears L2 as do_bench does, then records flush end, forward end, backward end."""
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for i in range(iters):
        cache.zero_()
        marks[i][0].record()
        out = forward()
        marks[i][1].record()
        out.sum().backward()
        marks[i][2].record()
    torch.cuda.synchronize()
    fwd = sorted(m[0].elapsed_time(m[1]) for m in marks)
    bwd = sorted(m[1].elapsed_time(m[2]) for m in marks)
    mean = lambda x: sum(x) / len(x)  # noqa: E731
    print(f"  [{name}] CUDA events, {iters} steps: forward mean {mean(fwd):.3f} (median {fwd[iters // 2]:.3f}) ms, "
          f"backward mean {mean(bwd):.3f} (median {bwd[iters // 2]:.3f}) ms, step {mean(fwd) + mean(bwd):.3f} ms")


def _clock_and_power() -> tuple[int, float]:
    """(SM clock MHz, power W) from nvidia-smi (torch.cuda's NVML calls need pynvml, which may be missing)."""
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True).stdout.split(",")
    return int(out[0]), float(out[1])


def sustained(name: str, step) -> None:
    """After 3 s idle: do_bench over 100 ms, then over 3 s while a thread samples the SM clock and the power draw
    (NVML through torch.cuda), so a step that slows as the GPU heats or hits its power limit shows it."""
    import threading
    import time

    torch.cuda.synchronize()
    time.sleep(3)
    idle_clock = _clock_and_power()[0]
    short = triton.testing.do_bench(step, rep=100, warmup=10)
    samples = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            samples.append(_clock_and_power())
            time.sleep(0.1)

    thread = threading.Thread(target=sample)
    thread.start()
    long = triton.testing.do_bench(step, rep=3000, warmup=10)
    done.set()
    thread.join()
    late = samples[len(samples) // 2:]
    print(f"  [{name}] idle clock {idle_clock} MHz; do_bench 100 ms: {short:.3f} ms, 3 s: {long:.3f} ms; second half "
          f"of the 3 s: SM clock {min(c for c, _ in late)}-{max(c for c, _ in late)} MHz, power "
          f"{min(w for _, w in late):.0f}-{max(w for _, w in late):.0f} W")


def host_calls(name: str, step, iters: int) -> None:
    """The CUDA runtime and driver calls of `iters` steps (count, total us: a synchronising call shows here), and
    one step's GPU timeline with every gap over 5 us."""
    events = trace_events(step, iters, host=True)
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += e["dur"]
    print(f"  [{name}] runtime/driver calls per step (count, us):")
    for call, (count, dur) in sorted(calls.items(), key=lambda x: -x[1][1])[:14]:
        print(f"      {count / iters:6.1f} x {dur / count:8.1f} us  {call}")
    kernels = gpu_work(events)
    per_step = len(kernels) // iters
    one = kernels[per_step * (iters // 2): per_step * (iters // 2 + 1) + 1]
    print(f"  [{name}] one step's GPU timeline (start offset us, duration us, gap before it if > 5 us):")
    for prev, e in zip([None] + one[:-1], one):
        gap = e["ts"] - (prev["ts"] + prev["dur"]) if prev else 0.0
        print(f"      {e['ts'] - one[0]['ts']:9.1f} {e['dur']:9.1f}" + (f"  gap {gap:7.1f}" if gap > 5 else "")
              + f"  {e['name'][:70]}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", nargs="*", default=["64:0:16384", "64:1:16384", "128:1:16384", "128:0:4096"],
                   help="D:causal:N, batch 16384 // N, 16 heads")
    p.add_argument("--impls", nargs="+", default=["flash-triton", "sdpa-cudnn"],
                   help=f"backends of the registry, or {NONDETERMINISTIC} (flash-triton, determinism off)")
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--leaderboard", action="store_true", help="also the leaderboard's exact step (torch.compile)")
    p.add_argument("--events", action="store_true", help="with --leaderboard: forward and backward by CUDA events")
    p.add_argument("--sustain", action="store_true", help="with --leaderboard: short against long timings, clocks")
    p.add_argument("--launch", action="store_true", help="each kernel's launch shape instead of the timings")
    args = p.parse_args()
    if args.leaderboard:
        leaderboard(args)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    for cell in args.cells:
        d, causal, n = (int(x) for x in cell.split(":"))
        b = max(1, 16384 // n)
        for impl in args.impls:
            # flash-triton-nondet: the sweep's flash-triton with determinism off (benchmarks.attention)
            set_deterministic_backward(impl != NONDETERMINISTIC)
            fn = implementation(impl)
            q, k, v = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            do = torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                q.grad = k.grad = v.grad = None
                fn(q, k, v, bool(causal)).backward(do)
            # the sync check times nothing the launch list needs
            if impl in ("flash-triton", NONDETERMINISTIC) and not args.launch:
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        q.grad = k.grad = v.grad = None
                        fn(q, k, v, bool(causal)).backward(do)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = [str(w.message)[:160] for w in caught if "prototype" not in str(w.message)]
                print(f"  sync warnings in one eager fwd+bwd: {len(syncs)} {syncs[:3]}")
            table = modes(fn, q, k, v, do, bool(causal))
            if args.launch:
                print(f"\n## D {d} {'causal' if causal else 'full'} N {n} B {b}: {impl}, one forward + backward")
                for kname, shape in launch_shapes(table["fwd_bwd"]):
                    print(f"  {kname[:110]}\n      {shape}")
                del q, k, v, do, table
                continue
            times = {}
            for name, step in table.items():
                times[name] = triton.testing.do_bench(step, rep=args.rep, warmup=25, return_mode="median")
            # a second interleaved round, since the pool's clocks drift
            for name, step in table.items():
                times[name + "_2"] = triton.testing.do_bench(step, rep=args.rep, warmup=25, return_mode="median")
            print(f"\n## D {d} {'causal' if causal else 'full'} N {n} B {b}: {impl}")
            print("  do_bench ms: " + ", ".join(f"{k_}={t:.3f}" for k_, t in times.items())
                  + f"; fwd+bwd-sum={times['fwd'] + times['bwd']:.3f}")
            for name, step in table.items():
                print_profiles(name, step, args.iters)
            del q, k, v, do, table
            torch.cuda.empty_cache()
    set_deterministic_backward(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
