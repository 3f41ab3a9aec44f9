"""Every tile of the `tl` kernels (forward, dQ, dK/dV) timed at one shape, beside cuDNN's forward and backward, each
checked against float64 math (GPU probe; on a CPU it runs under Triton's interpreter, where its times say nothing).

Why: below the Gluon kernels' size bar (`dispatch.min_work`; 2^34 at D 64 under a causal mask) the `tl` kernels run
every attention call, in a compiled model too (Inductor re-emits them), so at a model's shape (the small preset at
context 2048: batch 4, 12 heads, D 64, causal) the step's attention is as fast as the best `tl` tile there. The
autotuner and Inductor pick among `triton/configs.py`'s candidates; this shows every candidate's time, the eager
autotuner's pick, and any tile given with --extra, so that a table change is decided by one run at the shape it is
for.

    python scripts/tl_tiles.py                                            # small preset, context 2048
    python scripts/tl_tiles.py --heads 16                                 # medium preset, context 2048
    python scripts/tl_tiles.py --tiles all --extra fwd:128,64,4,2 dq:64,64,4,4
    python scripts/tl_tiles.py --out benchmarks/results/attention         # and write its table there
    python scripts/tl_tiles.py --seq-len 8192 --batch 1 --mask window:1024
    python scripts/tl_tiles.py --l2 warm                                  # inputs left in L2, as in a model
    python scripts/tl_tiles.py --l2 both                                  # both timings in the same rounds

The tensors are laid out as a model's projections hand them over: (B, N, H, D) memory viewed as (B, H, N, D), and dO
likewise. `--l2 warm` times each call with its inputs left in the L2 cache (back-to-back calls; in a model the kernel
before attention has just written q, k and v) instead of flushing it first; `--l2 both` times each both ways in the
same rounds, a column each and their ratio. Each tile is launched directly (the kernel the autotuner wraps, that
tile's meta-parameters, the grid `launch.run` gives it), with the same arguments every launch of the call gets
(`launch.recording()`). Each row: the median of --rounds interleaved timings, its ratio to the kernel's fastest tile,
and the largest error of what it wrote (O and L; dQ; dK and dV) against float64 math, beside cuDNN's own error, and
what it compiled to (registers a thread, spills, shared memory). A tile that does not run (out of shared memory, say)
is named and dropped.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the `tl` kernels run on a CPU only under the interpreter, set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's flashsys, benchmarks

from benchmarks.harness import (  # noqa: E402
    add_probe_args, bench_ms, environment_variable, kv_heads_of, warm_l2_ms, write_table)
from flashsys.ops.attention import ATTENTION_BACKENDS, dispatch, launcher  # noqa: E402
from flashsys.ops.attention.reference import attention_reference  # noqa: E402
from flashsys.ops.attention.triton import launch  # noqa: E402
from flashsys.ops.attention.triton.configs import Tile, every_tile, tiles_for  # noqa: E402
from flashsys.timing import round_order  # noqa: E402

KERNELS = ("fwd", "dq", "dkdv")
# What each kernel writes, checked after its tile ran: the forward's O and L, dQ's dQ, dK/dV's dK and dV.
WRITES = {"fwd": ("o", "lse"), "dq": ("dq",), "dkdv": ("dk", "dv")}
WARM_CALLS = 10  # back-to-back calls a timing with --l2 warm (harness.warm_l2_ms)
# --l2's choices and what each adds to the --out file's name: the timings never overwrite one another's table.
L2_SUFFIX = {"flushed": "", "warm": "_warm_l2", "both": "_flushed_and_warm_l2"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_tile(text: str) -> tuple[str, Tile]:
    """`kernel:BLOCK_M,BLOCK_N,warps,stages` (kernel one of KERNELS) as (kernel, tile)."""
    kernel, _, numbers = text.partition(":")
    fields = numbers.split(",")
    if kernel not in KERNELS or len(fields) != 4 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise argparse.ArgumentTypeError(f"{text!r}: want KERNEL:BLOCK_M,BLOCK_N,WARPS,STAGES with KERNEL one of "
                                         f"{KERNELS} and four positive whole numbers")
    m, n, w, s = (int(f) for f in fields)
    return kernel, (m, n, w, s)


def parse_mask(text: str) -> tuple[int, int]:
    """causal, full or window:LEFT (a causal sliding window) as a (left, right) window, -1 unbounded."""
    if text in ("causal", "full"):
        return (-1, 0) if text == "causal" else (-1, -1)
    kind, _, left = text.partition(":")
    if kind != "window" or not left.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: want causal, full or window:LEFT (LEFT a whole number)")
    return int(left), 0


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| (NaN if got has a NaN); equal infinities (L of a row that sees no key) count as equal."""
    got = got.double()
    return torch.where(torch.isinf(want) & (got == want), 0.0, (got - want).abs()).max().item()


def _largest(errors: list[float]) -> float:
    """The largest error, NaN if any is (Python's max would skip a NaN after a number)."""
    return max(errors) if not any(e != e for e in errors) else float("nan")


def _resources(compiled: object) -> str:
    """Registers a thread, spills and shared memory of a compiled kernel ("—" under the interpreter)."""
    regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
    metadata = getattr(compiled, "metadata", None)
    if regs is None or metadata is None:
        return "—"
    return f"{regs} / {spills} / {getattr(metadata, 'shared', 0) // 1024} KiB"


class Cell:
    """One shape's tensors, the launches a `tl` forward and backward of it make, and its float64 reference."""

    def __init__(self, batch: int, heads: int, kv_heads: int, n: int, d: int, dtype: torch.dtype,
                 window: tuple[int, int], device: torch.device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)

        def projected(h: int) -> torch.Tensor:  # (B, N, H, D) memory viewed as (B, H, N, D)
            return torch.randn(batch, n, h, d, generator=gen, dtype=dtype, device=device).transpose(1, 2)

        self.q, self.k, self.v, self.do = projected(heads), projected(kv_heads), projected(kv_heads), projected(heads)
        self.window, self.scale = window, d ** -0.5
        with launch.recording() as recorded:  # nothing runs: every launch is prepared with its arguments and grid
            o, lse, _ = launcher.forward(self.q, self.k, self.v, window, self.scale, traced=True)
            dq, dk, dv, _ = launcher.backward(self.q, self.k, self.v, o, lse, launcher.dense_do(self.do, dtype),
                                              window, self.scale, traced=True)
        self.launches = {r.kernel: r for r in recorded}
        if set(self.launches) != set(KERNELS):
            raise SystemExit(f"tl_tiles: this shape launches {sorted(self.launches)}, not the `tl` forward and "
                             "backward (a few queries against a long cache take the decode kernels)")
        self.outputs = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
        self.geometry = launch.geometry_of(self.q.shape, self.k.shape, dtype)
        self.reference = self._reference()
        self.resources: dict[tuple[str, Tile], str] = {}  # what each tile compiled to, where it compiled
        # Run the call once, each kernel with its first candidate, so that every buffer a later kernel reads (O, L,
        # the (-L log2 e, D) pairs) holds this call's values before any tile is timed alone.
        for kernel in KERNELS:
            self.launch(kernel, self.tiles(kernel, every=False)[0])()

    def _reference(self) -> dict[str, torch.Tensor]:
        q, k, v = (x.detach().double().requires_grad_() for x in (self.q, self.k, self.v))
        o, lse = attention_reference(q, k, v, softmax_scale=self.scale, window_size=self.window)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), self.do.double())
        return dict(o=o.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)

    def tiles(self, kernel: str, every: bool) -> list[Tile]:
        """The candidates the autotuner times for this shape's handle, or (`every`) every tile in the kernel's
        tables for this head-dim class and dtype."""
        g = self.geometry
        if not every or g.fp32:
            return tiles_for(kernel, g.head_dim_class, g.fp32, g.long_seq)
        return every_tile(kernel, g.head_dim_class)

    def launch(self, kernel: str, tile: Tile) -> Callable[[], object]:
        """A call that launches `kernel` with `tile`'s meta-parameters over the grid `launch.run` gives it (and
        returns the compiled kernel on a GPU)."""
        recorded = self.launches[kernel]
        handle, args, constexprs, _ = recorded.prepared
        m, n, warps, stages = tile
        meta = dict(BLOCK_M=m, BLOCK_N=n)
        grid = recorded.grid(meta)
        fn = handle.fn  # the kernel under the autotuner
        return lambda: fn[grid](*args, **constexprs, **meta, num_warps=warps, num_stages=stages)

    def checked(self, kernel: str, tile: Tile) -> float:
        """Run `kernel` with `tile` once on outputs filled with NaN and return its error (`error`): a tile that
        leaves anything unwritten reads as NaN, not as the values an earlier tile wrote. A tile that raises leaves
        the outputs as they were (later kernels read the forward's)."""
        saved = {name: self.outputs[name].clone() for name in WRITES[kernel]}
        for name in WRITES[kernel]:
            self.outputs[name].fill_(float("nan"))
        try:
            compiled = self.launch(kernel, tile)()
            if self.q.is_cuda:
                torch.cuda.synchronize()
        except BaseException:
            for name, values in saved.items():
                self.outputs[name].copy_(values)
            raise
        self.resources[kernel, tile] = _resources(compiled)
        return self.error(kernel)

    def error(self, kernel: str) -> float:
        """The largest |written - float64| over what `kernel` writes (L's rows that see no key compare as equal)."""
        return _largest([_max_error(self.outputs[name], self.reference[name]) for name in WRITES[kernel]])


def cudnn_calls(cell: Cell) -> tuple[dict[str, Callable[[], object]], dict[str, float]] | str:
    """cuDNN's forward and its backward (a retained graph's) on the cell's tensors, and cuDNN's errors against the
    same float64 reference as the tiles' ({kernel: error}); or why it does not run here."""
    backend = ATTENTION_BACKENDS["sdpa-cudnn"]
    reason = backend.unavailable_reason(cell.q.device)
    if reason is not None:
        return reason
    q, k, v = (x.detach().requires_grad_() for x in (cell.q, cell.k, cell.v))
    window = None if cell.window == (-1, 0) else cell.window
    causal = cell.window == (-1, 0)
    try:
        out = backend(q, k, v, causal, cell.scale, window)
        grads = torch.autograd.grad(out, (q, k, v), cell.do, retain_graph=True)
    except Exception as exc:  # noqa: BLE001  the probe still times the tiles
        return f"failed, {type(exc).__name__}: {str(exc)[:200]}"
    ref = cell.reference
    errors = {"fwd": _max_error(out, ref["o"]), "dq": _max_error(grads[0], ref["dq"]),
              "dkdv": _largest([_max_error(g, ref[name]) for g, name in zip(grads[1:], ("dk", "dv"))])}
    calls = {"fwd": lambda: backend(q, k, v, causal, cell.scale, window),
             "bwd": lambda: torch.autograd.grad(out, (q, k, v), cell.do, retain_graph=True)}
    return calls, errors


def autotuner_picks(cell: Cell) -> dict[str, Tile]:
    """The tile Triton's autotuner picks for each kernel in an eager call of this shape (Inductor times the same
    candidates in a compiled graph, on its own)."""
    launch.forget_configs()
    with environment_variable(dispatch.ENV, "0"):  # the `tl` kernels where the Gluon ones would run
        o, lse, _ = launcher.forward(cell.q, cell.k, cell.v, cell.window, cell.scale)
        launcher.backward(cell.q, cell.k, cell.v, o, lse, launcher.dense_do(cell.do, cell.q.dtype), cell.window,
                          cell.scale)
    return {key.kernel: (m["BLOCK_M"], m["BLOCK_N"], m["num_warps"], m["num_stages"])
            for key, m in launch.chosen_configs().items()}


def label(tile: Tile) -> str:
    m, n, warps, stages = tile
    return f"{m}x{n}, {warps} warps, {stages} stages"


def tile_rows(kernels: list[str], ms: dict[tuple[str, Tile], float], errors: dict[tuple[str, Tile], float],
              cudnn_errors: dict[str, float], picks: dict[str, Tile], resources: dict[tuple[str, Tile], str],
              warm_ms: dict[tuple[str, Tile], float] | None = None) -> list[dict]:
    """One row per timed tile, each kernel's fastest first (by `ms`): what the printed tables and the --out file
    show. With `warm_ms` (`--l2 both`; `ms` is then the flushed timing) each row also has its warm time and the
    ratio of the two, from the same rounds."""
    rows = []
    for kernel in kernels:
        timed = sorted((t, tile) for (k, tile), t in ms.items() if k == kernel)
        for t, tile in timed:
            err = errors[kernel, tile]
            row = {"kernel": kernel, "tile": label(tile), "autotuner_pick": picks.get(kernel) == tile,
                   "ms": f"{t:.4f}", "x_fastest": f"{t / timed[0][0]:.3f}"}
            if warm_ms is not None:
                row.update(warm_ms=f"{warm_ms[kernel, tile]:.4f}", warm_x_flushed=f"{warm_ms[kernel, tile] / t:.3f}")
            row.update(max_error_vs_fp64=f"{err:.3g}",
                       x_cudnn_error=f"{err / cudnn_errors[kernel]:.2f}" if cudnn_errors.get(kernel) else "—",
                       registers_spills_shared=resources[kernel, tile])
            rows.append(row)
    return rows


def cudnn_summary(ms: dict[tuple[str, Tile], float], cudnn_ms: dict[str, float], timing: str = "") -> list[str]:
    """The fastest forward, and the fastest dQ plus the fastest dK/dV, against cuDNN's (where both were timed);
    each line led by `timing` (which timing it is, where a run has two)."""
    fastest: dict[str, float] = {}
    for (kernel, _), t in ms.items():
        fastest[kernel] = min(t, fastest.get(kernel, t))
    lines = []
    if "fwd" in cudnn_ms and "fwd" in fastest:
        lines.append(f"{timing}forward: fastest tile {fastest['fwd']:.4f} ms, cuDNN {cudnn_ms['fwd']:.4f} ms: "
                     f"{fastest['fwd'] / cudnn_ms['fwd']:.3f}x cuDNN")
    if "bwd" in cudnn_ms and "dq" in fastest and "dkdv" in fastest:
        both = fastest["dq"] + fastest["dkdv"]
        lines.append(f"{timing}backward: fastest dQ + fastest dK/dV {both:.4f} ms, cuDNN {cudnn_ms['bwd']:.4f} ms "
                     f"(a retained graph's backward): {both / cudnn_ms['bwd']:.3f}x cuDNN")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    add_probe_args(p, heads=12)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mask", type=parse_mask, default=(-1, 0), help="causal (default), full or window:LEFT")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kernels", choices=KERNELS, nargs="+", default=list(KERNELS))
    p.add_argument("--tiles", choices=["table", "all"], default="table",
                   help="table: the candidates this shape's autotuned handle times; all: every tile of the "
                        "head-dim class's tables (the long-sequence ones too)")
    p.add_argument("--extra", type=parse_tile, nargs="+", default=[], metavar="KERNEL:M,N,WARPS,STAGES",
                   help="tiles to time beside the tables' (a kernel's BLOCK_M, BLOCK_N, num_warps, num_stages)")
    p.add_argument("--l2", choices=sorted(L2_SUFFIX), default="flushed",
                   help="flushed: the L2 cache emptied before each call (do_bench); warm: back-to-back calls, the "
                        "inputs left in L2 as a model's previous kernel leaves them; both: the two in the same "
                        "interleaved rounds, each row with both times and their ratio")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="also write the table with device, versions and command: DIR/tl_tiles_{gpu,cpu}.md and .csv")
    args = p.parse_args(argv)
    kv_heads = kv_heads_of(p, args)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        p.error(f"argument --out: {args.out} is a file, not a directory")
    for name in ("batch", "heads", "seq_len", "head_dim"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be 1 or more")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.dtype == "bf16":  # flashsys's ops upcast it there (`calls.interpreter_upcast`)
        p.error("argument --dtype: Triton's interpreter computes bf16 wrongly; on a CPU take fp16 or fp32")
    cell = Cell(args.batch, args.heads, kv_heads, args.seq_len, args.head_dim, DTYPES[args.dtype], args.mask, device)
    if device.type == "cpu":
        print("tl_tiles: no GPU; the kernels run under Triton's interpreter and the times say nothing")
    shape = (f"batch {args.batch}, {args.heads} query / {kv_heads} K/V heads, N {args.seq_len}, D {args.head_dim}, "
             f"{args.dtype}, window {args.mask} (-1 unbounded)")
    print(shape)
    picks = autotuner_picks(cell)
    cudnn = cudnn_calls(cell)
    if isinstance(cudnn, str):
        print(f"sdpa-cudnn: {cudnn}")

    calls: dict[tuple[str, Tile], Callable[[], None]] = {}
    errors: dict[tuple[str, Tile], float] = {}
    extra = [(kernel, tile) for kernel, tile in args.extra if kernel in args.kernels]
    for kernel, tile in [(k, t) for k in args.kernels for t in cell.tiles(k, args.tiles == "all")] + extra:
        if (kernel, tile) in calls:
            continue
        try:
            errors[kernel, tile] = cell.checked(kernel, tile)
        except Exception as exc:  # noqa: BLE001  a tile that does not compile or launch is named, not fatal
            print(f"{kernel} {label(tile)}: failed, {type(exc).__name__}: {str(exc)[:200]}")
            continue
        calls[kernel, tile] = cell.launch(kernel, tile)
    baselines, cudnn_errors = ({}, {}) if isinstance(cudnn, str) else cudnn
    timed = [*calls.items(), *((("cudnn", name), call) for name, call in baselines.items())]
    timers = {"flushed": bench_ms, "warm": functools.partial(warm_l2_ms, calls=WARM_CALLS)}
    both = args.l2 == "both"
    modes = ["flushed", "warm"] if both else [args.l2]
    times: dict[str, dict[tuple, list[float]]] = {mode: {key: [] for key, _ in timed} for mode in modes}
    for r in range(args.rounds):
        for key, call in round_order(timed, r):
            for mode in modes:
                times[mode][key].append(timers[mode](call, rep_ms=args.rep))
    ms = {mode: {key: statistics.median(t) for key, t in by_key.items()} for mode, by_key in times.items()}

    tile_ms = {mode: {key: ms[mode][key] for key in calls} for mode in modes}
    rows = tile_rows(args.kernels, tile_ms[modes[0]], errors, cudnn_errors, picks, cell.resources,
                     warm_ms=tile_ms["warm"] if both else None)
    for kernel in args.kernels:
        mine = [row for row in rows if row["kernel"] == kernel]
        if not mine:
            continue
        warm_head, warm_rule = (" warm ms | warm / flushed |", "---:|---:|") if both else ("", "")
        print(f"\n| {kernel} tile (BLOCK_M x BLOCK_N) | ms | x fastest |{warm_head} max error vs float64 | "
              f"x cuDNN's error | registers / spills / shared |\n|---|---:|---:|{warm_rule}---:|---:|---:|")
        for row in mine:
            mark = " (autotuner's pick)" if row["autotuner_pick"] else ""
            warm = f" {row['warm_ms']} | {row['warm_x_flushed']} |" if both else ""
            print(f"| {row['tile']}{mark} | {row['ms']} | {row['x_fastest']} |{warm} {row['max_error_vs_fp64']} | "
                  f"{row['x_cudnn_error']} | {row['registers_spills_shared']} |")
    summary = [line for mode in modes
               for line in cudnn_summary(tile_ms[mode], {name: ms[mode]["cudnn", name] for name in baselines},
                                         timing=f"{mode}: " if both else "")]
    print("\n" + "\n".join(summary))
    if args.out is not None:
        flushed = "`do_bench` medians (L2 flushed before each call)"
        warm = f"medians of {WARM_CALLS} back-to-back calls between CUDA events (inputs left in L2)"
        timed_by = ("interpreted runs (they say nothing of a GPU)" if device.type != "cuda"
                    else f"{flushed}; warm_ms: the same of {warm}, timed in the same rounds" if both
                    else flushed if args.l2 == "flushed" else warm)
        timing = (f"ms: the median of {args.rounds} interleaved {timed_by}; "
                  "errors: the largest |written - float64| of what the kernel writes, and its ratio to cuDNN's")
        name = f"tl_tiles_{'gpu' if device.type == 'cuda' else 'cpu'}{L2_SUFFIX[args.l2]}"
        path = write_table(rows, args.out, name, "Every `tl` tile at one shape beside cuDNN",
                           notes=[f"- shape: {shape}; (B, N, H, D) memory viewed as (B, H, N, D)", f"- {timing}",
                                  *(f"- {line}" for line in summary)])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
