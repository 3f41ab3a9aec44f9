"""Optimizer-state sharding: memory per rank and step time, with and without it.

Variants: plain AdamW, flashsys ShardedOptimizer(AdamW) (ZeRO-1), flashsys ZeRO2Optimizer(AdamW) (ZeRO-2:
gradients sharded too), torch's ZeroRedundancyOptimizer(AdamW); gradients are synchronised by BucketedDDP in every
variant. Per rank: allocated memory after model initialisation, before the
optimizer step (after forward + backward) and after it, the peak, and the optimizer step time. The breakdown
counts parameters, gradients and optimizer-state tensors directly; activations = peak during forward + backward
minus what was allocated before it.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import (
    add_common_args, add_distributed_model_args, distributed_model_config, environment, gradient_and_state_bytes,
    pyplot, save_plot, spawn_for_result, token_batch, write_result, write_table,
)
from flashsys.dist import BucketedDDP
from flashsys.nn import TransformerLM
from flashsys.optim import ShardedOptimizer, ZeRO2Optimizer
from flashsys.timing import Stopwatch

MB = 2**20


def _allocated(device) -> float:
    return torch.cuda.memory_allocated(device) / MB if device.type == "cuda" else float("nan")


def worker(rank, world, device, cfg, batch, variant, warmup, iters, out_json):
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    else:
        torch.set_num_threads(1)
    base = _allocated(device)
    torch.manual_seed(0)
    model = TransformerLM.from_config(cfg, device=device)
    ddp = BucketedDDP(model, bucket_size_mb=25)
    after_init = _allocated(device) - base
    if variant == "AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    elif variant == "ShardedOptimizer(AdamW)":
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    elif variant == "ZeRO2Optimizer(AdamW)":
        opt = ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-5)
    x = token_batch(cfg, batch, device)
    step_ms = []
    watch = Stopwatch(device)
    for i in range(warmup + iters):
        pre_fwd = _allocated(device) - base
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss = F.cross_entropy(ddp(x[:, :-1]).float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
        loss.backward()
        activations = (torch.cuda.max_memory_allocated(device) / MB - base - pre_fwd) if device.type == "cuda" else float("nan")
        before_step = _allocated(device) - base
        watch.start()
        opt.step()
        if i >= warmup:
            step_ms.append(watch.lap())
        after_step = _allocated(device) - base
        grad_bytes, state_bytes = gradient_and_state_bytes(model, opt, ddp)  # held across the step
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / MB - base if device.type == "cuda" else float("nan")
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / MB
    row = {"variant": variant, "rank": rank, "after_init_MB": after_init, "before_step_MB": before_step,
           "after_step_MB": after_step, "peak_last_step_MB": peak, "step_ms": statistics.fmean(step_ms),
           "params_MB": params, "grads_MB": grad_bytes / MB, "optimizer_state_MB": state_bytes / MB,
           "activations_MB": activations}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    write_result(rank, out_json, rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "sharded_optimizer")
    add_distributed_model_args(p)
    args = p.parse_args(argv)
    cfg = distributed_model_config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in ("AdamW", "ShardedOptimizer(AdamW)", "ZeRO2Optimizer(AdamW)", "ZeroRedundancyOptimizer(AdamW)"):
        rows += spawn_for_result(worker, args.world_size, cfg, args.batch, variant, args.warmup, args.iters,
                                 backend=args.backend, scratch_dir=args.out)
    full_state = next(r["optimizer_state_MB"] for r in rows if r["variant"] == "AdamW")
    for r in rows:
        r["state_vs_total/world"] = r["optimizer_state_MB"] / (full_state / args.world_size)
    path = write_table(rows, args.out, f"sharded_optimizer_{args.backend}", "Optimizer-state sharding",
                       [f"{args.world_size} ranks, model {args.preset}, context {args.context}, batch "
                        f"{args.batch} per rank, BucketedDDP(25 MB); memory is allocated bytes over the process's "
                        f"start (CUDA only), step_ms the optimizer step alone (mean over {args.iters} steps). "
                        "state_vs_total/world: 1.0 means exactly total optimizer state / world size."], environment())
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels, parts = [], {k: [] for k in ("params_MB", "grads_MB", "optimizer_state_MB", "activations_MB")}
    for r in rows:
        if r["rank"] == 0:
            labels.append(r["variant"].replace("(AdamW)", ""))
            for k in parts:
                parts[k].append(0 if r[k] != r[k] else r[k])
    bottom = [0.0] * len(labels)
    for k, vals in parts.items():
        ax.bar(labels, vals, bottom=bottom, label=k.replace("_MB", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MB on rank 0")
    ax.legend(fontsize=7)
    save_plot(fig, args.out, f"sharded_optimizer_{args.backend}")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
