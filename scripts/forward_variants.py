"""Every Gluon forward variant of a head dim timed on the same tensors, beside the `tl` forward, SDPA's cuDNN kernel and
FlashAttention-4 where it is installed (GPU probe).

Why: a forward variant earns its place in `dispatch.FORWARD_VARIANTS` by being the fastest in some cell, and a new
kernel idea is judged against the best of them and against FA4 in the same process (docs/attention-kernels.md §4, §8).
The timed choice picks one variant per shape class and hides the others; this shows them all, and the variants on
trial (`dispatch.FORWARD_TRIALS`, labelled "(trial)"), which no choice takes until a run like this one shows them
fastest somewhere.

    python scripts/forward_variants.py                          # D 64 and 128, causal and full, N 1024/4096/16384
    python scripts/forward_variants.py --head-dims 64 --seq-lens 2048 --batch 4 --causal yes
    python scripts/forward_variants.py --head-dims 64 --seq-lens 4096 --batch 2 --heads 32 --kv-heads 4   # a 1.1B Llama

Each cell: bf16, --heads query heads over --kv-heads K/V heads (grouped-query attention; --heads by default), batch
--tokens // N (or --batch), q, k, v in (B, N, H, D) memory viewed as (B, H, N, D), as a model's projections hand them
over (`--layouts bnhd`, FA4's own layout), or dense (B, H, N, D) (`bhnd`); with both, every implementation runs on
both in the same rounds (the same values), each row named with its layout, so a kernel that reads one layout slower
than the other shows beside FA4 and cuDNN on both. Every implementation is timed in --rounds interleaved rounds, and
the median of the rounds' medians is printed with its ratio to cuDNN's and to FA4's, and the largest difference of its
output from cuDNN's (a variant that computes something else shows here before its time means anything). cuDNN and FA4
get inputs that require grad, as in training and as `benchmarks.attention` times them: so they write the logsumexp
that every flashsys variant writes (without grad, FA4 compiles a forward that writes none).

`--timing gpu` (the default) times each implementation's GPU work alone, the L2 flushed before each run
(`timed_choice.gpu_ms`, what the dispatch's timed choice measures): each run waits behind a spin kernel longer than
its host side, so a call whose Python path outlasts its kernels (the `tl` forward through the launcher, SDPA's
dispatch, FA4's) is timed by its kernels, as inside a compiled model or a CUDA graph. `--timing call` times the eager
call with `do_bench` instead, host path included: at cells of a tenth of a millisecond that is mostly the host.
`--timing warm` times the GPU work of back-to-back calls with their inputs left in the L2 cache
(`harness.warm_l2_ms`), as a model's attention finds q, k and v just written by its projection; the timed choice
flushes the L2, so the two show whether that ranks the variants differently.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's flashsys, benchmarks

from ab_trees import in_layout  # beside this script: the inputs' memory as the A/B lays it out

from benchmarks.harness import TIMERS, add_probe_args, environment_variable, kv_heads_of
from flashsys.ops.attention import ATTENTION_BACKENDS
from flashsys.timing import round_order

LAYOUTS = ("bnhd", "bhnd")  # --layouts: (B, N, H, D) memory viewed as (B, H, N, D); dense (B, H, N, D)


def _cell(d: int, causal: bool, n: int, batch: int, heads: int, kv_heads: int,
          layouts: tuple[str, ...] = ("bnhd",)) -> dict[str, Callable[[], torch.Tensor]]:
    """The implementations of one cell, each a call that returns its output as (B, H, N, D); with several layouts,
    each implementation once per layout on the same values, its name followed by the layout's."""
    g = torch.Generator(device="cuda").manual_seed(n + d)
    values = [torch.randn(batch, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
              for h in (heads, kv_heads, kv_heads)]
    calls = {}
    for layout in layouts:
        qkv = [in_layout(t.transpose(1, 2), layout).detach().requires_grad_() for t in values]
        suffix = f" [{layout}]" if len(layouts) > 1 else ""
        calls |= {name + suffix: call for name, call in _layout_calls(d, causal, *qkv).items()}
    return calls


def _layout_calls(d: int, causal: bool, q_grad: torch.Tensor, k_grad: torch.Tensor, v_grad: torch.Tensor
                  ) -> dict[str, Callable[[], torch.Tensor]]:
    """`_cell`'s calls on one layout's q, k, v ((B, H, N, D) views that require grad: the baselines' inputs)."""
    from flashsys.ops.attention import dispatch, launcher
    from flashsys.ops.attention.gluon import launch as gluon_launch

    batch, heads, n, _ = q_grad.shape
    q, k, v = (t.detach() for t in (q_grad, k_grad, v_grad))  # the same memory, for the kernels launched directly
    window, scale = ((-1, 0) if causal else (-1, -1)), d ** -0.5
    o = torch.empty(batch, heads, n, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)

    def variant_call(variant):
        def call():
            gluon_launch.launch(variant, gluon_launch.ForwardTensors(q, k, v, o, lse), window, scale, record=False)
            return o
        return call

    def tl_forward():
        with environment_variable(dispatch.ENV, "0"):  # the dispatch reads the switch at every call
            return launcher.forward(q, k, v, window, scale)[0]

    calls = {variant.label(): variant_call(variant) for variant in dispatch.FORWARD_VARIANTS.get(d, ())}
    calls |= {f"{variant.label()} (trial)": variant_call(variant) for variant in dispatch.FORWARD_TRIALS.get(d, ())}
    calls["tl forward"] = tl_forward
    for name in ("sdpa-cudnn", "fa4"):
        backend = ATTENTION_BACKENDS[name]
        if backend.unavailable_reason(q.device) is None:
            calls[name] = lambda backend=backend: backend(q_grad, k_grad, v_grad, causal, scale).detach()
        else:
            print(f"  {name}: {backend.unavailable_reason(q.device)}")
    return calls


def _time_cell(calls: dict[str, Callable[[], torch.Tensor]], rounds: int, rep_ms: int, timing: str = "gpu"
               ) -> list[tuple]:
    """(name, median ms, max |output - cuDNN's|) of each call that runs, timed by TIMERS[timing]; those that raise
    are reported and dropped."""
    cudnn = next((name for name in calls if name.split(" [")[0] == "sdpa-cudnn"), None)
    reference = calls[cudnn]().float() if cudnn is not None else None
    errors = {}
    for name, call in list(calls.items()):
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  a variant that does not run here is named, not fatal
            print(f"  {name}: failed, {type(exc).__name__}: {str(exc)[:200]}")
            del calls[name]
            continue
        errors[name] = float("nan") if reference is None else (out.float() - reference).abs().max().item()
    times = {name: [] for name in calls}
    for r in range(rounds):
        for name in round_order(list(calls), r):
            times[name].append(TIMERS[timing](calls[name], rep_ms))
    return [(name, statistics.median(times[name]), errors[name]) for name in calls]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // N, unless --batch")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--timing", choices=list(TIMERS), default="gpu",
                   help="gpu: GPU work alone, L2 flushed (default); warm: GPU work alone, inputs left in L2; "
                        "call: do_bench of the eager call, host included")
    p.add_argument("--layouts", choices=LAYOUTS, nargs="+", default=["bnhd"],
                   help="the inputs' memory: bnhd, (B, N, H, D) viewed as (B, H, N, D) (default); bhnd, dense "
                        "(B, H, N, D); both: every implementation on each, in the same rounds")
    add_probe_args(p, heads=16)
    args = p.parse_args(argv)
    kv_heads = kv_heads_of(p, args)
    if not torch.cuda.is_available():
        print("forward_variants: needs a CUDA GPU (the Gluon variants need an sm_90 one)", file=sys.stderr)
        return 2
    masks = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    for d in args.head_dims:
        for causal in masks:
            for n in args.seq_lens:
                batch = args.batch or max(1, args.tokens // n)
                print(f"\nD {d} {'causal' if causal else 'full'} N {n}, batch {batch}, {args.heads} query / "
                      f"{kv_heads} K/V heads, --timing {args.timing}")
                layouts = tuple(dict.fromkeys(args.layouts))
                rows = _time_cell(_cell(d, causal, n, batch, args.heads, kv_heads, layouts), args.rounds,
                                  args.rep, args.timing)
                ms = {name: t for name, t, _ in rows}
                print("| implementation | ms | × cuDNN | × FA4 | max abs diff from cuDNN |\n"
                      "|---|---:|---:|---:|---:|")
                for name, t, err in rows:
                    suffix = name[len(name.split(" [")[0]):]  # each row against the baselines on its own layout
                    vs = [f"{t / ms[base + suffix]:.3f}" if base + suffix in ms else "—"
                          for base in ("sdpa-cudnn", "fa4")]
                    print(f"| {name} | {t:.4f} | {vs[0]} | {vs[1]} | {err:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
