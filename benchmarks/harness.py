"""The measurement harness every benchmark script shares.

- Timing: warm-up steps kept out of the numbers; on CUDA each step is timed with CUDA events, on a CPU with
  perf_counter; mean, std and median in milliseconds.
- Memory: peak allocated bytes on CUDA (`torch.cuda.max_memory_allocated`) around a region.
- Profiling: `--nvtx` wraps regions in NVTX ranges for `nsys`; `--memory-snapshot PATH` records a
  `torch.cuda.memory` snapshot for https://pytorch.org/memory_viz.
- Results: a table of rows written as Markdown and CSV (with device, versions, command and date) and a PNG plot,
  into `benchmarks/results/<script>/` by default. A cell that fails (OOM, unsupported) is recorded and the
  sweep goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
ON_GPU = torch.cuda.is_available()


@dataclass
class Stats:
    mean: float
    std: float
    median: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.std:.3f}"


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def time_steps(step: Callable[[], object], warmup: int, iters: int) -> Stats:
    """Run `step` warmup times untimed, then iters times timed; milliseconds."""
    for _ in range(warmup):
        step()
    sync()
    samples = []
    for _ in range(iters):
        if ON_GPU:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t) * 1e3)
    return summarize(samples)


def summarize(samples: list[float]) -> Stats:
    return Stats(statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0,
                 statistics.median(samples), len(samples))


def bench_ms(fn: Callable[[], object], rep_ms: int = 200, warmup_ms: int = 50) -> float:
    """Median milliseconds of a short GPU op (triton.testing.do_bench), or a few CPU runs."""
    if ON_GPU:
        import triton

        return triton.testing.do_bench(fn, rep=rep_ms, warmup=warmup_ms, return_mode="median")
    return time_steps(fn, warmup=1, iters=5).median


@contextlib.contextmanager
def peak_memory() -> Iterator[dict]:
    """Yields a dict that holds 'peak_mb' (extra peak allocated over the start) after the block; None on CPU."""
    out: dict = {"peak_mb": None}
    if ON_GPU:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    yield out
    if ON_GPU:
        sync()
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20


@contextlib.contextmanager
def nvtx(name: str, enabled: bool) -> Iterator[None]:
    if enabled and ON_GPU:
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


@contextlib.contextmanager
def memory_snapshot(path: str | None) -> Iterator[None]:
    """Record CUDA allocator history and dump a snapshot for the PyTorch memory visualiser."""
    if not path or not ON_GPU:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)")


def failure_label(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "OOM"
    return f"unsupported ({type(exc).__name__})"


def run_cell(fn: Callable[[], dict]) -> dict:
    """Run one sweep cell; an OOM or unsupported configuration becomes a labelled row, not a crash."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        if ON_GPU:
            torch.cuda.empty_cache()
        return {"error": failure_label(exc), "detail": str(exc).splitlines()[0][:120] if str(exc) else ""}


def add_common_args(p: argparse.ArgumentParser, script: str) -> None:
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (0 shows what skipping it does)")
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--out", type=Path, default=RESULTS / script, help="results directory")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges for nsys")
    p.add_argument("--memory-snapshot", metavar="PATH", help="write a torch.cuda.memory snapshot (pickle)")
    p.add_argument("--no-progress", action="store_true")


def add_distributed_model_args(p: argparse.ArgumentParser) -> None:
    """Model and world options of the multi-process benchmarks (xl on 2 GPUs; a small model on 2 CPU ranks)."""
    from flashsys.nn import PRESETS

    p.add_argument("--preset", default="xl" if ON_GPU else None, choices=list(PRESETS),
                   help="model preset (default: xl on GPUs; d_model 256, 4 layers on a CPU)")
    p.add_argument("--context", type=int, default=512 if ON_GPU else 64)
    p.add_argument("--batch", type=int, default=2, help="per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if ON_GPU else "gloo")


def distributed_model_config(args: argparse.Namespace) -> dict:
    from flashsys.nn import PRESETS

    if args.preset:
        pr = PRESETS[args.preset]
        cfg = dict(d_model=pr.d_model, layers=pr.num_layers, heads=pr.num_heads, d_ff=pr.d_ff)
    else:
        cfg = dict(d_model=256, layers=4, heads=4, d_ff=1024)
    return {**cfg, "context": args.context + 1, "batch": args.batch}


def result_path(scratch_dir: Path) -> Path:
    """Where rank 0 leaves its result for the launching process (spawn or torchrun)."""
    return scratch_dir / ".rank0_result.json"


def write_result(rank: int, path: str | Path, obj) -> None:
    """Rank 0 hands a worker's result (JSON) to the launching process, which `read_result` takes it from."""
    if rank == 0:
        Path(path).write_text(json.dumps(obj))


def read_result(path: str | Path):
    path = Path(path)
    try:
        return json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)


def spawn_for_result(worker: Callable, world_size: int, *args, backend: str, scratch_dir: Path):
    """Run worker(rank, world, device, *args, result_path) in spawned processes and return what rank 0 wrote
    there with `write_result` (spawned processes cannot return values)."""
    from flashsys.dist import spawn

    path = result_path(scratch_dir)
    spawn(worker, world_size, *args, str(path), backend=backend)
    return read_result(path)


def progress(items, desc: str, disable: bool = False):
    from tqdm import tqdm

    return tqdm(list(items), desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)


def environment() -> dict[str, str]:
    env = {
        "device": torch.cuda.get_device_name() if ON_GPU else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if ON_GPU:
        env["gpus"] = str(torch.cuda.device_count())
    return env


def fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def write_table(rows: list[dict], out_dir: Path, name: str, title: str, notes: list[str] | None = None,
                env: dict | None = None) -> Path:
    """Markdown (with the environment) and CSV of the rows; returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    md = [f"# {title}", ""] + [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    md += [""] + [f"{n}" for n in (notes or [])] + ([""] if notes else [])
    md.append("| " + " | ".join(columns) + " |")
    md.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        md.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(md) + "\n")
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in columns})
    return path


def save_plot(fig, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
