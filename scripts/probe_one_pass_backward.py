"""The one-pass backward on a GPU (#16): FlashAttention-3's layout in Gluon (a producer warp, two consumer warpgroups of
64 key rows at 240 registers, dQ's share added by a TMA reduce-add), `flash_gluon.ONE_PASS_VARIANTS` and the
deterministic `DETERMINISTIC_ONE_PASS_VARIANTS` (the adds into each query tile in a fixed order).

1. Correct: on the masked cases of the Gluon tests (GQA, Nq != Nk with rows that see no key, windows, ragged tiles,
   (B, N, H, D) strides, rank 3, fp16 and bf16), dQ, dK and dV against float64 reference math, beside the two-pass
   backward's error on the same inputs.
2. Fast? Whole backwards in interleaved do_bench rounds (median ms): SDPA's cuDNN backward, the library's two-pass
   backward (its choices), and each one-pass variant with its prologue (the (-L·log2 e, D) pairs, dQ's float32 sum
   (the deterministic kind: its rows that see no key) and the semaphores zeroed) and epilogue (dQ scaled and cast),
   both small `tl` kernels. Each one pass runs twice first: is dQ the same bits both times?

    python scripts/probe_one_pass_backward.py --head-dims 64 128 --seqs 4096 16384
    python scripts/probe_one_pass_backward.py --against /tmp/old_gluon_kernels.py --skip-check  # A/B, interleaved
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import at_least_one  # noqa: E402
from scripts.probe_gluon_variants import _load_kernels, _with_kernels, kernels_file  # noqa: E402


def variant_spec(spec: str):
    """argparse type of a one-pass variant written KIND,BLOCK_M,BLOCK_N,NBUF,REGS[,STAGES[,ALTERNATE]]
    (`flash_gluon.Variant`), e.g. one_pass_det,128,128,2,240 or one_pass,128,128,2,240,2,1."""
    from flashsys.ops.attention import flash_gluon

    kind, *numbers = spec.split(",")
    if (kind not in ("one_pass", "one_pass_det") or len(numbers) not in (4, 5, 6)
            or not all(x.isdigit() for x in numbers)):
        raise argparse.ArgumentTypeError(f"{spec!r}: want KIND,BLOCK_M,BLOCK_N,NBUF,REGS[,STAGES[,ALTERNATE]] with "
                                         "KIND one_pass or one_pass_det and whole numbers, e.g. "
                                         "one_pass_det,128,128,2,240")
    if len(numbers) == 6 and numbers[5] not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"{spec!r}: ALTERNATE is 0 (each consumer computes half of dQ) or 1 (they "
                                         "take turns at the whole tile's)")
    return flash_gluon.Variant(kind, *(int(x) for x in numbers))


class OnePass:
    """The library's one-pass backward (prologue, Gluon kernel, and the epilogue unless the kernel folds dQ:
    `flash_gluon.folds_dq`) with one variant, on rank-4 tensors."""

    def __init__(self, variant, q, k, v, o, lse, do, window, scale):
        from flashsys.ops.attention import flash_triton

        self.run_one = lambda: flash_triton._one_pass_backward(variant, q, k, v, o, lse, do, self.dq, self.dk,
                                                               self.dv, self.pairs, window, scale)
        self.dq, self.dk, self.dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        self.pairs = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)

    def __call__(self):
        self.run_one()
        return self.dq, self.dk, self.dv


def check(variants_by_d, head_dims, case_indices) -> int:
    """Each variant against float64 on the Gluon tests' masked cases; the two-pass error beside it."""
    from tests.ops.attention_checks import rel_err, run_reference
    from tests.ops.test_gluon_backward import _tl_backward_case
    from tests.ops.test_gluon_forward import CASES

    failures = 0
    for d in head_dims:
        for case in [CASES[i] for i in case_indices]:
            batch, heads, kv_heads, n_q, n_k, window, layout, dtype = case
            (q, k, v, do, o, lse), grads2, pairs = _tl_backward_case(case, d, 1, 2)
            scale = d ** -0.5
            _, _, *ref = run_reference(q, k, v, do, False, scale, torch.float64, window)
            err2 = [rel_err(gr, r) for gr, r in zip(grads2, ref)]
            for var in variants_by_d[d]:
                label = f"D {d} {n_q}x{n_k} heads {heads}/{kv_heads} window {window} {layout} {str(dtype)[6:]} " \
                        f"{var.label()}"
                try:
                    fb = OnePass(var, q, k, v, o, lse, do, window, scale)
                    dq, dk, dv = fb()
                    torch.cuda.synchronize()
                    err = [rel_err(gr, r) for gr, r in zip((dq, dk, dv), ref)]
                    bad = any(e > max(2 * e2, 1e-3) for e, e2 in zip(err, err2))
                    failures += bad
                    pairs_err = (fb.pairs - pairs).abs().max().item()
                    print(f"{'FAIL' if bad else 'ok  '} {label}: rel err dQ/dK/dV {err[0]:.2e} {err[1]:.2e} "
                          f"{err[2]:.2e} (two passes {err2[0]:.2e} {err2[1]:.2e} {err2[2]:.2e}); prologue's pairs "
                          f"vs the dQ kernel's {pairs_err:.1e}", flush=True)
                except Exception:  # noqa: BLE001
                    failures += 1
                    print(f"FAIL {label}: {traceback.format_exc()[-1500:]}", flush=True)
    return failures


def same_bits_on_rerun(run, out: torch.Tensor) -> bool:
    """Run once more: does `out`, which the run writes, keep its bits? (The deterministic kinds' promise.)"""
    first = out.clone()
    run()
    torch.cuda.synchronize()
    return torch.equal(first, out)


def interleaved_times(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Each run's do_bench time (ms) in each of `rounds` rounds, the runs taking turns within a round (the pool's
    clocks drift)."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, fn in runs.items():
            times.setdefault(label, []).append(triton.testing.do_bench(fn))
    return times


def print_times(times: dict[str, list[float]], flops: float) -> None:
    """One row per run: its median ms, TFLOP/s, its ratio to SDPA's cuDNN backward's median, and every round."""
    base = statistics.median(times["SDPA cuDNN backward"])
    for label, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {label:<60} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {ms / base:5.2f}x cuDNN"
              f"  (rounds {', '.join(f'{t:.3f}' for t in ts)})", flush=True)


def bench(variants_by_d, head_dims, seqs, rounds, against=None) -> None:
    """against: another gluon_kernels module, whose one passes are timed beside these (`probe_gluon_variants`)."""
    from flashsys.ops.attention import flash_gluon, set_deterministic_backward
    from scripts.probe_gluon_backward import BackwardCell

    for d in head_dims:
        for n in seqs:
            for causal in (True, False):
                cell = BackwardCell(d, n, causal)
                q, k, v, do, o, lse, window, scale = (cell.q, cell.k, cell.v, cell.do, cell.o, cell.lse, cell.window,
                                                      cell.scale)

                def two_pass():
                    cell.backward(True, one_pass=True)

                flash_gluon._chosen.clear()
                det_key = flash_gluon.ChoiceKey.of(q, k, window, "one_pass_det")
                flash_gluon._chosen[det_key] = flash_gluon.TL_KERNEL
                two_pass()  # the two passes' choices, timed here
                dq_two, dk_two = cell.dq.clone(), cell.dk.clone()
                two_passes_only = flash_gluon.chosen_variants()
                del flash_gluon._chosen[det_key]
                two_pass()  # the default's one-pass choice too
                set_deterministic_backward(False)
                two_pass()  # and with determinism off
                set_deterministic_backward(True)
                choice = flash_gluon.chosen_variants()

                def library(deterministic, chosen):
                    def run():
                        set_deterministic_backward(deterministic)
                        flash_gluon._chosen.clear()
                        flash_gluon._chosen.update(chosen)
                        two_pass()
                    return run

                torch.cuda.synchronize()
                runs = {"SDPA cuDNN backward": cell.cudnn_backward,
                        "flashsys, two passes": library(True, two_passes_only),
                        "flashsys, default (its choice)": library(True, choice),
                        "flashsys, set_deterministic_backward(False)": library(False, choice)}
                for var in variants_by_d[d]:
                    fb = OnePass(var, q, k, v, o, lse, do, window, scale)
                    try:
                        fb()
                        torch.cuda.synchronize()
                        rel = ((fb.dq.float() - dq_two.float()).norm() / dq_two.float().norm()).item()
                        relk = ((fb.dk.float() - dk_two.float()).norm() / dk_two.float().norm()).item()
                        same = same_bits_on_rerun(fb, fb.dq)
                        print(f"  D={d} N={n} causal={causal} {var.label()}: vs two passes dQ {rel:.1e} dK {relk:.1e};"
                              f" dQ bitwise equal on a rerun: {same}", flush=True)
                    except Exception:  # noqa: BLE001
                        print(f"  {var.label()} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
                        continue
                    runs[f"one pass {var.label()} (+ prologue, epilogue)"] = fb
                    if against is not None:
                        runs[f"one pass {var.label()} (--against)"] = functools.partial(_with_kernels, against, fb)
                times = interleaved_times(runs, rounds)
                picked = [f"{key.kernel}: {key.label(var)}" for key, var in choice.items()]
                print(f"\nD={d} N={n} B={cell.b} causal={causal}; the library's choices {picked}")
                print_times(times, cell.flops)
                set_deterministic_backward(True)
                runs.clear()
                torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=at_least_one, default=3)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--cases", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5], help="which of the Gluon tests' "
                    "masked cases to check")
    ap.add_argument("--nbuf", type=int, nargs="+", default=None, help="only these buffer counts")
    ap.add_argument("--kinds", nargs="+", default=["one_pass", "one_pass_det"], choices=["one_pass", "one_pass_det"],
                    help="which one passes: the non-deterministic one, the deterministic one")
    ap.add_argument("--extra", nargs="+", default=[], type=variant_spec,
                    metavar="KIND,BLOCK_M,BLOCK_N,NBUF,REGS[,STAGES[,ALTERNATE]]",
                    help="variants outside the tables to check and time as well, e.g. one_pass_det,128,128,2,240")
    ap.add_argument("--against", metavar="FILE", type=kernels_file,
                    help="another version of gluon_kernels.py: its one passes are timed too, interleaved with these")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_one_pass_backward runs CUDA kernels")
        return 0
    from flashsys.ops.attention import flash_gluon

    tables = (flash_gluon.ONE_PASS_VARIANTS, flash_gluon.DETERMINISTIC_ONE_PASS_VARIANTS)
    variants = {d: [v for table in tables for v in table[d] if v.kind in args.kinds and (args.nbuf is None or
                                                                                       v.nbuf in args.nbuf)]
                for d in args.head_dims}
    for variant in args.extra:
        for d in args.head_dims:
            variants[d].append(variant)
    against = _load_kernels(args.against) if args.against else None  # refused before the check, not after it
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    failures = 0 if args.skip_check else check(variants, args.head_dims, args.cases)
    print(f"check: {failures} failures ({time.time() - t0:.0f} s)", flush=True)
    bench(variants, args.head_dims, args.seqs, args.rounds, against)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
