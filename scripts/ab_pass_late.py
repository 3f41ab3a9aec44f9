"""The deterministic one pass with PASS_LATE as the host sets it (`flash_gluon.passes_turns_late`) against PASS_LATE
off, at D 128, timed in interleaved rounds beside SDPA's cuDNN backward and the unordered one pass (GPU probe for #16,
stop 45; prints). PASS_LATE counts a tile's turn only after the next tile's adds are issued; off, the writer counts
it as soon as the tile's adds have completed. Each deterministic kernel runs twice first: is dQ the same bits?

    python scripts/ab_pass_late.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import at_least_one  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=at_least_one, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ab_pass_late runs CUDA kernels")
        return 0

    from flashsys.ops.attention import flash_gluon
    from scripts.probe_gluon_backward import BackwardCell
    from scripts.probe_one_pass_backward import OnePass, interleaved_times, print_times, same_bits_on_rerun

    host_rule = flash_gluon.passes_turns_late

    def with_late(late: bool, fb):
        def run():
            flash_gluon.passes_turns_late = host_rule if late else (lambda *a: False)
            try:
                fb()
            finally:
                flash_gluon.passes_turns_late = host_rule
        return run

    variants = (flash_gluon.Variant("one_pass", 64, 128, 2, 240), flash_gluon.Variant("one_pass_det", 64, 128, 2, 240),
                flash_gluon.Variant("one_pass_det", 64, 128, 2, 240, 2),
                flash_gluon.Variant("one_pass_det", 64, 128, 3, 240))
    for n, causal in ((16384, True), (4096, True), (16384, False), (4096, False)):
        cell = BackwardCell(128, n, causal)
        tensors = (cell.q, cell.k, cell.v, cell.o, cell.lse, cell.do, cell.window, cell.scale)
        q4, k4 = flash_gluon._rank4(cell.q), flash_gluon._rank4(cell.k)
        runs = {"SDPA cuDNN backward": cell.cudnn_backward}
        for var in variants:
            fb = OnePass(var, *tensors)
            late = host_rule(var, q4, k4, cell.window)
            if not late:  # the unordered kind, or a shape where the host already counts turns at once
                runs[f"{var.label()} (PASS_LATE {late})"] = fb
                continue
            for lt in (True, False):
                run = with_late(lt, fb)
                run()
                torch.cuda.synchronize()
                print(f"D=128 N={n} causal={causal} {var.label()} PASS_LATE {lt}: dQ bitwise equal on a rerun "
                      f"{same_bits_on_rerun(run, fb.dq)}", flush=True)
                runs[f"{var.label()} PASS_LATE {lt}"] = run
        times = interleaved_times(runs, args.rounds)
        print(f"\nD=128 N={n} B={cell.b} causal={causal}")
        print_times(times, cell.flops)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
