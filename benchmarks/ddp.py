"""Data-parallel training steps you can trust: every variant interleaved in rounds, median and spread.

A step is zero_grad + forward (bf16 autocast on GPUs) + backward (gradient synchronisation finishes inside it) +
AdamW step. The timed steps of a round run back to back, as in training, with no wait for the device between
them: a step's time is the gap between CUDA events recorded at consecutive step starts (`StepMarks`), so work
that overlaps a step boundary (ZeRO-2's all-gathers under the next forward, FSDP2's prefetch, the host queueing
the next step) counts as it would in a training loop. Variants run round-robin: in each of `--rounds` rounds every variant is built on the same model,
warmed up for `--warmup` steps and timed for `--iters` steps, so drift (clocks, temperature, other tenants)
reaches all of them alike; each variant gets rounds × iters timed steps. A step's time is the slowest rank's.

Rows: compute only (no communication, same process: the floor), BucketedDDP at its default ("auto") and fixed
bucket sizes, with `gradient_as_bucket_view` and with bf16 communication; torch DDP at its default 25 MB and
other `bucket_cap_mb`; ZeRO-1 (ShardedOptimizer) and ZeRO-2 (ZeRO2Optimizer, also with its all-gathers overlapped
with the next forward) on BucketedDDP; torch DDP + ZeroRedundancyOptimizer; torch FSDP2
`fully_shard(reshard_after_forward=False)` (ZeRO-2's torch counterpart); ZeRO-3 as `flashsys train --zero-stage 3`
runs it, and the same FSDP2 configuration written with torch's API directly.

exposed_% = (median step - median compute-only step) / compute-only: the communication that did not hide.
forward_ms, backward_ms, step_ms: the median of each phase of a step (the slowest rank's), from CUDA events at
its start, before backward and before the optimizer step: where a variant's extra time goes.
grad_state_MB counts, per rank, the gradient storage (`.grad`, bucket buffers, shards) and optimizer state that
persist between steps (torch DDP's internal buckets cannot be counted this way: `alloc_MB`, the CUDA allocator's
figure after a step, includes everything).

    python -m benchmarks.ddp                       # 2 GPUs, the xl preset, batch 16; on a CPU 2 gloo ranks, tiny
    python -m benchmarks.ddp --world-size 2 4      # and 4 GPUs, with a weak-scaling table
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import (
    add_common_args, add_distributed_model_args, distributed_model_config, environment, gradient_and_state_bytes,
    pyplot, save_plot, spawn_for_result, token_batch, write_result, write_table,
)
from flashsys.dist import BucketedDDP
from flashsys.nn import TransformerLM
from flashsys.optim import ShardedOptimizer, ZeRO2Optimizer
from flashsys.timing import StepMarks, round_order, synchronize

MB = 2**20


@dataclass
class Built:
    """One variant, built on the model: what the step calls, and what to undo before the next variant."""

    net: nn.Module
    opt: torch.optim.Optimizer
    wrapper: object = None
    teardown: list[Callable[[], None]] = field(default_factory=list)


def _adamw(device) -> dict:
    kw = dict(lr=1e-5, weight_decay=0.1, betas=(0.9, 0.95))
    if device.type == "cuda":
        kw["fused"] = True
    return kw


def _ours(bucket_mb="auto", optimizer="adamw", nccl: tuple[int | None, bool] | None = None, **ddp_kw) -> Callable:
    """A BucketedDDP variant; `nccl` = (max_ctas, high_priority) reduces on a group with those communicator
    settings (`_nccl_group`; NCCL only)."""
    def build(model, device):
        group = {} if nccl is None else {"process_group": _nccl_group(*nccl)}
        ddp = BucketedDDP(model, bucket_size_mb=bucket_mb, **group, **ddp_kw)
        if optimizer == "zero1":
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **_adamw(device))
        elif optimizer in ("zero2", "zero2-overlap"):
            opt = ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, overlap_all_gather=optimizer == "zero2-overlap",
                                 **_adamw(device))
        else:
            opt = torch.optim.AdamW(model.parameters(), **_adamw(device))
        return Built(ddp, opt, ddp, [ddp.remove_hooks])
    build.nccl_only = nccl is not None
    return build


_NCCL_GROUPS: dict[tuple, object] = {}


def _nccl_group(max_ctas: int | None = None, high_priority: bool = False):
    """An NCCL group over all ranks with its own communicator settings: collectives on at most `max_ctas` thread
    blocks (fewer SMs taken from backward's GEMMs while a bucket is reduced under them), or on a high-priority
    stream. Created once per setting (a collective call: every rank builds the variants in the same order)."""
    key = (max_ctas, high_priority)
    if key not in _NCCL_GROUPS:
        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
        if max_ctas is not None:
            opts.config.max_ctas = max_ctas
        _NCCL_GROUPS[key] = dist.new_group(backend="nccl", pg_options=opts)
    return _NCCL_GROUPS[key]


def _torch_ddp(bucket_mb=25, zero=False) -> Callable:
    def build(model, device):
        ids = [device.index] if device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb, device_ids=ids)
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **_adamw(device))
        else:
            opt = torch.optim.AdamW(model.parameters(), **_adamw(device))
        return Built(ddp, opt)
    return build


def _fsdp2(model, device):
    """FSDP2 converts the model's parameters for good: it gets a model of its own (kept across rounds)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return Built(model, torch.optim.AdamW(model.parameters(), **_adamw(device)))


def _zero3_flashsys(model, device):
    """The trainer's --zero-stage 3: `flashsys.dist.fsdp.shard_model` (FSDP2 per block and at the root, parameters
    resharded after forward; bf16 compute and float32 reduction on GPUs)."""
    from flashsys.dist import fsdp

    fsdp.shard_model(model, torch.bfloat16 if device.type == "cuda" else None)
    return Built(model, torch.optim.AdamW(model.parameters(), **_adamw(device)))


def _zero3_torch(model, device):
    """The same configuration written with torch's API directly: what ZeRO-3's row is held against."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return Built(model, torch.optim.AdamW(model.parameters(), **_adamw(device)))


def _compute_only(model, device):
    return Built(model, torch.optim.AdamW(model.parameters(), **_adamw(device)))


VARIANTS: dict[str, Callable] = {
    "compute only": _compute_only,
    "BucketedDDP (default: auto)": _ours(),
    "BucketedDDP 25 MB": _ours(25),
    "BucketedDDP 100 MB": _ours(100),
    "BucketedDDP auto, bucket views": _ours(gradient_as_bucket_view=True),
    "BucketedDDP auto, bf16 comm": _ours(comm_dtype=torch.bfloat16),
    "BucketedDDP auto, bucket views, NCCL 4 CTAs": _ours(nccl=(4, False), gradient_as_bucket_view=True),
    "BucketedDDP auto, bucket views, NCCL 8 CTAs": _ours(nccl=(8, False), gradient_as_bucket_view=True),
    "BucketedDDP auto, bucket views, NCCL 16 CTAs": _ours(nccl=(16, False), gradient_as_bucket_view=True),
    "BucketedDDP auto, bucket views, NCCL high-priority stream": _ours(nccl=(None, True), gradient_as_bucket_view=True),
    "torch DDP 25 MB (default)": _torch_ddp(25),
    "torch DDP 100 MB": _torch_ddp(100),
    "torch DDP 250 MB": _torch_ddp(250),
    "ZeRO-1: BucketedDDP + ShardedOptimizer": _ours(optimizer="zero1"),
    "ZeRO-2: BucketedDDP + ZeRO2Optimizer": _ours(optimizer="zero2"),
    "ZeRO-2, all-gathers overlapped with the next forward": _ours(optimizer="zero2-overlap"),
    "torch DDP + ZeroRedundancyOptimizer": _torch_ddp(25, zero=True),
    "torch FSDP2 (reshard_after_forward=False)": _fsdp2,
    "ZeRO-3: flashsys train --zero-stage 3 (FSDP2)": _zero3_flashsys,
    "torch FSDP2, the same configuration (reshard_after_forward=True)": _zero3_torch,
}
# FSDP2 converts a model's parameters for good: these rows get a model of their own.
OWN_MODEL = {"torch FSDP2 (reshard_after_forward=False)", "ZeRO-3: flashsys train --zero-stage 3 (FSDP2)",
             "torch FSDP2, the same configuration (reshard_after_forward=True)"}
# Rows on NCCL communicator settings, which gloo does not have.
NCCL_ONLY = {name for name, build in VARIANTS.items() if getattr(build, "nccl_only", False)}
# A step's phases, each from its mark to the next: forward (zero_grad, forward, loss; with ZeRO-2's overlapped
# all-gathers, the waits for them), backward (gradient synchronisation finishes inside it), optimizer step (and
# whatever it leaves the next step's start to wait for).
PHASES = ("forward", "backward", "step")


def train_step(built: Built, x: torch.Tensor, autocast: Callable, mark: Callable[[], None] | None = None) -> None:
    """One step: zero_grad, forward under `autocast()` and the next-token loss, backward, optimizer step.
    `mark()`, if given, runs before the backward and before the optimizer step (the phase boundaries)."""
    built.opt.zero_grad(set_to_none=True)
    with autocast():
        logits = built.net(x[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    if mark is not None:
        mark()
    loss.backward()
    if mark is not None:
        mark()
    built.opt.step()


def worker(rank, world, device, cfg, batch, warmup, iters, rounds, only, out_json):
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    x = token_batch(cfg, batch, device, torch.Generator().manual_seed(rank))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    names = [n for n in VARIANTS if (n == "compute only" or not only or n in only)
             and (n not in NCCL_ONLY or dist.get_backend() == "nccl")]
    torch.manual_seed(0)
    shared = TransformerLM.from_config(cfg, device=device)
    own: dict[str, tuple[nn.Module, Built]] = {}
    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, dict[str, list[float]]] = {n: {ph: [] for ph in PHASES} for n in names}
    memory: dict[str, tuple[int, float]] = {}
    peak: dict[str, float] = {}
    info: dict[str, dict] = {}
    for r in range(rounds):
        for name in round_order(names, r):
            first = name not in peak
            if first and device.type == "cuda":
                # What the other variants hold (their models and state stay alive): this variant's peak is the
                # allocator's peak over it. The shared model's parameters belong to the variant that uses it.
                held = 0 if name in OWN_MODEL else sum(p.numel() * p.element_size() for p in shared.parameters())
                others = torch.cuda.memory_allocated(device) - held
            if name in OWN_MODEL:
                if name not in own:
                    torch.manual_seed(0)
                    m = TransformerLM.from_config(cfg, device=device)
                    own[name] = (m, VARIANTS[name](m, device))
                model, built = own[name]
            else:
                model, built = shared, VARIANTS[name](shared, device)
            if first and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)  # the steps' peak, not building's transient copies
            marks = StepMarks(device)
            for i in range(warmup + iters):
                if i == warmup:
                    synchronize(device)  # every rank starts the timed steps together, nothing queued
                    dist.barrier()
                if i >= warmup:
                    marks.mark()  # three marks a step: its start, backward, optimizer step
                train_step(built, x, autocast, marks.mark if i >= warmup else None)
            if hasattr(built.opt, "wait_for_parameters"):
                built.opt.wait_for_parameters()  # the last step's all-gathers belong to its time
            marks.mark()
            gaps = marks.intervals_ms()
            for k in range(0, len(gaps), len(PHASES)):
                for phase, ms in zip(PHASES, gaps[k:k + len(PHASES)]):
                    phases[name][phase].append(ms)
                times[name].append(sum(gaps[k:k + len(PHASES)]))
            if first:
                peak[name] = (torch.cuda.max_memory_allocated(device) - others if device.type == "cuda"
                              else float("nan"))
            alloc = torch.cuda.memory_allocated(device) / MB if device.type == "cuda" else float("nan")
            memory[name] = (sum(gradient_and_state_bytes(model, built.opt, built.wrapper)), alloc)
            if isinstance(built.wrapper, BucketedDDP):
                info[name] = {"buckets": len(built.wrapper.bucket_sizes_bytes),
                              "bucket_MB": round(max(built.wrapper.bucket_sizes_bytes, default=0) / MB, 1)}
            if name not in OWN_MODEL:
                for undo in built.teardown:
                    undo()
                del built
                shared.zero_grad(set_to_none=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    # The slowest rank's time of each step.
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (times, memory, phases, peak))
    rows = []
    for name in names:
        steps = [max(g[0][name][k] for g in gathered) for k in range(len(times[name]))]
        q = statistics.quantiles(steps, n=10) if len(steps) > 1 else [steps[0]] * 9
        rows.append({"variant": name, "median_ms": statistics.median(steps), "p10_ms": q[0], "p90_ms": q[-1],
                     "steps": len(steps), "grad_state_MB": max(g[1][name][0] for g in gathered) / MB,
                     "alloc_MB": max(g[1][name][1] for g in gathered),
                     "peak_MB": max(g[3][name] for g in gathered) / MB, **info.get(name, {}),
                     **{f"{ph}_ms": statistics.median(max(g[2][name][ph][k] for g in gathered)
                                                      for k in range(len(times[name]))) for ph in PHASES}})
    compute = rows[0]["median_ms"]
    for r in rows:
        r["exposed_ms"] = r["median_ms"] - compute
        r["exposed_%"] = 100 * r["exposed_ms"] / compute
    total = sum(p.numel() * p.element_size() for p in shared.parameters())
    write_result(rank, out_json, {"rows": rows, "total_bytes": total})


def plot(rows: list[dict], out, name: str) -> None:
    """Median step per variant with its p10–p90 spread, and the compute-only floor."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    y = range(len(rows))
    med = [r["median_ms"] for r in rows]
    err = [[r["median_ms"] - r["p10_ms"] for r in rows], [r["p90_ms"] - r["median_ms"] for r in rows]]
    ax.barh(list(y), med, xerr=err, color=["gray"] + ["C0"] * (len(rows) - 1), capsize=2)
    ax.axvline(rows[0]["median_ms"], color="gray", linestyle=":")
    ax.set_yticks(list(y), [r["variant"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("step time, median and p10–p90 (ms)")
    save_plot(fig, out, name)


# The plan's strategy (`flashsys.plan`) of the rows that run what the trainer runs; compute only is one rank.
PLANNED = {"compute only": "ddp", "BucketedDDP auto, bucket views": "ddp",
           "ZeRO-1: BucketedDDP + ShardedOptimizer": "zero1", "ZeRO-2: BucketedDDP + ZeRO2Optimizer": "zero2",
           "ZeRO-3: flashsys train --zero-stage 3 (FSDP2)": "zero3"}


def add_plan(rows: list[dict], cfg, world: int, batch: int, context: int) -> None:
    """Beside each row that `PLANNED` maps, what `flashsys plan` predicts for it: peak MB per rank and step ms
    (on a GPU it knows; nothing on a CPU). The plan counts what the benchmark runs: fp32 weights, fused AdamW,
    bf16 autocast, the measured all-reduce bandwidth."""
    import dataclasses

    from flashsys.mfu import peak_flops
    from flashsys.plan import Device, plan

    peak = peak_flops("cuda", "bfloat16") if torch.cuda.is_available() else None
    if peak is None:  # a CPU, or a GPU whose peak flashsys.mfu does not list
        return
    gpu = torch.cuda.get_device_properties()
    device = Device(gpu.name, gpu.total_memory, {"bfloat16": peak})
    config = dataclasses.replace(cfg, context_length=context)
    for r in rows:
        strategy = PLANNED.get(r["variant"])
        if strategy is None:
            continue
        p = plan(config, 1 if r["variant"] == "compute only" else world, batch, strategy, device)
        r["plan_peak_MB"] = p.memory.total / MB
        r["peak_vs_plan"] = r["peak_MB"] / r["plan_peak_MB"]
        r["plan_ms"] = p.step_s * 1e3
        r["ms_vs_plan"] = r["median_ms"] / r["plan_ms"]


def scaling_rows(by_world: dict[int, list[dict]]) -> list[dict]:
    """Per variant measured at every world size: its median step and peak memory per rank at each, and the
    weak-scaling efficiency (same batch per rank) of each larger world against the smallest: t(smallest) / t(world)."""
    worlds = sorted(by_world)
    tables = {w: {r["variant"]: r for r in by_world[w]} for w in worlds}
    rows = []
    for name in tables[worlds[0]]:
        if not all(name in tables[w] for w in worlds):
            continue
        row = {"variant": name}
        for w in worlds:
            row[f"ms_w{w}"] = tables[w][name]["median_ms"]
        for w in worlds[1:]:
            row[f"efficiency_w{w}"] = tables[worlds[0]][name]["median_ms"] / tables[w][name]["median_ms"]
        for w in worlds:
            row[f"exposed_%_w{w}"] = tables[w][name]["exposed_%"]
        for w in worlds:
            row[f"peak_MB_w{w}"] = tables[w][name]["peak_MB"]
            row[f"grad_state_MB_w{w}"] = tables[w][name]["grad_state_MB"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "ddp")
    add_distributed_model_args(p, several_worlds=True)
    # Batch 16 per rank on GPUs: at the harness's batch 2 the eager xl step is bound by host launch work (273 ms for
    # ~40 ms of GPU math on 2 x H200) and host jitter spread one variant's steps over +-15%.
    p.set_defaults(warmup=2, iters=5, batch=16 if torch.cuda.is_available() else 2)
    p.add_argument("--rounds", type=int, default=4, help="rounds; each variant is timed for --iters steps per round")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), metavar="NAME",
                   help=f"measure only these (compute only is always measured): {'; '.join(VARIANTS)}")
    args = p.parse_args(argv)
    if any(w < 2 for w in args.world_size):
        p.error(f"--world-size: data parallelism needs 2 or more ranks, got {args.world_size}")
    cfg = distributed_model_config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[dict]] = {}
    env = environment()
    for world in args.world_size:
        res = spawn_for_result(worker, world, cfg, args.batch, args.warmup, args.iters, args.rounds,
                               args.variants, backend=args.backend, scratch_dir=args.out)
        rows, total = res["rows"], res["total_bytes"]
        add_plan(rows, cfg, world, args.batch, args.context)
        by_world[world] = rows
        name = f"ddp_{args.backend}_w{world}"
        precision = "bf16 autocast" if torch.cuda.is_available() else "fp32"
        path = write_table(
            rows, args.out, name, f"Data-parallel training step (AdamW), {world} ranks",
            [f"{world} ranks, {args.backend}, model {args.preset} ({total / MB:.0f} MB of fp32 parameters), context "
             f"{args.context}, batch {args.batch} per rank, {precision}. "
             f"{args.rounds} interleaved rounds (the variants' order changed each round) of {args.warmup} warm-up + "
             f"{args.iters} timed steps per variant; "
             "median and p10/p90 of the slowest rank's step. exposed = median - compute-only median. peak_MB: the "
             "allocator's peak over the variant's first round, per rank (the most of any rank), less what the other "
             "variants hold. plan_peak_MB and plan_ms: what `flashsys plan` predicts for the rows it models "
             "(compute only as one rank)."], env)
        plot(rows, args.out, name)
        print(path.read_text())
    if len(by_world) > 1:
        worlds = sorted(by_world)
        path = write_table(
            scaling_rows(by_world), args.out, f"ddp_{args.backend}_scaling",
            f"Data-parallel weak scaling, {' and '.join(map(str, worlds))} ranks",
            [f"The same model ({args.preset}), context {args.context} and batch {args.batch} per rank at each world "
             f"size (tables ddp_{args.backend}_w<N>). efficiency_w<N> = median step at {worlds[0]} ranks / median "
             "step at N ranks (1.0: perfect weak scaling). Peak and gradient + optimizer-state memory per rank."], env)
        print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
