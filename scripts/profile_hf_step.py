"""Profile one training step of `benchmarks.hf_model`'s Llama under each attention implementation (GPU probe), eager
or compiled.

Why: the benchmark gives the step's time; this says where it goes: the GPU kernels by time, and how often the step
reads a tensor back to the host (`aten::item`: each is a wait for the GPU that stops the host from running ahead).
It is what found the transformers integration's per-layer read-back and the layout copies it still makes
(docs/attention-kernels.md, §3c).

    python scripts/profile_hf_step.py            # sdpa and fsys, batch 2 x 4096
    python scripts/profile_hf_step.py --impls fsys --top 30
    python scripts/profile_hf_step.py --impls sdpa_causal fsys --compiled    # torch.compile'd, as the benchmark's
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's benchmarks, flashsys

from benchmarks.hf_model import SDPA_CAUSAL, build, register_sdpa_causal  # noqa: E402
from flashsys.integrations.transformers import register  # noqa: E402

HOST_WAITS = ("aten::item", "cudaStreamSynchronize", "cudaMemcpyAsync")


def profile_step(model: torch.nn.Module, ids: torch.Tensor, top: int, compiled: bool = False) -> None:
    """Time the step, then profile two steps and print the top kernels and the host's waits for the GPU."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    print(f"{(time.perf_counter() - start) / 5 * 1e3:.1f} ms a step (wall)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
    print(f"GPU busy {sum(e.self_device_time_total for e in kernels) / 2e3:.1f} ms a step")
    for e in kernels[:top]:
        print(f"{e.self_device_time_total / 2e3:8.2f} ms {e.count // 2:5d}x  {e.key[:110]}")
    for e in events:
        if e.key in HOST_WAITS:
            print(f"  {e.key}: {e.count // 2} a step, {e.cpu_time_total / 2e3:.2f} ms of host time")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="+", default=["sdpa", "fsys"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--top", type=int, default=14, help="kernels listed per implementation")
    p.add_argument("--compiled", action="store_true", help="torch.compile the model (minutes per implementation)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    register()
    if SDPA_CAUSAL in args.impls:
        register_sdpa_causal()
    state = build("sdpa", torch.bfloat16, None).state_dict()
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).cuda()
    for impl in args.impls:
        print(f"\n=== {impl}")
        profile_step(build(impl, torch.bfloat16, state).train(), ids, args.top, args.compiled)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
