"""TransformerLM end to end: training-step time, its forward/backward/optimizer parts, and peak memory, per
preset, context, attention backend and mode (eager, compiled, compiled with CUDA graphs).

Batch 4, vocab 10,000. Warm-up steps are kept out of the numbers (`--warmup 0` shows what that does).
`step_ms` is the median of `--iters` whole steps run back to back (no sync inside a step: what training sees;
with `--rounds R`, the median of R such rounds, the attention implementations of a cell interleaved); `host_ms`,
measured on the same steps, is the host's time to issue one: where it comes close to `step_ms` the step waits on
the host (Python, launches), and the attention kernels' speed hardly shows in it;
the forward/backward/optimizer columns are mean ± std of separately synchronised phases, and `total_ms` is their
sum. `vs_sdpa` is step_ms over the SDPA model's step_ms in the same cell (same preset, context, mode).
`--dtype bf16` runs under `torch.autocast(bfloat16)`; `--modes` runs each model eagerly (`eager`), under
torch.compile's default mode (`compiled`) and/or with mode="reduce-overhead" (`reduce-overhead`: the compiled graphs
replayed from CUDA graphs, no per-kernel launch on the host; peak memory is not measured there, as the graphs' memory
pool is allocated when they are recorded); `--attention` lists the attention implementations to compare inside the
model.

    python -m benchmarks.end_to_end --presets small medium --contexts 512 2048 --dtype bf16 \
        --attention flash sdpa --modes eager compiled
    python -m benchmarks.end_to_end --presets small --contexts 512 2048 8192 --dtype bf16 --attention flash sdpa \
        --modes compiled --rounds 3 --iters 5     # the compiled step, flash against SDPA, interleaved
    python -m benchmarks.end_to_end --presets medium --contexts 512 --dtype bf16 --attention flash sdpa \
        --modes compiled reduce-overhead --rounds 3     # where a compiled step waits on the host
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import (
    DEVICE, ON_GPU, add_common_args, add_run_arg, at_least_one, check_run_table, environment, memory_snapshot, nvtx,
    peak_memory, progress, pyplot, run_cell, save_plot, sync, token_batch, write_table,
)
from flashsys.nn import PRESETS, TransformerLM, preset
from flashsys.ops.attention import ATTENTION_BACKENDS
from flashsys.timing import round_order, summarize, time_call

# --modes: how the model runs, and the torch.compile mode of each compiled one.
MODES = {"eager": None, "compiled": "default", "reduce-overhead": "reduce-overhead"}


class Model:
    """One row of the table: a model (preset, context, attention, mode: one of MODES) built, warmed up and its phases
    timed, then its whole steps timed in rounds (`time_steps`), and its peak memory measured last (`result`)."""

    def __init__(self, preset_name: str, context: int, attention: str, mode: str, args,
                 device: torch.device = DEVICE):
        self.device, self.iters, self.warmup, self.mode = device, args.iters, args.warmup, mode
        cfg = preset(preset_name, vocab_size=10_000, context_length=context, attention_backend=attention)
        model = TransformerLM.from_config(cfg, device=self.device)
        self.model = model if MODES[mode] is None else torch.compile(model, mode=MODES[mode])
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.x = token_batch(cfg, args.batch, self.device)
        self.y = token_batch(cfg, args.batch, self.device)
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if args.dtype == "bf16"
                         else contextlib.nullcontext)
        self.rounds: list[float] = []  # each round's median step
        self.host_rounds: list[float] = []  # each round's median host time to issue a step
        self.phases = self._time_phases(args.nvtx)

    def _loss(self, logits):
        return F.cross_entropy(logits.float().view(-1, 10_000), self.y.view(-1))

    def _time_phases(self, with_nvtx: bool):
        fwd, bwd, step = [], [], []
        for i in range(self.warmup + self.iters):
            with nvtx(f"step {i}", with_nvtx):
                with nvtx("forward", with_nvtx), self.autocast():
                    logits, t_f = time_call(lambda: self.model(self.x), self.device)
                loss = self._loss(logits)
                with nvtx("backward", with_nvtx):
                    _, t_b = time_call(loss.backward, self.device)
                with nvtx("optimizer", with_nvtx):
                    _, t_s = time_call(self.opt.step, self.device)
                self.opt.zero_grad(set_to_none=True)
            if i >= self.warmup:
                fwd.append(t_f), bwd.append(t_b), step.append(t_s)
        return summarize(fwd), summarize(bwd), summarize(step)

    def train_step(self) -> None:
        """One whole step: forward (under autocast for bf16), loss, backward, optimizer step, zero_grad."""
        with self.autocast():
            logits = self.model(self.x)
        self._loss(logits).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def time_steps(self) -> None:
        """One round: `iters` whole steps back to back, each timed, and the host's time to issue each (until the
        step's last launch returns); the round's medians are kept."""
        steps, host = [], []

        def issue():
            start = time.perf_counter()
            self.train_step()
            host.append((time.perf_counter() - start) * 1e3)

        for _ in range(self.iters):
            steps.append(time_call(issue, self.device)[1])
        self.rounds.append(summarize(steps).median)
        self.host_rounds.append(summarize(host).median)

    def result(self) -> dict:
        """The row's numbers: step_ms the median of the rounds' medians, the phases, and peak memory (None where
        CUDA graphs replay the steps: their memory pool was allocated when they were recorded)."""
        mem_fwd = mem_step = {"peak_mb": None}
        if self.mode != "reduce-overhead":
            # A compiled model's first call without grad compiles another graph: run it once outside the measurement.
            with torch.no_grad(), self.autocast():
                self.model(self.x)
            with peak_memory() as mem_fwd, torch.no_grad(), self.autocast():
                self.model(self.x)
            with peak_memory() as mem_step:
                self.train_step()
        sync()
        f, b, s = self.phases
        return {"step_ms": statistics.median(self.rounds), "host_ms": statistics.median(self.host_rounds),
                "forward_ms": str(f), "backward_ms": str(b),
                "optimizer_ms": str(s), "total_ms": f.mean + b.mean + s.mean, "peak_fwd_MB": mem_fwd["peak_mb"],
                "peak_step_MB": mem_step["peak_mb"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "end_to_end")
    gpu_presets = ["small", "medium", "large", "xl", "2.7B"]
    p.add_argument("--presets", nargs="+", default=gpu_presets if ON_GPU else ["tiny"], choices=list(PRESETS))
    p.add_argument("--contexts", nargs="+", type=int, default=[128, 256, 512, 1024] if ON_GPU else [64, 128])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager"],
                   help="run the model eagerly, under torch.compile, and/or compiled with CUDA graphs "
                        "(mode='reduce-overhead')")
    p.add_argument("--rounds", type=at_least_one, default=1,
                   help="rounds of --iters whole steps per model, the attention implementations of a cell "
                        "interleaved; step_ms is the median of the rounds' medians")
    p.add_argument("--attention", nargs="+", choices=list(ATTENTION_BACKENDS), default=["flash"],
                   help="attention backends inside the model (the registry of flashsys.ops.attention)")
    add_run_arg(p)
    args = p.parse_args(argv)
    modes = "" if args.modes == ["eager"] else "_" + "-".join(args.modes)
    name = f"end_to_end_{'gpu' if ON_GPU else 'cpu'}_{args.dtype}_{'-'.join(args.attention)}{modes}_w{args.warmup}"
    check_run_table(p, args.out, name, args.run)
    env = environment()
    rows = []

    def write(done: int) -> Path:
        """The table so far: rewritten after every group of cells, so a run cut short (a time limit) keeps what it
        measured, marked partial until the last group."""
        sdpa = {(r["preset"], r["context"], r["mode"]): r.get("step_ms") for r in rows if r["attention"] == "sdpa"}
        for r in rows:
            base = sdpa.get((r["preset"], r["context"], r["mode"]))
            r["vs_sdpa"] = r["step_ms"] / base if base and "step_ms" in r else None
        return write_table(rows, args.out, name, "TransformerLM end to end",
                           [f"batch {args.batch}, vocab 10,000, AdamW; step_ms: median of {args.iters} whole steps"
                            + (f", the median over {args.rounds} rounds, the attention implementations of a cell "
                               "interleaved in an order changed each round" if args.rounds > 1 else "")
                            + "; host_ms: the host's time to issue a step, on the same steps (where it comes close "
                            "to step_ms, the step waits on the host); "
                            f"phases: mean ± std over {args.iters} steps after {args.warmup} warm-up steps; "
                            "peak memory is the extra allocated during a forward (no grad) and during a full "
                            "training step."]
                           + ([] if done == len(groups) else
                              [f"**Partial: {done} of {len(groups)} (preset, context, mode) groups** (the run "
                               "stopped, or is still running, before the rest)."]), env, run=args.run)

    # The attention implementations of one (preset, context, mode) are built side by side and timed in interleaved
    # rounds, so that clock drift over the run falls on all of them alike.
    groups = [(pr, c, m) for pr in args.presets for c in args.contexts for m in args.modes]
    with memory_snapshot(args.memory_snapshot):
        for done, (preset_name, ctx, mode) in enumerate(progress(groups, "end_to_end", args.no_progress), 1):
            models, group_rows = {}, []
            for attention in args.attention:
                row = {"preset": preset_name, "context": ctx, "dtype": args.dtype, "attention": attention,
                       "mode": mode, "warmup": args.warmup}
                built = run_cell(lambda: {"model": Model(preset_name, ctx, attention, mode, args)})
                if "model" in built:
                    models[attention] = built["model"]
                else:
                    row.update(built)
                group_rows.append(row)
            for round_index in range(args.rounds):
                for attention in round_order(list(models), round_index):
                    model = models[attention]
                    failed = run_cell(lambda: model.time_steps() or {})
                    if failed:
                        next(r for r in group_rows if r["attention"] == attention).update(failed)
                        del models[attention]
            for row in group_rows:
                if row["attention"] in models:
                    row.update(run_cell(models[row["attention"]].result))
            rows.extend(group_rows)
            path = write(done)
            del models
            torch._dynamo.reset()  # each model compiles its own graphs; drop the last group's graphs and guards
            if ON_GPU:
                torch.cuda.empty_cache()
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for preset_name, mode, attention in [(pr, m, a) for pr in args.presets for m in args.modes for a in args.attention]:
        pts = [(r["context"], r["step_ms"]) for r in rows if (r["preset"], r["attention"]) == (preset_name, attention)
               and r["mode"] == mode and "step_ms" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{preset_name} {attention} {mode}")
    ax.set_xlabel("context length")
    ax.set_ylabel("train step (ms)")
    ax.set_yscale("log")
    ax.legend()
    save_plot(fig, args.out, name)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
