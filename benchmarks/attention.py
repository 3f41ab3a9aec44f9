"""Attention implementations side by side: forward, backward and forward+backward time, TFLOP/s, peak memory.

Implementations: naive PyTorch attention (eager and torch.compile), FlashAttention2Torch, FlashAttention2Triton,
and PyTorch SDPA with the flash and cuDNN backends. The sweep: head dims x sequence lengths x dtypes x causal.
On a CPU the default is a reduced sweep of the implementations that run there.

    python -m benchmarks.attention                       # default sweep for this machine
    python -m benchmarks.attention --head-dims 64 128 --seq-lens 1024 4096 16384 --dtypes bf16 --causal both
    python -m benchmarks.attention ... --rounds 3        # each cell's implementations in 3 interleaved rounds
    python -m benchmarks.attention --impls flash-triton sdpa-cudnn fa4 --layout bnhd --name attention_gpu_fa4 ...
        # beside FlashAttention-4 (flash-attn-4, optional: its rows say "not installed" without it), on its layout;
        # fa4-det is FA4 with its deterministic backward, flash-triton-nondet flashsys without one

Batch size: by default on a GPU every cell processes the same number of tokens, batch = tokens // N
(--tokens 16384, the convention of the FlashAttention papers), so short sequences are measured at a size
where the GPU has work. `--batch B` fixes the batch instead; at batch 1 and N <= 4096 an eager Triton
op's host-side cost (Python autograd plus three kernel launches per forward+backward) can be larger than
its kernel time, and the table then measures the host as much as the GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.harness import (
    ON_GPU, add_common_args, add_run_arg, at_least_one, bench_ms, check_run_table, environment, peak_memory, progress,
    pyplot, run_cell, save_plot, write_table,
)
from flashsys.ops.attention import ATTENTION_BACKENDS
from flashsys.timing import round_order

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Not a registry backend: flash-triton measured with determinism off (`set_deterministic_backward(False)`), so that a
# Hopper backward may take the one-pass kernel, whose dQ sums run in no fixed order (as SDPA's backends' do).
NONDETERMINISTIC = "flash-triton-nondet"


def _backend(name: str):
    return ATTENTION_BACKENDS["flash-triton" if name == NONDETERMINISTIC else name]


def implementation(name: str):
    """The registry's backend `name` (or flash-triton for NONDETERMINISTIC) as fn(q, k, v, causal)."""
    if name == "naive-compiled":
        # The backward-only timing replays one graph (retain_graph=True); a compiled backward that donates
        # its saved buffers refuses that, so donation is switched off for this benchmark.
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    backend = _backend(name)
    return lambda q, k, v, causal: backend(q, k, v, causal)


def measure_impl(name: str, fn, *cell, layout: str = "bhnd") -> dict:
    """`measure(fn, *cell)`, with determinism off for NONDETERMINISTIC's cells only."""
    if name != NONDETERMINISTIC:
        return measure(fn, *cell, layout=layout)
    from flashsys.ops.attention import set_deterministic_backward

    set_deterministic_backward(False)
    try:
        return measure(fn, *cell, layout=layout)
    finally:
        set_deterministic_backward(True)


def plot_rows(rows: list[dict], out, tag: str) -> None:
    """One figure per (dtype, causal): forward+backward time against sequence length, a panel per head dim.
    Takes the table's rows (benchmarks/results/attention/*.csv read back gives the same figures)."""
    plt = pyplot()
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    head_dims = sorted({r["head_dim"] for r in rows})
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        for c in dict.fromkeys(r["causal"] for r in rows):
            fig, axes = plt.subplots(1, len(head_dims), figsize=(4.5 * len(head_dims), 3.6), squeeze=False)
            for ax, d in zip(axes[0], head_dims):
                for name in impls:
                    pts = [(r["seq_len"], r["fwd_bwd_ms"]) for r in rows if r["impl"] == name and r["dtype"] == dt
                           and r["causal"] == c and r["head_dim"] == d and "fwd_bwd_ms" in r]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=name)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"D={d}, {dt}, {'causal' if c else 'full'}")
                ax.set_xlabel("sequence length")
                ax.set_ylabel("forward+backward (ms)")
            axes[0][0].legend(fontsize=7)
            save_plot(fig, out, f"attention_{tag}_{dt}_{'causal' if c else 'full'}")
            plt.close(fig)


def add_vs_best_sdpa(cell_rows: list[dict]) -> None:
    """`vs_best_sdpa` for one cell's rows: fwd_bwd time over the faster SDPA backend's in the same cell; where
    FlashAttention-4 ran in the cell, `fwd_vs_fa4` and `fwd_bwd_vs_fa4` too (each time over FA4's), and where its
    deterministic backward did (`fa4-det`, the like-for-like anchor of flashsys's default backward),
    `fwd_bwd_vs_fa4_det` (its forward is FA4's, so no forward ratio of its own)."""
    base = [r["fwd_bwd_ms"] for r in cell_rows if r["impl"].startswith("sdpa") and "fwd_bwd_ms" in r]
    fa4, fa4_det = (next((r for r in cell_rows if r["impl"] == name and "fwd_bwd_ms" in r), None)
                    for name in ("fa4", "fa4-det"))
    for r in cell_rows:
        if "fwd_bwd_ms" not in r:
            continue
        if base:
            r["vs_best_sdpa"] = r["fwd_bwd_ms"] / min(base)
        if fa4 is not None:
            r["fwd_vs_fa4"] = r["fwd_ms"] / fa4["fwd_ms"]
            r["fwd_bwd_vs_fa4"] = r["fwd_bwd_ms"] / fa4["fwd_bwd_ms"]
        if fa4_det is not None:
            r["fwd_bwd_vs_fa4_det"] = r["fwd_bwd_ms"] / fa4_det["fwd_bwd_ms"]


def attention_flops(b, h, n, d, causal):
    fwd = 4 * b * h * n * n * d / (2 if causal else 1)
    return fwd, 2.5 * fwd


# A forward + backward timed at more than this times its own forward plus its backward timed alone was disturbed
# (another process, a clock dip): interference only adds time, and one such round moves the median of two rounds.
DISTURBED = 1.10


def time_within(fn, rep: int, bound_ms: float, tries: int = 3) -> tuple[float, int]:
    """fn's time (ms, `bench_ms`) and how many times it was timed again: up to `tries` timings, stopping at the first
    within bound_ms, the lowest kept."""
    best = bench_ms(fn, rep)
    retimed = 0
    while best > bound_ms and retimed < tries - 1:
        retimed += 1
        best = min(best, bench_ms(fn, rep))
    return best, retimed


def measure(fn, b, h, n, d, dtype, causal, rep, layout="bhnd"):
    """One round of a cell: forward, backward and forward + backward times (ms), peak memory, and how many times the
    forward + backward was timed again for reading past `DISTURBED` × the forward plus the backward; TFLOP/s comes
    from the rounds' median (`median_of_rounds`). q, k, v, dO are (B, H, N, D) either way; with layout "bnhd" they
    are views of (B, N, H, D) memory, as a model's projections give them."""
    device = "cuda" if ON_GPU else "cpu"

    def tensor(requires_grad=False):
        shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
        t = torch.randn(*shape, device=device, dtype=dtype, requires_grad=requires_grad)
        return t, (t if layout == "bhnd" else t.transpose(1, 2))

    (q_leaf, q), (k_leaf, k), (v_leaf, v) = (tensor(True) for _ in range(3))
    do = tensor()[1]

    def clear_grads():
        q_leaf.grad = k_leaf.grad = v_leaf.grad = None

    fn(q, k, v, causal).backward(do)  # first call autotunes/compiles: keep its scratch memory out of the peak
    clear_grads()
    with peak_memory() as mem:
        out = fn(q, k, v, causal)
        out.backward(do)
    del out
    fwd_ms = bench_ms(lambda: fn(q, k, v, causal), rep)
    out = fn(q, k, v, causal)

    def backward_alone():  # one graph's backward again, its gradients written afresh as in fwd_bwd, not added up
        clear_grads()
        out.backward(do, retain_graph=True)

    bwd_ms = bench_ms(backward_alone, rep)

    def fwd_bwd():
        clear_grads()
        fn(q, k, v, causal).backward(do)

    both_ms, retimed = time_within(fwd_bwd, rep, DISTURBED * (fwd_ms + bwd_ms))
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_bwd_ms": both_ms, "peak_mem_MB": mem["peak_mb"],
            "retimed": retimed}


def median_of_rounds(runs: list[dict], flops: tuple[float, float]) -> dict:
    """One cell's `measure` results over interleaved rounds as one: each time the median of its rounds (TFLOP/s from
    the median forward + backward), peak memory from the first round; a round that failed makes the cell's error."""
    for run in runs:
        if "error" in run:
            return run
    out = {key: statistics.median(run[key] for run in runs) for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms")}
    out["fwd_bwd_TFLOPs"] = sum(flops) / out["fwd_bwd_ms"] / 1e9
    out["peak_mem_MB"] = runs[0]["peak_mem_MB"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "attention")
    gpu_default = ["naive", "naive-compiled", "flash-torch", "flash-triton", "sdpa-flash", "sdpa-cudnn"]
    p.add_argument("--impls", nargs="+", choices=[*ATTENTION_BACKENDS, NONDETERMINISTIC],
                   default=gpu_default if ON_GPU else ["naive", "flash-torch", "sdpa-math"])
    p.add_argument("--head-dims", nargs="+", type=int, default=[16, 32, 64, 128] if ON_GPU else [32, 64])
    p.add_argument("--seq-lens", nargs="+", type=int,
                   default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536] if ON_GPU else [128, 256, 512])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"] if ON_GPU else ["fp32"])
    p.add_argument("--causal", choices=["yes", "no", "both"], default="yes")
    p.add_argument("--batch", type=int, default=None, help="fixed batch size (default: from --tokens on GPU, 1 on CPU)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="on GPU without --batch: batch = max(1, tokens // seq_len) for every cell")
    p.add_argument("--heads", type=int, default=16 if ON_GPU else 4)
    p.add_argument("--rep", type=int, default=100, help="do_bench rep in ms per measurement")
    p.add_argument("--rounds", type=at_least_one, default=1,
                   help="rounds per cell, the implementations interleaved in each; a time is the median over them "
                        "(a GPU's clocks drift over a sweep, and a fixed order would favour whichever goes first)")
    p.add_argument("--layout", choices=["bhnd", "bnhd"], default="bhnd",
                   help="the inputs' memory: dense (B, H, N, D), or (B, N, H, D) as a model's projections lay it out "
                        "(FlashAttention-4's own layout: use it where fa4 is compared)")
    p.add_argument("--name", default=None, help="the table's file name (default attention_gpu or attention_cpu)")
    p.add_argument("--max-naive-len", type=int, default=16384, help="skip naive above this length (N^2 memory)")
    p.add_argument("--max-flash-torch-len", type=int, default=4096,
                   help="skip flash-torch above this length (its Python loop over tiles takes minutes there)")
    add_run_arg(p)
    args = p.parse_args(argv)
    impls = {name: implementation(name) for name in args.impls}
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    cells = [(d, n, dt, c) for dt in args.dtypes for c in causals for d in args.head_dims for n in args.seq_lens]
    tag = "gpu" if ON_GPU else "cpu"
    rounds_note = (f", then the median of {args.rounds} rounds, the implementations interleaved in an order changed "
                   "each round (a Williams design, `flashsys.timing.round_order`)" if args.rounds > 1
                   else "")
    notes = [f"heads {args.heads}; batch "
             + (f"{args.batch}" if args.batch else f"max(1, {args.tokens} // seq_len)" if ON_GPU else "1")
             + f"; times are medians (do_bench on CUDA){rounds_note}; "
             "bwd_ms: one retained graph's backward, its gradients written afresh (not accumulated); "
             "TFLOP/s counts 4·B·H·N²·D per forward (halved when causal) and 2.5× that for backward; "
             "vs_best_sdpa = fwd_bwd time over the faster SDPA backend's (below 1 is faster)"
             + ("; fwd_vs_fa4, fwd_bwd_vs_fa4: the same over FlashAttention-4's" if "fa4" in impls else "")
             + ("; fwd_bwd_vs_fa4_det: over FlashAttention-4's with its deterministic backward (fa4-det; flashsys's "
                "default backward is deterministic, flash-triton-nondet's and fa4's are not)" if "fa4-det" in impls
                else "")
             + "; inputs " + ("dense (B, H, N, D)." if args.layout == "bhnd" else
                              "(B, H, N, D) views of (B, N, H, D) memory, as a model's projections give them.")]
    table_name = args.name or f"attention_{tag}"
    check_run_table(p, args.out, table_name, args.run)
    rows, retimed = [], []
    for done, (d, n, dt, c) in enumerate(progress(cells, "attention", args.no_progress), 1):
        batch = args.batch or (max(1, args.tokens // n) if ON_GPU else 1)
        cell_rows, timed = [], {}
        for name in impls:
            row = {"impl": name, "dtype": dt, "causal": c, "head_dim": d, "seq_len": n, "batch": batch}
            if name.startswith("naive") and n > args.max_naive_len:
                row["error"] = f"skipped (N > {args.max_naive_len})"
            elif name == "flash-torch" and n > args.max_flash_torch_len:
                row["error"] = f"skipped (N > {args.max_flash_torch_len})"
            elif (why := _backend(name).unavailable_reason("cuda" if ON_GPU else "cpu")) is not None:
                row["error"] = f"unsupported ({why.split(',')[0]})"
            else:
                timed[name] = []
            cell_rows.append(row)
        for r in range(args.rounds):
            for name in round_order(list(timed), r):
                runs = timed[name]
                if not runs or "error" not in runs[-1]:
                    runs.append(run_cell(lambda: measure_impl(name, impls[name], batch, args.heads, n, d,
                                                              DTYPES[dt], c, args.rep, layout=args.layout)))
        for row in cell_rows:
            if row["impl"] in timed:
                row.update(median_of_rounds(timed[row["impl"]], attention_flops(batch, args.heads, n, d, c)))
                if times := sum(run.get("retimed", 0) for run in timed[row["impl"]]):
                    retimed.append(f"{row['impl']} {dt} D {d} N {n} {'causal' if c else 'full'} ({times}×)")
        add_vs_best_sdpa(cell_rows)
        rows.extend(cell_rows)
        # Written after every cell: a sweep stopped midway (a timeout kills it) keeps the cells it finished.
        partial = [] if done == len(cells) else [f"**Partial: {done} of {len(cells)} cells** (the run stopped, or is "
                                                 "still running, before the rest)."]
        disturbed = [f"Forward + backward timed again where a round read past {DISTURBED}× its own forward plus "
                     "backward timed alone (a disturbed round; the lowest timing kept): " + "; ".join(retimed) + "."
                     ] if retimed else []
        path = write_table(rows, args.out, table_name, "Attention implementations", notes + disturbed + partial,
                           environment(), run=args.run)
    plot_rows(rows, args.out, table_name.removeprefix("attention_"))
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
