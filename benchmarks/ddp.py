"""Data-parallel training steps: total time and the communication left exposed after backward.

Variants: NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP at 1, 10, 25, 100, 1000 MB and "auto", and
torch.nn.parallel.DistributedDataParallel. A step is forward + backward + gradient synchronisation + SGD step.
"exposed communication" = step time - the same step without any communication (the model alone), so it
counts only the part of communication that did not hide behind backward. The plot draws step time against
bucket size with the overhead model's prediction (compute + (S/b)·o + b/w, with o and w measured here).

    python -m benchmarks.ddp                          # 2 GPUs and the xl preset; on a CPU 2 gloo ranks, the tiny preset
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import (
    add_common_args, add_distributed_model_args, distributed_model_config, environment, pyplot, save_plot,
    spawn_for_result, token_batch, write_result, write_table,
)
from flashsys.dist import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, measure_allreduce_cost, plan_buckets
from flashsys.nn import TransformerLM
from flashsys.timing import Stopwatch

BUCKETS = [1, 10, 25, 100, 1000]  # 25 MB: torch DDP's default, for a like-for-like comparison


def variants():
    v = {"none (compute only)": None, "naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP}
    for mb in BUCKETS:
        v[f"bucketed {mb} MB"] = (lambda m, mb=mb: BucketedDDP(m, bucket_size_mb=mb))
    v["bucketed auto"] = lambda m: BucketedDDP(m, bucket_size_mb="auto")
    v["torch DDP 25 MB"] = "torch"
    return v


def worker(rank, world, device, cfg, batch, warmup, iters, only, out_json):
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    x = token_batch(cfg, batch, device, torch.Generator().manual_seed(rank))
    rows = []
    torch.manual_seed(0)
    model = TransformerLM.from_config(cfg, device=device)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    o, w = measure_allreduce_cost(device, torch.float32)
    for name, make in variants().items():
        if only and name not in only and make is not None:  # the compute-only row is always measured
            continue
        if make is None:
            wrapped = model
        elif make == "torch":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25,
                                                                device_ids=[device.index] if device.type == "cuda" else None)
        else:
            wrapped = make(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)
        steps, syncs = [], []
        watch = Stopwatch(device, barrier=True)
        for i in range(warmup + iters):
            watch.start()
            loss = F.cross_entropy(wrapped(x[:, :-1]).float().reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
            loss.backward()
            watch.lap()
            if hasattr(wrapped, "finish_gradient_synchronization"):
                wrapped.finish_gradient_synchronization()
            sync_ms = watch.lap()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                steps.append(watch.elapsed())
                syncs.append(sync_ms)
        gathered = [None] * world
        dist.all_gather_object(gathered, (statistics.fmean(steps), statistics.stdev(steps) if len(steps) > 1 else 0.0,
                                          statistics.fmean(syncs)))
        mean = max(gg[0] for gg in gathered)
        row = {"variant": name, "step_ms": mean, "std_ms": max(gg[1] for gg in gathered),
               "finish_sync_ms": max(gg[2] for gg in gathered)}
        if hasattr(wrapped, "bucket_bytes"):
            row["bucket_MB"] = round(min(wrapped.bucket_bytes, total_bytes) / 2**20, 1)
            row["buckets"] = len(wrapped.bucket_sizes_bytes)
        rows.append(row)
        if hasattr(wrapped, "remove_hooks"):
            wrapped.remove_hooks()
        del wrapped, opt
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    compute = rows[0]["step_ms"]
    for r in rows:
        r["exposed_comm_ms"] = r["step_ms"] - compute
    param_bytes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    write_result(rank, out_json, {"rows": rows, "o_s": o, "w_Bps": w, "total_bytes": total_bytes,
                                  "param_bytes": param_bytes})


def plot(rows: list[dict], o: float, w: float, param_bytes: list[int], out: Path, name: str) -> None:
    """Step time against bucket size, with the overhead model compute + calls(b)·o + b/w drawn over it.

    calls(b) is the real bucket count of the layout (a parameter never splits), not S/b: with 41 MB matrices,
    every cap below that gives about one call per parameter."""
    import numpy as np

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    pts = [(r["bucket_MB"], r["step_ms"]) for r in rows if r["variant"].startswith("bucketed") and "bucket_MB" in r]
    ax.plot(*zip(*sorted(pts)), "o", label="BucketedDDP (measured)")
    compute = rows[0]["step_ms"]
    total = sum(param_bytes)
    b = np.logspace(np.log10(0.5), np.log10(max(total / 2**20, 2)), 100) * 2**20
    order = [(None, n) for n in reversed(param_bytes)]  # BucketedDDP fills buckets in reverse order
    pred = [compute + len(plan_buckets(order, cap)) * o * 1e3 + min(cap, total) / w * 1e3 for cap in b]
    ax.plot(b / 2**20, pred, "-", label="compute + calls(b)·o + b/w (model)")
    ax.axhline(compute, color="gray", linestyle=":", label="compute only")
    for r in rows:
        if r["variant"] == "torch DDP 25 MB":
            ax.axhline(r["step_ms"], color="C3", linestyle="--", label="torch DDP 25 MB")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=7)
    save_plot(fig, out, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "ddp")
    add_distributed_model_args(p)
    p.add_argument("--variants", nargs="+", choices=list(variants()), metavar="NAME",
                   help=f"measure only these (default: all): {', '.join(variants())}")
    args = p.parse_args(argv)
    cfg = distributed_model_config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    res = spawn_for_result(worker, args.world_size, cfg, args.batch, args.warmup, args.iters, args.variants,
                           backend=args.backend, scratch_dir=args.out)
    rows, o, w, s = res["rows"], res["o_s"], res["w_Bps"], res["total_bytes"]
    path = write_table(rows, args.out, f"ddp_{args.backend}", "Data-parallel training step",
                       [f"{args.world_size} ranks, {args.backend}, model {args.preset} ({s / 2**20:.0f} MB of fp32 "
                        f"gradients), context {args.context}, batch {args.batch} per rank; mean over {args.iters} steps "
                        f"after {args.warmup} warm-up (slowest rank). Measured all-reduce cost: o = {o * 1e6:.0f} µs per "
                        f"call, w = {w / 1e9:.1f} GB/s. exposed_comm_ms = step_ms - the compute-only step."],
                       environment())
    plot(rows, o, w, res["param_bytes"], args.out, f"ddp_{args.backend}")
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
