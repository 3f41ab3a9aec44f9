"""Forwards of one cell under Nsight Compute, and the counters that say why one takes longer than another (GPU probe).

Why: a timing says which forward is slower, not why. Ours and FlashAttention-4's D 64 forwards execute the same
number of instructions, yet ours takes more cycles (docs/attention-kernels.md §7): the difference is in how many
instructions issue a cycle and in what the warps wait on, which only the hardware counters show. `run` calls each
implementation once (after warm-up calls, which compile it) between cudaProfilerStart and Stop, so that ncu started
with `--profile-from-start off` profiles exactly those calls; `summary` reads ncu's CSV pages back and prints, per
kernel, the counters that decided past changes and its warps' stall samples by reason and by instruction.

    ncu --clock-control none --profile-from-start off --set full -f -o fwd \\
        python scripts/ncu_forward.py run --cells 64:causal:16384 64:full:16384 \\
        --impls "pingpong 192x128 2buf" fa4 --labels labels.txt
    for page in details raw; do ncu --import fwd.ncu-rep --page $page --csv > $page.csv; done
    ncu --import fwd.ncu-rep --page source --csv --print-source sass > source.csv
    python scripts/ncu_forward.py summary --labels labels.txt --details details.csv --raw raw.csv --source source.csv

`--clock-control none` leaves the clocks as a benchmark finds them (ncu locks them to base by default). An
implementation is a forward of `scripts/forward_variants.py`'s cell (a Gluon variant's label, "tl forward",
"sdpa-cudnn", "fa4"), named by the start of its label. `summary` runs anywhere (it reads files); `run` needs the GPU.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # forward_variants, ab_trees, beside this script

from ab_trees import Cell, cell_spec  # the cells D:MASK:N, as ab_trees takes them

# The counters `summary` prints per kernel: (column, ncu section, ncu metric name).
DETAILS = (
    ("cycles", "GPU Speed Of Light Throughput", "Elapsed Cycles"),
    ("SM active cycles", "GPU Speed Of Light Throughput", "SM Active Cycles"),
    ("instructions", "Instruction Statistics", "Executed Instructions"),
    ("IPC", "Compute Workload Analysis", "Executed Ipc Active"),
    ("issue busy %", "Compute Workload Analysis", "Issue Slots Busy"),
    ("warps/scheduler", "Scheduler Statistics", "Active Warps Per Scheduler"),
    ("registers", "Launch Statistics", "Registers Per Thread"),
)
RAW = (
    ("tensor pipe %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("MUFU (xu) pipe %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA pipe %", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"),
    ("ALU pipe %", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"),
)
ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    """A counter's value as ncu writes it (thousands separated by commas); 0 for an empty cell."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def details_by_kernel(text: str) -> list[dict[str, str]]:
    """ncu's details page (CSV): one dict per profiled kernel, in launch order, with its name and DETAILS' values."""
    kernels: dict[str, dict[str, str]] = {}
    wanted = {(section, metric): column for column, section, metric in DETAILS}
    for row in csv.DictReader(io.StringIO(text)):
        kernel = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        column = wanted.get((row["Section Name"], row["Metric Name"]))
        if column:
            kernel[column] = row["Metric Value"]
    return [kernels[k] for k in sorted(kernels, key=int)]


def raw_by_kernel(text: str) -> list[dict[str, str]]:
    """ncu's raw page (CSV: a header, a units row, one row per kernel): RAW's values per kernel, in launch order."""
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return []
    index = {name: i for i, name in enumerate(rows[0])}
    return [{column: row[index[metric]] for column, metric in RAW if metric in index} for row in rows[2:]]


def source_sections(text: str) -> list[list[list[str]]]:
    """ncu's source page (`--print-source sass`): per kernel, its rows (a header row first, then one per SASS
    instruction)."""
    sections: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            sections.append([])
        elif sections and line:
            sections[-1].append(line)
    return [list(csv.reader(lines)) for lines in sections]


def stalls(section: list[list[str]], top: int = 12) -> tuple[dict[str, float], list[tuple[str, float, float]], float]:
    """(stall reason -> share of the kernel's samples, [(opcode, share of samples, warp instructions executed)] for
    the `top` opcodes, share of samples idle at a barrier). A warp that has finished its part (Triton's warp
    partitions, a producer warp at the end) waits at a CTA barrier in a NOP, which the sampler counts as a barrier
    stall though it takes no issue slot from the others: counted apart as idle."""
    header, rows = section[0], section[1:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    by_reason: collections.Counter = collections.Counter()
    by_opcode: collections.Counter = collections.Counter()
    executed: collections.Counter = collections.Counter()
    idle = 0.0
    for row in rows:
        words = [w for w in row[col["Source"]].split() if not w.startswith("@")]
        opcode = words[0].split(".")[0] if words else ""
        for reason in reasons:
            value = _number(row[col[reason]])
            if opcode == "NOP" and reason == "stall_barrier":
                idle += value
            else:
                by_reason[reason[len("stall_"):]] += value
        by_opcode[opcode] += _number(row[col[ALL_SAMPLES]])
        executed[opcode] += _number(row[col["Instructions Executed"]]) if "Instructions Executed" in col else 0.0
    total = sum(by_reason.values()) + idle
    if not total:
        return {}, [], 0.0
    shares = {reason: value / total for reason, value in by_reason.most_common()}
    opcodes = [(op, value / total, executed[op]) for op, value in by_opcode.most_common(top)]
    return shares, opcodes, idle / total


def summary(labels: list[str], details: str, raw: str, source: str | None, top: int = 12) -> str:
    """The comparison `summary` prints: a table of each kernel's counters, then its stall samples."""
    kernels = details_by_kernel(details)
    pipes = raw_by_kernel(raw)
    if len(labels) != len(kernels):
        print(f"ncu_forward summary: {len(labels)} labels for {len(kernels)} kernels (an implementation launched "
              "more or fewer than one kernel in its range): rows are named by kernel", file=sys.stderr)
        labels = [k["kernel"][:40] for k in kernels]
    columns = [c for c, _, _ in DETAILS] + [c for c, _ in RAW]
    out = ["| implementation | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for label, kernel, pipe in zip(labels, kernels, pipes + [{}] * (len(kernels) - len(pipes))):
        out.append(f"| {label} | " + " | ".join(kernel.get(c, pipe.get(c, "")) for c in columns) + " |")
    if source is not None:
        for label, section in zip(labels, source_sections(source)):
            shares, opcodes, idle = stalls(section, top)
            out.append(f"\n{label}: stall samples by reason (idle warps at a barrier {idle:.1%} apart)")
            out.append("  " + ", ".join(f"{r} {s:.1%}" for r, s in shares.items() if s >= 0.005))
            out.append("  by opcode (share of samples, warp instructions executed): "
                       + ", ".join(f"{op} {s:.1%} {n / 1e6:.1f}M" for op, s, n in opcodes))
    return "\n".join(out)


def run(cells: list[Cell], impls: list[str], labels_path: Path | None, heads: int, tokens: int) -> int:
    import forward_variants
    import torch

    if not torch.cuda.is_available():
        print("ncu_forward run: needs a CUDA GPU", file=sys.stderr)
        return 2
    labels = []
    for d, causal, n in cells:
        cell = f"{d}:{'causal' if causal else 'full'}:{n}"
        calls = forward_variants._cell(d, causal, n, max(1, tokens // n), heads, heads)
        chosen = {name: call for name, call in calls.items()
                  if any(name.startswith(impl) for impl in impls) and "(trial)" not in name}
        missing = [impl for impl in impls if not any(name.startswith(impl) for name in chosen)]
        if missing:
            print(f"ncu_forward run: {cell}: no implementation named {missing} (have {sorted(calls)})",
                  file=sys.stderr)
            return 2
        for call in chosen.values():
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        for name, call in chosen.items():
            torch.cuda.profiler.start()
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            labels.append(f"{cell} {name}")
            print(f"profiled {labels[-1]}", flush=True)
    if labels_path is not None:
        labels_path.write_text("\n".join(labels) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="call each implementation once inside the profiler's range (under ncu)")
    r.add_argument("--cells", type=cell_spec, nargs="+", default=[cell_spec("64:causal:16384")],
                   help="D:MASK:N, e.g. 64:causal:16384")
    r.add_argument("--impls", nargs="+", required=True,
                   help="the start of each implementation's label: a Gluon variant's, 'tl forward', 'sdpa-cudnn', "
                        "'fa4'")
    r.add_argument("--labels", type=Path, default=None, help="write each profiled call's label here, in order")
    r.add_argument("--heads", type=int, default=16)
    r.add_argument("--tokens", type=int, default=16384, help="batch = tokens // N")
    s = sub.add_parser("summary", help="print the counters of ncu's CSV pages, kernel by kernel")
    s.add_argument("--labels", type=Path, required=True, help="the labels `run` wrote")
    s.add_argument("--details", type=Path, required=True, help="ncu --page details --csv")
    s.add_argument("--raw", type=Path, required=True, help="ncu --page raw --csv")
    s.add_argument("--source", type=Path, default=None, help="ncu --page source --csv --print-source sass")
    s.add_argument("--top", type=int, default=12, help="opcodes listed per kernel")
    args = p.parse_args(argv)
    if args.command == "run":
        for name in ("heads", "tokens"):
            if getattr(args, name) < 1:
                r.error(f"argument --{name}: 1 or more")
        return run(args.cells, args.impls, args.labels, args.heads, args.tokens)
    for name in ("labels", "details", "raw", "source"):
        path = getattr(args, name)
        if path is not None and not path.is_file():
            s.error(f"argument --{name}: {path} is not a file")
    labels = [line for line in args.labels.read_text().splitlines() if line.strip()]
    print(summary(labels, args.details.read_text(), args.raw.read_text(),
                  None if args.source is None else args.source.read_text(), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
