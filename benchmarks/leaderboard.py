"""FlashAttention leaderboard timing: exactly the course leaderboard's test, beside PyTorch SDPA.

    q, k, v = torch.randn(3, 16, 16384, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True).unbind(0)
    flash = torch.compile(FlashAttention2Triton.apply)
    step: flash(q, k, v, True).sum().backward()   timed by triton.testing.do_bench(rep=10000, warmup=1000)

The same step runs through SDPA's flash and cuDNN backends on 4-D views of the same data, through FlashAttention-4
where flash-attn-4 is installed (its default backward and its deterministic one; rows say so where it is not), and
once more through flashsys with determinism off (`set_deterministic_backward(False)`: the one-pass backward where it
is faster, dQ's sums in no fixed order, as in SDPA's backends and FA4's default); every variant's gradients are
compared before anything is timed. Writes a Markdown table and a CSV with device, versions, command and date
(default: benchmarks/results/leaderboard.md and .csv).

    python -m benchmarks.leaderboard
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, environment, write_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rep", type=int, default=10000, help="do_bench rep in ms (leaderboard: 10000)")
    ap.add_argument("--warmup", type=int, default=1000, help="do_bench warmup in ms (leaderboard: 1000)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    ap.add_argument("--name", default="leaderboard", help="file name (without .md/.csv) of the table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.leaderboard times CUDA kernels; no CUDA device here. See benchmarks.attention for a CPU run.")
        return 0

    import triton

    from flashsys.ops.attention import ATTENTION_BACKENDS, FlashAttention2Triton, dispatch, set_deterministic_backward
    from flashsys.ops.attention.triton import launch

    torch.manual_seed(0)
    q, k, v = torch.randn(3, args.heads, args.seq, args.head_dim, dtype=torch.bfloat16, device="cuda",
                          requires_grad=True).unbind(0)
    flash = torch.compile(FlashAttention2Triton.apply)

    def flash_step(deterministic=True):
        def step():
            set_deterministic_backward(deterministic)  # a no-op unless it changes
            flash(q, k, v, True).sum().backward()
        return step

    def sdpa_step(name):
        sdpa = ATTENTION_BACKENDS[name]

        def step():
            sdpa(q[None], k[None], v[None], True).sum().backward()
        return step

    variants = [
        ("flashsys FlashAttention2Triton (torch.compile)", flash_step()),
        ("PyTorch SDPA, flash backend", sdpa_step("sdpa-flash")),
        ("PyTorch SDPA, cuDNN backend", sdpa_step("sdpa-cudnn")),
        ("flashsys, set_deterministic_backward(False) (torch.compile)", flash_step(False)),
    ]
    why_not_fa4 = ATTENTION_BACKENDS["fa4"].unavailable_reason("cuda")
    # flashsys's first row is bit-deterministic; FA4's like-for-like is its own deterministic backward
    fa4_variants = (("FlashAttention-4 (flash-attn-4)", "fa4"), ("FlashAttention-4, deterministic backward", "fa4-det"))
    if why_not_fa4 is None:
        variants += [(name, sdpa_step(backend)) for name, backend in fa4_variants]
    base = q._base  # the (3, H, N, D) leaf that q, k, v are views of

    # Correctness first: every variant's gradient against SDPA-flash's, on the same data.
    grads = {}
    for name, step in variants:
        base.grad = None
        try:
            step()
            torch.cuda.synchronize()
            grads[name] = base.grad.float().clone()
        except Exception as exc:  # an unsupported backend is recorded, not fatal
            grads[name] = exc
            print(f"{name} failed:\n{exc}", file=sys.stderr)
    ref = grads[variants[1][0]]
    rows = []
    flops = 4 * args.heads * args.seq**2 * args.head_dim / 2 * 3.5  # causal fwd, bwd = 2.5 x fwd
    for name, step in variants:
        g = grads[name]
        if isinstance(g, Exception):
            rows.append({"implementation": name, "error": f"failed: {type(g).__name__}: {str(g).splitlines()[0][:80]}"})
            continue
        err = ((g - ref).norm() / ref.norm()).item() if isinstance(ref, torch.Tensor) else float("nan")
        # Exactly the leaderboard's call, so do_bench's default statistic: the mean over all repetitions.
        ms = triton.testing.do_bench(step, rep=args.rep, warmup=args.warmup)
        rows.append({"implementation": name, "time_ms": ms, "TFLOP/s": flops / ms / 1e9,
                     "grad_rel_err_vs_sdpa_flash": f"{err:.2e}"})
        print(f"{name}: {ms:.3f} ms", flush=True)
    if why_not_fa4 is not None:
        rows += [{"implementation": name, "error": why_not_fa4} for name, _ in fa4_variants]
    ours = rows[0].get("time_ms", float("nan"))
    for r in rows:
        if "time_ms" in r:
            r["vs_flashsys"] = f"{r['time_ms'] / ours:.2f}×"

    notes = [f"Shape: batch·heads {args.heads}, seq {args.seq}, head_dim {args.head_dim}, bf16, causal, forward + "
             f"backward; do_bench(rep={args.rep}, warmup={args.warmup}), its default statistic (the mean).", "",
             "Autotuned configs (eager launches):"]
    for kernel, label in (("fwd", "fwd"), ("dkdv", "bwd dK/dV"), ("dq", "bwd dQ")):
        found = [cfg for key, cfg in launch.chosen_configs().items()
                 if key.kernel == kernel and key.head_dim == args.head_dim and key.dtype == torch.bfloat16]
        notes.append(f"- {label}: " + (", ".join(f"{k}={v}" for k, v in found[-1].items()) if found else
                                       "no eager launch (the compiled call autotuned over the same configs in Inductor)"))
    for kernel, label in (("forward", "fwd"), ("dkdv", "bwd dK/dV"), ("dq", "bwd dQ"),
                          ("one_pass_det", "bwd, one pass or two"), ("one_pass", "bwd, determinism off")):
        gluon = [f"{key.label(v)} (N <= {key.bucket})" for key, v in dispatch.chosen_variants().items()
                 if key.kernel == kernel and key.head_dim == args.head_dim and key.dtype == torch.bfloat16
                 and key.bound_right]
        if gluon:  # the compiled graph ran the Gluon op, whose choice this is (a Gluon kernel or the `tl` one)
            notes.append(f"- {label} (Gluon op's choice, what ran): {', '.join(gluon)}")
    set_deterministic_backward(True)
    path = write_table(rows, args.out, args.name, "FlashAttention leaderboard timing", notes, environment())
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
