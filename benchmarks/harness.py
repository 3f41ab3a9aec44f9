"""The measurement harness every benchmark script shares.

- Timing: `flashsys.timing` (the one timer of the project, also used by the trainer and BucketedDDP's cost
  model); warm-up steps kept out of the numbers; on CUDA each step is timed with CUDA events, on a CPU with
  perf_counter; mean, std and median in milliseconds.
- Memory: peak allocated bytes on CUDA (`torch.cuda.max_memory_allocated`) around a region.
- Profiling: `--nvtx` wraps regions in NVTX ranges for `nsys`; `--memory-snapshot PATH` records a
  `torch.cuda.memory` snapshot for https://pytorch.org/memory_viz.
- Results: a table of rows written as Markdown and CSV (with device, versions, command and date) and a PNG plot,
  into `benchmarks/results/<script>/` by default; with `--run LABEL` (the suites that take it) a run's rows join
  those of the runs the table holds already. A cell that fails (OOM, unsupported) is recorded and the sweep goes
  on.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from flashsys.nn import PRESETS, ModelConfig, preset
from flashsys.ops.attention.timed_choice import behind_spin_ms, gpu_ms
from flashsys.timing import repeat, summarize, synchronize

RESULTS = Path(__file__).parent / "results"
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

native_launch = None
if ON_GPU:  # eager flashsys calls take the native launcher once it is built (in the background on first use): build
    try:    # it before any benchmark times anything, so no row depends on when the build finished
        from flashsys.ops.attention.replay import native as native_launch

        native_launch.wait()
    except ImportError:  # no Triton: no flashsys Triton op either
        pass


def sync() -> None:
    """Wait for this process's GPU work (no-op on a CPU)."""
    synchronize(DEVICE)


def bench_ms(fn: Callable[[], object], rep_ms: int = 200, warmup_ms: int = 50) -> float:
    """Median milliseconds of a short GPU op (triton.testing.do_bench), or a few CPU runs."""
    if ON_GPU:
        import triton

        return triton.testing.do_bench(fn, rep=rep_ms, warmup=warmup_ms, return_mode="median")
    return summarize(repeat(fn, warmup=1, iters=5, device=DEVICE)).median


def warm_l2_ms(fn: Callable[[], object], rep_ms: int = 200, calls: int = 10) -> float:
    """Median milliseconds of fn with its inputs left in the L2 cache: `calls` back-to-back calls between two CUDA
    events, repeated for about rep_ms, each repeat's time divided by `calls`. `bench_ms` (do_bench) flushes the L2
    before every call, which is right for a kernel alone but not for one inside a model, whose inputs the kernel
    before it has just written; the two together show how much of a kernel's time is its inputs' trip from memory.

    Each repeat starts behind a spin kernel longer than the host takes to issue its calls
    (`timed_choice.behind_spin_ms`), so the calls run back to back on the GPU even where one call's host time exceeds
    its GPU time (cuDNN's attention through SDPA's Python dispatch): without it the events would time the host. On a
    CPU: `bench_ms`."""
    if not ON_GPU:
        return bench_ms(fn, rep_ms=rep_ms)
    return behind_spin_ms(fn, rep_ms, calls=calls)


# The probes' timers by name (scripts/forward_variants.py --timing, scripts/ab_trees.py --timing), each taking
# (call, rep_ms): "gpu" the GPU work alone with the L2 flushed (as the dispatch's timed choice measures), "warm" the GPU
# work with the inputs left in L2 (as a model hands them over), "call" do_bench of the call, its host path included.
TIMERS: dict[str, Callable[[Callable[[], object], int], float]] = {"gpu": gpu_ms, "warm": warm_l2_ms, "call": bench_ms}


def graph_ms(fn: Callable[[], object], rep_ms: int = 200, warmup_ms: int = 50) -> float:
    """Median milliseconds of fn captured once in a CUDA graph and replayed: its GPU time without the host time of
    its launches (how a serving loop or `torch.compile(mode="reduce-overhead")` runs a short op). GPU only."""
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, rep=rep_ms, warmup=warmup_ms, return_mode="median")


@contextlib.contextmanager
def peak_memory() -> Iterator[dict]:
    """Yields a dict that holds 'peak_mb' (extra peak allocated over the start) after the block; None on CPU.

    Garbage is collected first: a tensor kept alive only by a reference cycle would count in the start, and if a
    collection inside the block freed it, the block's allocations would reuse its memory and read as less than they
    are. Warm the block's work up before measuring it: a compiled model's first call of a kind compiles inside it."""
    out: dict = {"peak_mb": None}
    if ON_GPU:
        gc.collect()
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    yield out
    if ON_GPU:
        sync()
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20


@contextlib.contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """Inside, os.environ[name] is `value` (for switches read at every call, e.g. FLASHSYS_GLUON); restored after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def nvtx(name: str, enabled: bool) -> Iterator[None]:
    """An NVTX range around the block for nsys, when enabled and on a GPU."""
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
    """"OOM" or "unsupported (ExceptionType)": what a failed cell's row says."""
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "OOM"
    return f"unsupported ({type(exc).__name__})"


def at_least_one(text: str) -> int:
    """argparse type of --rounds: a whole number, 1 or more (no rounds would leave no time to take a median of)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want a whole number of rounds, 1 or more")
    return int(text)


def add_probe_args(p: argparse.ArgumentParser, heads: int) -> None:
    """--heads, --kv-heads, --rounds and --rep of the kernel probes that time implementations on the same tensors
    in interleaved rounds (scripts/forward_variants.py, scripts/tl_tiles.py); `kv_heads_of` reads --kv-heads."""
    p.add_argument("--heads", type=int, default=heads, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads, dividing --heads (default: --heads)")
    p.add_argument("--rounds", type=at_least_one, default=3,
                   help="interleaved rounds, their order changed each round; each time is the rounds' median")
    p.add_argument("--rep", type=int, default=60, help="do_bench rep in ms per measurement")


def kv_heads_of(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The K/V heads `add_probe_args`'s options ask for; a count that does not divide --heads is refused."""
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if kv_heads < 1 or args.heads % kv_heads:
        p.error(f"argument --kv-heads: {kv_heads} must be a positive divisor of --heads ({args.heads})")
    return kv_heads


def run_cell(fn: Callable[[], dict]) -> dict:
    """Run one sweep cell; an OOM or unsupported configuration becomes a labelled row, not a crash."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        if ON_GPU:
            torch.cuda.empty_cache()
        return {"error": failure_label(exc), "detail": str(exc).splitlines()[0][:120] if str(exc) else ""}


def add_common_args(p: argparse.ArgumentParser, script: str) -> None:
    """--warmup, --iters, --out, --nvtx, --memory-snapshot and --no-progress, shared by every script."""
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (0 shows what skipping it does)")
    p.add_argument("--iters", type=int, default=10, help="timed steps")
    p.add_argument("--out", type=Path, default=RESULTS / script, help="results directory")
    p.add_argument("--nvtx", action="store_true", help="NVTX ranges for nsys")
    p.add_argument("--memory-snapshot", metavar="PATH", help="write a torch.cuda.memory snapshot (pickle)")
    p.add_argument("--no-progress", action="store_true")


def add_distributed_model_args(p: argparse.ArgumentParser, several_worlds: bool = False) -> None:
    """Model and world options of the multi-process benchmarks (xl on 2 GPUs; the tiny preset on 2 CPU ranks).
    With `several_worlds`, --world-size takes one or more sizes (a list in `args.world_size`)."""
    p.add_argument("--preset", default="xl" if ON_GPU else "tiny", choices=list(PRESETS),
                   help="model preset (default: xl on GPUs, tiny on a CPU)")
    p.add_argument("--context", type=int, default=512 if ON_GPU else 64)
    p.add_argument("--batch", type=int, default=2, help="per rank")
    if several_worlds:
        p.add_argument("--world-size", type=int, nargs="+", default=[2],
                       help="ranks; several sizes run one after the other, with a weak-scaling table")
    else:
        p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl" if ON_GPU else "gloo")


def distributed_model_config(args: argparse.Namespace) -> ModelConfig:
    """The benchmark model: the preset, vocab 10,000, room for `--context` inputs plus the shifted target."""
    return preset(args.preset, vocab_size=10_000, context_length=args.context + 1)


def token_batch(cfg: ModelConfig, batch: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random token ids (batch, context_length): inputs are [:, :-1], next-token targets [:, 1:]."""
    return torch.randint(0, cfg.vocab_size, (batch, cfg.context_length), generator=generator).to(device)


def gradient_and_state_bytes(model: torch.nn.Module, opt, wrapper=None) -> tuple[int, int]:
    """(gradient bytes, optimizer-state bytes) this rank holds, each storage counted once: `.grad` (local shards
    of DTensors), BucketedDDP's bucket buffers and ZeRO-2 shards, and the state of `opt` (or of its inner
    optimizer: ShardedOptimizer.inner, ZeRO2Optimizer.inner_state, ZeroRedundancyOptimizer.optim)."""
    from flashsys.dist import BucketedDDP
    from flashsys.optim import ZeRO2Optimizer

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def unique_bytes(tensors) -> int:
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    if isinstance(wrapper, BucketedDDP):
        grads += [t for b in wrapper.buckets for t in (b.buffer, b.comm, b.grad_shard) if t is not None]
    if isinstance(opt, ZeRO2Optimizer):
        state = opt.inner_state
    else:
        state = (getattr(opt, "inner", None) or getattr(opt, "optim", None) or opt).state
    states = [local(v) for s in state.values() for v in s.values() if torch.is_tensor(v)]
    return unique_bytes(grads), unique_bytes(states)


def result_path(scratch_dir: Path) -> Path:
    """Where rank 0 leaves its result for the launching process (spawn or torchrun)."""
    return scratch_dir / ".rank0_result.json"


def write_result(rank: int, path: str | Path, obj) -> None:
    """Rank 0 hands a worker's result (JSON) to the launching process, which `read_result` takes it from."""
    if rank == 0:
        Path(path).write_text(json.dumps(obj))


def read_result(path: str | Path):
    """What `write_result` left at `path` (the file is removed)."""
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
    """A tqdm bar on stderr over `items`."""
    from tqdm import tqdm

    return tqdm(list(items), desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)


def environment() -> dict[str, str]:
    """Device, versions, date and command: the header of every result file."""
    env = {
        "device": torch.cuda.get_device_name() if ON_GPU else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": command_line(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if ON_GPU:
        env["gpus"] = str(torch.cuda.device_count())
        if native_launch is not None:
            env["native launcher"] = native_launch.status()
            from flashsys.ops.attention import dispatch

            env["gluon kernels"] = dispatch.status()
    return env


def command_line() -> str:
    """How this script was started, as `python -m benchmarks.<name> ...` when run as a module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return "python -m " + " ".join([spec.name, *sys.argv[1:]])
    return "python " + " ".join(sys.argv)


def fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _env_value(key: str, value) -> str:
    """An environment entry's value as a header writes it (a command line as code)."""
    return f"`{value}`" if key == "command" else f"{value}"


def _write(rows: list[dict], out_dir: Path, name: str, title: str, header: list[str], notes: list[str]) -> Path:
    """`rows` as <out_dir>/<name>.md (under `title`, the `header` lines and the `notes`) and .csv; the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    md = [f"# {title}", "", *header, ""] + notes + ([""] if notes else [])
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


def write_table(rows: list[dict], out_dir: Path, name: str, title: str, notes: list[str] | None = None,
                env: dict | None = None, run: str | None = None) -> Path:
    """Markdown (with the environment) and CSV of the rows; returns the Markdown path. With `run` (a label, as
    `--run` gives it) the rows are that run of a table of several (`_with_run`) instead of the whole table."""
    env = env or environment()
    if run is not None:
        return _with_run(rows, out_dir, name, title, run, list(notes or []), env)
    header = [f"- {k}: {_env_value(k, v)}" for k, v in env.items()]
    return _write(rows, out_dir, name, title, header, list(notes or []))


def run_label(text: str) -> str:
    """An argparse type: a run's label, not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("a run's label cannot be empty")
    return text


def add_run_arg(p: argparse.ArgumentParser) -> None:
    """--run LABEL: write the table as one run of several (`write_table`'s `run`; `check_run_table` before measuring
    anything)."""
    p.add_argument("--run", metavar="LABEL", type=run_label, default=None,
                   help="write this run's rows into the table beside the runs it already holds (a first column "
                        "`run`; the header lists what differs run by run; a run of the same label is replaced), "
                        "instead of replacing the table: several runs of one suite in one table")


# How a table of several runs records them in its Markdown: one HTML comment (not shown where Markdown is rendered)
# holding each run's label, environment and notes as JSON, so that the next run's write keeps them.
_RUNS_MARK = "<!-- runs: "


def _recorded_runs(md_path: Path) -> list[dict]:
    """The runs a table of several records ([] where there is no table yet).

    Raises:
        ValueError: the table there records no runs (written without a label), or its CSV (the runs' rows) is gone.
    """
    if not md_path.exists():
        return []
    for line in md_path.read_text().splitlines():
        if line.startswith(_RUNS_MARK) and line.endswith(" -->"):
            if not md_path.with_suffix(".csv").exists():
                raise ValueError(f"{md_path} records runs whose rows were in {md_path.with_suffix('.csv').name}, "
                                 "which is missing: restore it, or move the Markdown away to start a new table")
            return json.loads(line[len(_RUNS_MARK):-len(" -->")])
    raise ValueError(f"{md_path} holds a table of one run (written without a run label), which adding a run would "
                     "lose: give this run another name, or move that table away first")


def check_run_table(p: argparse.ArgumentParser, out_dir: Path, name: str, run: str | None) -> None:
    """Before a run measures anything: where it is to be added to the table <out_dir>/<name> (`--run`), that table,
    if there is one, must hold runs already (else the rows measured could not be written after them): `p.error`
    otherwise."""
    if run is not None:
        try:
            _recorded_runs(out_dir / f"{name}.md")
        except ValueError as exc:
            p.error(f"--run: {exc}")


def _csv_value(text: str):
    """A CSV cell read back as `write_table` had it: None for an empty cell, an int or float where it parses as
    one, the text otherwise."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _with_run(rows: list[dict], out_dir: Path, name: str, title: str, run: str, notes: list[str],
              env: dict) -> Path:
    """`rows` as run `run` of the table <out_dir>/<name> (.md and .csv), beside the runs it already holds: each row
    gets a first column `run`; rows of the other runs are kept as they were, and those of an earlier run with the
    same label are replaced (in place). The header lists each environment entry once where every run has the same,
    else run by run; a note every run has is written once, any other under its run's label. Returns the Markdown path.

    Raises:
        ValueError: from `_recorded_runs`: the table there was written without a run label, or its CSV is gone.
    """
    env = {k: str(v) for k, v in env.items()}
    md_path, csv_path = out_dir / f"{name}.md", out_dir / f"{name}.csv"
    runs = _recorded_runs(md_path)
    kept: list[dict] = []
    if runs:
        with open(csv_path, newline="") as f:
            kept = [{k: v if k == "run" else _csv_value(v) for k, v in r.items()} for r in csv.DictReader(f)]
    new_rows = [{"run": run, **r} for r in rows]
    labels = [r["run"] for r in runs]
    if run in labels:  # run again: its rows and record take the old ones' place
        at = next((i for i, r in enumerate(kept) if r["run"] == run), len(kept))
        kept = [r for r in kept if r["run"] != run]
        kept[at:at] = new_rows
        runs[labels.index(run)] = {"run": run, "env": env, "notes": notes}
    else:
        kept += new_rows
        runs.append({"run": run, "env": env, "notes": notes})
    header: list[str] = []
    for key in dict.fromkeys(k for r in runs for k in r["env"]):
        values = [r["env"].get(key) for r in runs]
        if all(v == values[0] for v in values):
            header.append(f"- {key}: {_env_value(key, values[0])}")
        else:
            header.append(f"- {key}:")
            header += [f"  - run {r['run']}: {_env_value(key, v)}"
                       for r, v in zip(runs, values) if v is not None]
    record = json.dumps(runs, ensure_ascii=False).replace("--", "-\\u002d")  # an HTML comment holds no "--"
    header += ["", f"{_RUNS_MARK}{record} -->"]
    shared = [n for n in runs[0]["notes"] if all(n in r["notes"] for r in runs)]
    own = [f"Run {r['run']}: {n}" for r in runs for n in r["notes"] if n not in shared]
    return _write(kept, out_dir, name, title, header, shared + own)


def save_plot(fig, out_dir: Path, name: str) -> Path:
    """Save `fig` as <out_dir>/<name>.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
