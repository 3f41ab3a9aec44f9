"""Profile training steps of `benchmarks.end_to_end`'s TransformerLM under each attention backend (GPU probe).

Why: the benchmark gives a step's time; where a step waits on the host (small models, short contexts, compiled
graphs), the GPU's kernels do not say where it goes. The backends' models (the benchmark's own `Model`: its model,
bf16 autocast, AdamW and step) are built side by side; this prints the graph breaks each compile made, then rounds of
steps in turns, each backend's step timed back to back (one sync at the end: what training sees) and synchronised on
its own (what the benchmark's step_ms times), and then per backend: the synchronising calls a step makes (torch's sync
debug mode: each stops the host from running ahead), the GPU's busy time and the kernels by GPU time, attention's
kernels (µs a call) against the rest (which should match across backends: the step's gap is then attention's), the host
operations by their own CPU time, and how many compiled graphs a step enters.

    python scripts/profile_lm_step.py --preset medium --context 512 --mode compiled
    python scripts/profile_lm_step.py --preset small --context 2048 --mode eager --attention flash --top 30
    python scripts/profile_lm_step.py --device cpu --preset demo --mode eager    # a check of the script
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's benchmarks, flashsys

from benchmarks.end_to_end import MODES, Model  # noqa: E402
from benchmarks.harness import at_least_one  # noqa: E402
from flashsys.nn import PRESETS  # noqa: E402
from flashsys.ops.attention import ATTENTION_BACKENDS  # noqa: E402
from flashsys.timing import time_call  # noqa: E402

PROFILED_STEPS = 2
# Host events that mark entering a compiled graph (their names differ across torch versions).
GRAPH_ENTRIES = ("Torch-Compiled Region", "CompiledFunction", "CompiledFunctionBackward")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synchronizing_calls(step) -> list[str]:
    """The synchronizing CUDA calls one step makes (each makes the host wait for the GPU, so that it cannot run
    ahead of it), from torch's sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's message for each ("called a synchronizing CUDA operation"), not the mode's one-time prototype notice
    return [str(w.message).splitlines()[0][:120] for w in caught if "called a synchronizing" in str(w.message)]


def time_steps(step, iters: int) -> tuple[float, float]:
    """(ms a step run back to back with one sync at the end, median ms of a step synchronised on its own: what
    `benchmarks.end_to_end` times)."""
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync()
    back_to_back = (time.perf_counter() - start) / iters * 1e3
    return back_to_back, statistics.median(time_call(step, "cuda" if torch.cuda.is_available() else None)[1]
                                           for _ in range(iters))


# Words in the names of attention's kernels: ours (`tl`: flash_fwd_kernel, flash_bwd_*; Gluon: attention_*,
# one_pass_*), cuDNN's (cudnn_generated_..._sdpa_...), FlashAttention's and the memory-efficient kernels' (flash_*,
# fmha_*). A layout copy Inductor names after the SDPA op it feeds counts too: it is attention's cost in that graph.
ATTENTION_WORDS = ("flash_", "attention", "attn", "sdpa", "fmha", "one_pass")


def attention_split(kernels: list[tuple[str, float, float]]) -> tuple[float, float, list[tuple[str, float, float]]]:
    """(attention's ms, the rest's ms, attention's kernels) of a step's (name, ms, calls) kernels: the kernels
    whose names hold one of ATTENTION_WORDS (case aside), and every other kernel. Where two backends' steps differ
    only in attention, their rests should match; what attention costs each is then read side by side."""
    ours = [k for k in kernels if any(word in k[0].lower() for word in ATTENTION_WORDS)]
    attention_ms = sum(ms for _, ms, _ in ours)
    return attention_ms, sum(ms for _, ms, _ in kernels) - attention_ms, ours


def profile_step(step, top: int) -> None:
    """Profile two steps and print where their time went."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        _sync()
    events = prof.key_averages()
    per_step = float(PROFILED_STEPS)
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.key.startswith("Optimizer.")),  # a range annotation, not a kernel
                     key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / per_step / 1e3
    print(f"  GPU busy {busy:.2f} ms a step, {sum(e.count for e in kernels) / per_step:.0f} kernels")
    for e in kernels[:top]:
        print(f"  gpu {e.self_device_time_total / per_step / 1e3:8.3f} ms {e.count / per_step:6.0f}x  {e.key[:100]}")
    attention_ms, rest_ms, attention = attention_split(
        [(e.key, e.self_device_time_total / per_step / 1e3, e.count / per_step) for e in kernels])
    print(f"  attention kernels {attention_ms:.3f} ms a step, the rest {rest_ms:.3f} ms")
    for name, ms, calls in attention:
        print(f"    {ms / max(calls, 1) * 1e3:8.1f} us a call {calls:6.0f}x  {name[:100]}")
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)
    print(f"  host ops by own time (of {sum(e.self_cpu_time_total for e in host) / per_step / 1e3:.2f} ms a step, "
          "profiled):")
    for e in host[:top]:
        print(f"  cpu {e.self_cpu_time_total / per_step / 1e3:8.3f} ms {e.count / per_step:6.0f}x  "
              f"({e.cpu_time_total / max(e.count, 1):7.1f} us each, children included)  {e.key[:80]}")
    for e in events:
        if any(e.key.startswith(name) for name in GRAPH_ENTRIES):
            print(f"  graph entries: {e.count / per_step:.0f} a step  {e.key[:100]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium", choices=list(PRESETS))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--mode", choices=list(MODES), default="compiled")
    p.add_argument("--attention", nargs="+", default=["flash", "sdpa"], choices=list(ATTENTION_BACKENDS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the benchmark's phase timing")
    p.add_argument("--iters", type=int, default=10, help="steps a round (and steps of the phase timing)")
    p.add_argument("--rounds", type=at_least_one, default=3)
    p.add_argument("--top", type=int, default=15, help="kernels and host operations listed per backend")
    p.add_argument("--device", default="cuda", help="cpu runs it too (host operations only; a check of the script)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --device cpu)")
    # The benchmark's own model and step (bf16 autocast, AdamW); building one times its phases over --warmup +
    # --iters steps, which are this script's warm-up.
    settings = argparse.Namespace(iters=args.iters, warmup=args.warmup, batch=args.batch, dtype="bf16", nvtx=False)
    steps = {}
    for attention in args.attention:
        breaks_before = sum(counters["graph_break"].values())
        model = Model(args.preset, args.context, attention, args.mode, settings, torch.device(args.device))
        steps[attention] = model.train_step
        breaks = sum(counters["graph_break"].values()) - breaks_before
        print(f"{attention}: {breaks} graph breaks while compiling", flush=True)
    print(f"\n{args.preset}, context {args.context}, batch {args.batch}, {args.mode}; ms a step, the attention "
          "backends in turns (back to back / each synchronised):")
    for r in range(args.rounds):
        times = {a: time_steps(step, args.iters) for a, step in steps.items()}
        print(f"  round {r}: " + "; ".join(f"{a} {b2b:.2f} / {synced:.2f}" for a, (b2b, synced) in times.items()),
              flush=True)
    for attention, step in steps.items():
        print(f"\n=== {attention}")
        if args.device.startswith("cuda"):
            syncs = synchronizing_calls(step)
            print(f"  {len(syncs)} synchronizing calls a step" + "".join(f"\n    {m}" for m in syncs[:8]))
        profile_step(step, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
