"""Profile one training step of `benchmarks.hf_model`'s Llama under each attention implementation (GPU probe), eager
or compiled.

Why: the benchmark gives the step's time; this says where it goes: the GPU kernels by time, and how often the step
reads a tensor back to the host (`aten::item`: each is a wait for the GPU that stops the host from running ahead).
It is what found the transformers integration's per-layer read-back and the layout copies it still makes
(docs/attention-kernels.md, §3c). Every model is built first; their steps are timed in turns and profiled in ABBA
order (`profile_steps`), so that a GPU warming under load does not favour the model that ran first.

    python scripts/profile_hf_step.py            # sdpa and fsys, batch 2 x 4096
    python scripts/profile_hf_step.py --impls fsys --top 30
    python scripts/profile_hf_step.py --impls sdpa_causal fsys --compiled    # torch.compile'd, as the benchmark's
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's benchmarks, flashsys

from benchmarks.hf_model import SDPA_CAUSAL, build, register_sdpa_causal, train_step  # noqa: E402
from flashsys.integrations.transformers import register  # noqa: E402

HOST_WAITS = ("aten::item", "cudaStreamSynchronize", "cudaMemcpyAsync")


def _wall_ms(step, steps: int = 5) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def _profiled(step) -> dict:
    """Two profiled steps: {kernel: (device µs, calls)} and {host wait: (calls, host µs)}."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        step()
        torch.cuda.synchronize()
    kernels, waits = {}, {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = (e.self_device_time_total, e.count)
        elif e.key in HOST_WAITS:
            waits[e.key] = (e.count, e.cpu_time_total)
    return {"kernels": kernels, "waits": waits}


def _merge(into: dict, found: dict) -> None:
    for part, rows in found.items():
        for key, (a, b) in rows.items():
            old = into[part].get(key, (0, 0))
            into[part][key] = (old[0] + a, old[1] + b)


def profile_steps(steps: dict, top: int, rounds: int) -> None:
    """Time the steps in `rounds` rounds that take them in turn (median), then profile them in ABBA order, twice
    each, and print each one's kernels by time and its host waits, per step. Why the order: a GPU at its power cap
    slows as it warms, so of two models profiled one after the other the later one's every kernel reads slower;
    in turns, and reversed, the drift falls on both."""
    for step in steps.values():
        for _ in range(3):
            step()
    walls = {impl: [] for impl in steps}
    for _ in range(rounds):
        for impl, step in steps.items():
            walls[impl].append(_wall_ms(step))
    found = {impl: {"kernels": {}, "waits": {}} for impl in steps}
    for impl in [*steps, *reversed(steps)]:
        _merge(found[impl], _profiled(steps[impl]))
    per_step = 4  # two profiles of two steps each
    for impl in steps:
        kernels = sorted(found[impl]["kernels"].items(), key=lambda kv: -kv[1][0])
        print(f"\n=== {impl}: {statistics.median(walls[impl]):.1f} ms a step (wall, median of {rounds} rounds)")
        print(f"GPU busy {sum(t for t, _ in found[impl]['kernels'].values()) / per_step / 1e3:.1f} ms a step")
        for key, (t, calls) in kernels[:top]:
            print(f"{t / per_step / 1e3:8.2f} ms {calls // per_step:5d}x  {key[:110]}")
        for key, (calls, t) in found[impl]["waits"].items():
            print(f"  {key}: {calls // per_step} a step, {t / per_step / 1e3:.2f} ms of host time")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=["sdpa", "fsys"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--top", type=int, default=14, help="kernels listed per implementation")
    p.add_argument("--compiled", action="store_true", help="torch.compile the model (minutes per implementation)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of timed steps, the models in turn")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    register()
    if SDPA_CAUSAL in args.impls:
        register_sdpa_causal()
    state = build("sdpa", torch.bfloat16, None).state_dict()
    steps = {}
    for impl in args.impls:  # the benchmark's own step: the same batch, optimizer and warm-up
        model = build(impl, torch.bfloat16, state)
        steps[impl] = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), args.batch,
                                 args.seq, args.compiled)
    profile_steps(steps, args.top, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
