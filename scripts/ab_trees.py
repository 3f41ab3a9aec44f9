"""Two source trees' attention timed against each other in interleaved rounds, one worker process per tree.

A kernel change whose host code changed too (a buffer's shape, a kernel's arguments) cannot be timed against the old
code in one process: each tree must import its own flashsys. Here each tree gets a worker, a Python started in that
tree with the tree first on its path, and the driver asks the workers in turn to time each cell, so only one of
them uses the GPU at a time and the clocks' drift falls on both alike. Each round changes the order in which the trees
(and the baseline) go (`flashsys.timing.round_order`).

Each worker also returns a digest of the first backward's dQ, dK and dV (of the output, for `--what fwd`). Two trees
whose deterministic backwards add the same sums in the same order must give the same digest; the table says whether
they did. Each tree makes its own timed kernel choices, which may differ (each tree's `dispatch.status()` after the
last cell goes to stderr and into `--out`'s header): under FLASHSYS_TRITON_AUTOTUNE=0 both take their tables' first
candidates, the way to compare bits (not times).

    mkdir -p .ab/main && git archive main | tar -x -C .ab/main   # plain files: a copy to carry to another machine
    python scripts/ab_trees.py --trees .ab/main . --cells 128:full:16384 128:causal:16384 --rounds 5 --baseline
    python scripts/ab_trees.py --trees .ab/main . --what step --steps small:2048 --rounds 3 --baseline

The table goes to stdout; `--out DIR` also writes it as DIR/ab_trees.md and .csv (`--name` for another name) under
the device, versions, date and command, each tree's git commit (marked where its tracked files had changes), or that
it is no checkout (a copy like .ab/main above: its commit goes in your notes), and each tree's kernel choices.

A cell is D:MASK:N (MASK full or causal), with batch = --tokens // N and --heads heads, bf16 on a GPU (float32 on a
CPU, where the times say nothing about kernels: that is for trying the script, with `--impl flash-torch`), q, k, v and
dO dense (B, H, N, D) (`--layout bhnd`, the default) or a model's (B, N, H, D) memory viewed as (B, H, N, D)
(`--layout bnhd`, FA4's layout and that of the FA4 sweep's tables): the same values either way (`in_layout`, here and
not in a tree's `benchmarks`, because the workers run this file against older trees too). `--impl` names the attention
backend of each tree's registry (`flashsys.ops.attention.ATTENTION_BACKENDS`; flash-triton by default, as the sweep's)
or the sweep's flash-triton-nondet (determinism off), timed with each tree's `benchmarks.harness.bench_ms` (do_bench
of the eager call, its host path included: what an eager model pays), or with `--timing gpu` each tree's
`timed_choice.gpu_ms` (the GPU work alone, L2 flushed: what a compiled graph or a CUDA graph pays, where calls of a
tenth of a millisecond would otherwise time the host). `--what bwd` (the default) times the backward alone, `fwd` the
forward alone (no autograd graph), `fwd_bwd` a forward and its backward; `--baseline` also times sdpa-cudnn (GPU only)
in the first tree's worker.

`--what step` times a language model's training step instead, in each tree as that tree's `benchmarks.end_to_end`
builds and times it (bf16 autocast on a GPU, AdamW; `--step-mode compiled` by default): a step cell is
PRESET:CONTEXT[:HEADS] (`--steps small:2048`; `small:2048:6` is the small model with 6 heads of D 128), each round one
`--iters` steps back to back after the model's warm-up, its median kept (`Model.time_steps`); `--baseline` adds the
model with SDPA's attention in the first tree. The workers build and warm up their models at the same time (compiling
is most of a step cell's time; every tree's models stay on the GPU for the rounds anyway, but their warm-ups'
activations now peak together), then take turns at the timed rounds. Both trees build their model from the same seed;
the steps' bits are not compared (the embedding's backward adds in no fixed order).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPLY = "AB_TREES "  # a worker's answers start with this; anything else it prints goes to the driver's stderr
CELL_REP_MS = 200  # each attention cell's timing lasts about this long (do_bench's rep, or gpu_ms's)
# --layout's words in the table's header.
LAYOUT_NOTES = {"bhnd": "q, k, v and dO dense (B, H, N, D)",
                "bnhd": "q, k, v and dO in (B, N, H, D) memory viewed as (B, H, N, D), as a model's projections lay "
                        "them out"}
# --timing's words in the table's notes.
TIMING_NOTES = {"call": "each timing `do_bench`'s median of the eager call, its host path included",
                "gpu": "each timing the GPU work alone, the L2 flushed before each run (`timed_choice.gpu_ms`)"}
BASELINES = {"sdpa-cudnn": "cuDNN", "sdpa": "SDPA"}  # --baseline's backend (attention cells, steps): its label


class Cell(NamedTuple):
    head_dim: int
    causal: bool
    n: int

    def label(self) -> str:
        return f"D {self.head_dim} {'causal' if self.causal else 'full'} N {self.n}"


def cell_spec(text: str) -> Cell:
    """argparse type of a cell written D:MASK:N, e.g. 128:causal:16384."""
    parts = text.split(":")
    if len(parts) != 3 or parts[1] not in ("full", "causal") or not (parts[0].isdigit() and parts[2].isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: want D:MASK:N with MASK full or causal, e.g. 128:causal:16384")
    return Cell(int(parts[0]), parts[1] == "causal", int(parts[2]))


class StepCell(NamedTuple):
    preset: str
    context: int
    heads: int = 0  # the preset's own number of heads where 0

    def label(self) -> str:
        heads = f" with {self.heads} heads" if self.heads else ""
        return f"{self.preset}{heads} step, context {self.context}"

    def spec(self) -> str:
        """The cell as --steps takes it (`step_spec`)."""
        return ":".join(str(x) for x in self if x)


def step_spec(text: str) -> StepCell:
    """argparse type of a step cell written PRESET:CONTEXT or PRESET:CONTEXT:HEADS, e.g. small:2048, or
    small:2048:6 for the small model with 6 heads of 128 dimensions instead of 12 of 64."""
    name, *numbers = text.split(":")
    if not name or len(numbers) not in (1, 2) or not all(n.isdigit() and int(n) >= 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"{text!r}: want PRESET:CONTEXT or PRESET:CONTEXT:HEADS, e.g. "
                                         "small:2048")
    return StepCell(name, *(int(n) for n in numbers))


def tree_path(text: str) -> Path:
    """argparse type of a source tree: a folder with a flashsys package in it."""
    path = Path(text).resolve()
    if not (path / "flashsys" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no flashsys package there (want a source tree's root)")
    return path


# ---------------------------------------------------------------------------------------------------------- worker


def _reply(obj: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


LAYOUTS = tuple(LAYOUT_NOTES)  # --layout's choices, the default first


def in_layout(t, layout: str):
    """(B, H, N, D) tensor t's values in `layout`'s memory (`LAYOUTS`): dense (B, H, N, D), or (B, N, H, D) viewed
    as (B, H, N, D), as a model's projections hand attention its inputs."""
    if layout == "bhnd":
        return t.contiguous()
    if layout == "bnhd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    raise ValueError(f"layout {layout!r}: want one of {LAYOUTS}")


def _digest(tensors) -> str:
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())  # numpy has no bfloat16
    return h.hexdigest()[:16]


class StepCellError(Exception):
    """A step cell this tree cannot build; the worker's error reply is its message."""


def _step_model(request: dict, models: dict):
    """The model of a step cell's request ({"step": [PRESET, CONTEXT, HEADS or 0], "impl": an attention backend,
    "mode", "iters", "warmup", "batch"}), built and warmed up on its first request (`benchmarks.end_to_end.Model`);
    the models of one step cell are kept (the baseline's beside flashsys's), those of another dropped.

    Raises:
        StepCellError: the preset is not in this tree, or its model cannot be built (the message names the cell).
    """
    from types import SimpleNamespace

    import torch

    from benchmarks.end_to_end import PRESETS, Model
    from benchmarks.harness import ON_GPU

    cell = StepCell(*request["step"])
    preset_name, context, heads = cell
    spec = cell.spec()  # as --steps gave it
    if preset_name not in PRESETS:
        raise StepCellError(f"--steps {spec}: no such preset in this tree (it has {', '.join(PRESETS)})")
    if heads:
        # The preset with other heads, as a preset of this worker's own (the trees' `Model` builds from a preset's
        # name, and an older tree's takes nothing else).
        PRESETS.setdefault(f"{preset_name}/{heads}", PRESETS[preset_name].replace(num_heads=heads))
        preset_name = f"{preset_name}/{heads}"
    key = (preset_name, context, request["impl"], request["mode"])
    if key not in models:
        if any(k[:2] != key[:2] for k in models):
            models.clear()
            if ON_GPU:
                torch.cuda.empty_cache()
        torch.manual_seed(0)  # the same weights and tokens in every tree
        options = SimpleNamespace(iters=request["iters"], warmup=request["warmup"], batch=request["batch"],
                                  dtype="bf16" if ON_GPU else "fp32", nvtx=False)
        try:
            models[key] = Model(preset_name, context, request["impl"], request["mode"], options)
        except Exception as exc:  # noqa: BLE001  the driver stops with it, naming the tree
            raise StepCellError(f"--steps {spec} with {request['impl']}: {type(exc).__name__}: {exc}") from exc
    return models[key]


def _time_step(request: dict, models: dict) -> dict:
    """One round of a step cell's model (`_step_model`): its median step."""
    model = _step_model(request, models)
    model.time_steps()
    return {"ms": model.rounds[-1], "digest": None}


def _timed_call(what: str, backend, out, leaves: tuple, do, causal: bool):
    """The call `cell_timer`'s timer times for an attention cell: "bwd" the backward of `out` (its graph retained),
    "fwd" the forward without an autograd graph, "fwd_bwd" a forward and its backward."""
    import torch

    if what == "bwd":
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
    if what == "fwd":
        return torch.no_grad()(lambda: backend(*leaves, causal))
    return lambda: torch.autograd.grad(backend(*leaves, causal), leaves, do)


def _kernel_choices() -> str:
    """This worker's tree's kernel choices so far, as its `dispatch.status()` words them (each tree makes its own
    timed choices, and two trees may run other kernels in a cell); or why the tree cannot say."""
    try:
        from flashsys.ops.attention import dispatch

        return dispatch.status()
    except (ImportError, AttributeError) as exc:
        return f"not known ({type(exc).__name__}: {exc})"


def cell_timer(timing: str):
    """The timer of an attention cell, from the worker's own tree's `benchmarks.harness.TIMERS`: "call" do_bench of
    the eager call, host path included; "gpu" the GPU work alone, L2 flushed. Each takes (call, rep_ms)."""
    from benchmarks.harness import TIMERS

    return TIMERS[timing]


def worker(tokens: int, heads: int) -> int:
    """Serve the driver: one JSON request a line on stdin ({"cell": [D, causal, N], "impl": a registry backend,
    "what": "bwd", "fwd" or "fwd_bwd", "timing": "call" or "gpu" (`cell_timer`), "layout": one of `LAYOUTS`}, or a
    step cell's, `_time_step`, or {"choices": true}, `_kernel_choices`), one REPLY line each ({"ms": ...,
    "digest": ...}, {"choices": ...}, or {"error": ...})."""
    sys.path.insert(0, os.getcwd())  # this tree's flashsys and benchmarks before any other
    import torch

    import flashsys

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    _reply({"flashsys": flashsys.__file__, "torch": torch.__version__,  # checked before anything else imports
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "triton": triton_version, "python": platform.python_version()})
    from benchmarks.attention import NONDETERMINISTIC, implementation
    from benchmarks.harness import DEVICE, ON_GPU
    from flashsys.ops.attention import ATTENTION_BACKENDS, set_deterministic_backward

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    made_for, tensors = None, ()  # one cell's inputs at a time: the driver asks for a cell's rounds together
    models: dict = {}  # one step cell's models at a time
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("choices"):
            _reply({"choices": _kernel_choices()})
            continue
        if "step" in request:
            try:
                if request.get("prepare"):  # build and warm up only: the driver asks every worker at once
                    _step_model(request, models)
                    _reply({"ready": True})
                else:
                    _reply(_time_step(request, models))
            except StepCellError as exc:  # the driver stops with it, naming the tree
                _reply({"error": str(exc)})
            continue
        if request["impl"] not in (*ATTENTION_BACKENDS, NONDETERMINISTIC):
            _reply({"error": f"--impl {request['impl']!r}: no such backend in this tree's registry (it has "
                             f"{', '.join(ATTENTION_BACKENDS)}, and the sweep's {NONDETERMINISTIC})"})
            continue
        backend = implementation(request["impl"])  # as the sweep times it
        set_deterministic_backward(request["impl"] != NONDETERMINISTIC)
        d, causal, n = request["cell"]
        layout = request.get("layout", "bhnd")
        if made_for != (d, causal, n, layout):
            made_for, tensors = (d, causal, n, layout), ()
            if ON_GPU:
                torch.cuda.empty_cache()
            g = torch.Generator().manual_seed(1_000_003 * d + 7 * n + causal)  # the same inputs in every tree
            tensors = tuple(in_layout(torch.randn(max(1, tokens // n), heads, n, d, generator=g).to(DEVICE, dtype),
                                      layout) for _ in range(4))
        q, k, v, do = tensors
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))  # clone keeps the layout's strides
        # --what fwd: no autograd graph, so no backward kernel is built or timed, and the digest is the output's
        forward_only = request["what"] == "fwd"
        try:
            with torch.set_grad_enabled(not forward_only):
                out = backend(*leaves, causal)
            digested = (out,) if forward_only else torch.autograd.grad(out, leaves, do, retain_graph=True)
        except Exception as exc:  # noqa: BLE001  the driver stops with it, naming the tree
            _reply({"error": f"--impl {request['impl']} at D {d}, N {n}: {type(exc).__name__}: {exc}"})
            continue
        try:
            timer = cell_timer(request.get("timing", "call"))
        except ImportError as exc:  # an older tree without the GPU-alone timer
            _reply({"error": f"--timing {request['timing']}: this tree cannot time so ({exc})"})
            continue
        _reply({"ms": timer(_timed_call(request["what"], backend, out, leaves, do, causal), CELL_REP_MS),
                "digest": _digest(digested)})
        del out, digested, leaves
    return 0


# ---------------------------------------------------------------------------------------------------------- driver


class Worker:
    """One tree's worker process."""

    def __init__(self, tree: Path, tokens: int, heads: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
        self.tree = tree
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(tokens), str(heads)],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()
        imported = Path(self.hello["flashsys"]).resolve()
        if tree not in imported.parents:
            self.close()
            raise SystemExit(f"the worker for {tree} imported flashsys from {imported}, not from that tree")

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            sys.stderr.write(line)
        raise SystemExit(f"the worker for {self.tree} exited ({self.process.wait()}) without answering")

    def send(self, **request) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        answer = self._read()
        if "error" in answer:
            raise SystemExit(f"{self.tree}: {answer['error']}")
        return answer

    def ask(self, **request) -> dict:
        self.send(**request)
        return self.receive()

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=60)


class Run(NamedTuple):
    results: list[dict]  # a cell's: {"cell", "times": {"tree i" or the baseline: ms a round}, "digests"}
    hello: dict  # the first worker's: device and versions
    choices: list[str]  # each tree's kernel choices after its last cell (`_kernel_choices`)


def run(trees: list[Path], cells: list[Cell | StepCell], rounds: int, impl: str, what: str, baseline: bool,
        tokens: int, heads: int, step_options: dict | None = None, timing: str = "call", layout: str = "bhnd"
        ) -> Run:
    """Each cell's rows: per tree its times (ms, one a round) and digest; the baseline's times where asked. Step
    cells (`what` "step") are asked for with `step_options` (mode, iters, warmup, batch); attention cells are timed
    as `timing` says (`cell_timer`), on inputs in `layout`'s memory (`in_layout`)."""
    from flashsys.timing import round_order

    def request(cell: Cell | StepCell, backend: str) -> dict:
        if isinstance(cell, StepCell):
            return dict(step=list(cell), impl=backend, **(step_options or {}))
        return dict(cell=list(cell), impl=backend, what=what, timing=timing, layout=layout)

    workers = [Worker(tree, tokens, heads) for tree in trees]
    try:
        for w in workers:
            print(f"# {w.tree}: flashsys {w.hello['flashsys']}, torch {w.hello['torch']}, {w.hello['device']}",
                  flush=True)
        if baseline and workers[0].hello["device"] == "cpu" and any(isinstance(c, Cell) for c in cells):
            raise SystemExit("--baseline times SDPA's cuDNN backend: it needs a GPU")
        if timing == "gpu" and workers[0].hello["device"] == "cpu":
            raise SystemExit("--timing gpu times GPU work: it needs a GPU")
        results = []
        for cell in cells:
            if isinstance(cell, StepCell):
                # Every worker builds and warms up its models at once (compiling them is most of a step cell's
                # time, on the host's cores); only the timed rounds below take turns at the GPU.
                asked = [(w, request(cell, impl)) for w in workers]
                if baseline:
                    asked.append((workers[0], request(cell, "sdpa")))
                for w, req in asked:
                    w.send(**req, prepare=True)
                for w, _ in asked:
                    w.receive()
            # (column, worker, request) of each timing a round takes, in an order changed each round
            timings = [(f"tree {i}", w, request(cell, impl)) for i, w in enumerate(workers)]
            if baseline:
                name = "sdpa" if isinstance(cell, StepCell) else "sdpa-cudnn"
                timings.append((name, workers[0], request(cell, name)))
            times: dict[str, list[float]] = {column: [] for column, _, _ in timings}
            digests: dict[str, str] = {}
            for r in range(rounds):
                for column, w, req in round_order(timings, r):
                    answer = w.ask(**req)
                    times[column].append(answer["ms"])
                    if column.startswith("tree "):
                        digests[column] = answer["digest"]
            results.append({"cell": cell, "times": times, "digests": digests})
            # each cell's row as it is timed (stderr; the table comes at the end): a run cut short keeps its rows
            print("# " + table_row(results[-1], len(trees)), file=sys.stderr, flush=True)
        choices = [w.ask(choices=True)["choices"] for w in workers]
        for i, chosen in enumerate(choices):
            print(f"# tree {i}'s kernels: {chosen}", file=sys.stderr, flush=True)
        return Run(results, workers[0].hello, choices)
    finally:
        for w in workers:
            w.close()


def summary(result: dict, n_trees: int) -> dict[str, str | float]:
    """One cell's columns, in order: its median per tree (ms), each tree after the first against the first, the
    baseline's median and each tree against it where it was timed, and whether the trees' digests agreed ("—" where
    none were taken: step cells)."""
    med = {name: statistics.median(ts) for name, ts in result["times"].items()}
    row: dict[str, str | float] = {"cell": result["cell"].label()}
    row.update({f"tree {i} ms": med[f"tree {i}"] for i in range(n_trees)})
    row.update({f"tree {i} / tree 0": med[f"tree {i}"] / med["tree 0"] for i in range(1, n_trees)})
    base = next((name for name in BASELINES if name in med), None)
    if base is not None:
        row[f"{base} ms"] = med[base]
        row.update({f"tree {i} / {BASELINES[base]}": med[f"tree {i}"] / med[base] for i in range(n_trees)})
    digests = set(result["digests"].values())
    row["same bits"] = "—" if digests == {None} else "yes" if len(digests) == 1 else "no"
    return row


def table_row(result: dict, n_trees: int) -> str:
    """One cell's Markdown row of `table`: `summary`'s columns as `benchmarks.harness.write_table` writes them, so the
    printed row and the written one are the same text."""
    from benchmarks.harness import fmt

    return "| " + " | ".join(fmt(v) for v in summary(result, n_trees).values()) + " |"


def table(results: list[dict], trees: list[Path]) -> str:
    """A Markdown table of every cell's `table_row`, under a legend naming the trees."""
    head = list(summary(max(results, key=lambda r: len(r["times"])), len(trees))) if results else ["cell"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *(table_row(r, len(trees)) for r in results)]
    legend = [f"tree {i}: {tree}" for i, tree in enumerate(trees)]
    return "\n".join([*legend, "", *lines])


def tree_revision(tree: Path) -> str:
    """The tree's git commit, "+ uncommitted changes" where its tracked files differ from it; or why none."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "--short=12", "HEAD")  # a failure is an answer here: not a checkout
    if head.returncode != 0:
        return "not a git checkout"
    # A plain copy inside another checkout (an exported tree under .ab/) would report the enclosing one's commit.
    top = Path(git("rev-parse", "--show-toplevel").stdout.strip())
    if top.resolve() != tree.resolve():
        return f"not a git checkout (a folder inside the checkout at {top})"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + (" + uncommitted changes" if dirty else "")


def write_results(results: list[dict], trees: list[Path], hello: dict, out: Path, name: str, rounds: int,
                  choices: list[str], run: str | None = None, timing: str | None = "call",
                  layout: str | None = "bhnd") -> Path:
    """`table`'s rows as <out>/<name>.md and .csv (`benchmarks.harness.write_table`) under the run's header: the
    device, versions and date, the command, each tree with its commit, and each tree's kernel choices (`choices`,
    one a tree); with `run`, as that run of a table of several; `timing`: how the attention cells were timed
    (`TIMING_NOTES`) and `layout` their inputs' memory (None for step cells). Returns the Markdown path."""
    from benchmarks.harness import command_line, write_table

    env = {"device": hello["device"], "torch": hello["torch"], "triton": hello["triton"], "python": hello["python"],
           "date": datetime.date.today().isoformat(), "command": command_line()}
    env.update({f"tree {i}": f"{tree} ({tree_revision(tree)})" for i, tree in enumerate(trees)})
    env.update({f"tree {i}'s kernels": chosen for i, chosen in enumerate(choices)})
    timed = f" ({TIMING_NOTES[timing]})" if timing else ""
    if layout is not None:
        env["inputs"] = LAYOUT_NOTES[layout]
    notes = [(f"Medians of {rounds} interleaved rounds{timed} (the trees and the baseline in an order changed each "
              "round); ratios are each tree's median over tree 0's and over the baseline's; \"same bits\": whether "
              "every tree's digest of its first call's gradients (the output's, for the forward alone) agreed.")]
    return write_table([summary(r, len(trees)) for r in results], out, name, "A/B of source trees", notes, env,
                       run=run)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:  # started by Worker: TOKENS HEADS; it imports nothing of the driver's tree
        return worker(int(sys.argv[2]), int(sys.argv[3]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.harness import add_run_arg, at_least_one, check_run_table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", type=tree_path, nargs="+", help="two or more source trees; the first is the reference")
    ap.add_argument("--cells", type=cell_spec, nargs="+", default=[cell_spec("128:full:16384")])
    ap.add_argument("--rounds", type=at_least_one, default=5)
    ap.add_argument("--impl", default="flash-triton",
                    help="a backend of the trees' registry (default flash-triton), or flash-triton-nondet")
    ap.add_argument("--what", choices=["bwd", "fwd", "fwd_bwd", "step"], default="bwd")
    ap.add_argument("--timing", choices=sorted(TIMING_NOTES), default="call",
                    help="attention cells: call, do_bench of the eager call (default); gpu, the GPU work alone")
    ap.add_argument("--layout", choices=LAYOUTS, default="bhnd",
                    help="attention cells' inputs: dense (B, H, N, D) (default), or (B, N, H, D) memory viewed as "
                         "(B, H, N, D), FA4's layout and that of the FA4 sweep's tables")
    ap.add_argument("--steps", type=step_spec, nargs="+", default=[], metavar="PRESET:CONTEXT[:HEADS]",
                    help="--what step: the models whose training step is timed, e.g. small:2048 (small:2048:6: "
                         "with 6 heads, D 128)")
    ap.add_argument("--step-mode", choices=["eager", "compiled", "reduce-overhead"], default="compiled")
    ap.add_argument("--iters", type=at_least_one, default=5, help="--what step: steps a round")
    ap.add_argument("--warmup", type=int, default=3, help="--what step: untimed steps after the model is built")
    ap.add_argument("--batch", type=int, default=4, help="--what step: sequences a step")
    ap.add_argument("--baseline", action="store_true", help="also time sdpa-cudnn (GPU only)")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x N per cell")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the table as OUT/NAME.md and .csv, with device, versions, command and commits")
    ap.add_argument("--name", default="ab_trees", help="--out: the files' name (default ab_trees)")
    add_run_arg(ap)
    args = ap.parse_args()
    if not args.trees or len(args.trees) < 2:
        ap.error("--trees: give two or more source trees")
    for name in ("tokens", "heads", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: 1 or more")
    if args.warmup < 0:
        ap.error("--warmup: 0 or more")
    if not args.name or Path(args.name).name != args.name:
        ap.error(f"--name {args.name!r}: a file name without a folder (the folder is --out)")
    if (args.what == "step") != bool(args.steps):
        ap.error("--steps goes with --what step, and --what step needs --steps")
    if args.what == "step" and args.timing != "call":
        ap.error("--timing times attention cells; a step is timed as a training loop runs it")
    if args.what == "step" and args.layout != "bhnd":
        ap.error("--layout lays out attention cells' inputs; a step's model lays out its own")
    if args.what == "step" and args.impl == "flash-triton-nondet":
        ap.error("--impl flash-triton-nondet times attention cells only; a step's model takes a registry backend")
    if args.run is not None:
        if args.out is None:
            ap.error("--run names this run in --out's table: give --out")
        check_run_table(ap, args.out, args.name, args.run)
    cells = args.steps if args.what == "step" else args.cells
    step_options = dict(mode=args.step_mode, iters=args.iters, warmup=args.warmup, batch=args.batch)
    done = run(args.trees, cells, args.rounds, args.impl, args.what, args.baseline, args.tokens, args.heads,
               step_options, args.timing, args.layout)
    print(table(done.results, args.trees))
    if args.out is not None:
        path = write_results(done.results, args.trees, done.hello, args.out, args.name, args.rounds, done.choices,
                             args.run, *((None, None) if args.what == "step" else (args.timing, args.layout)))
        print(f"# wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
