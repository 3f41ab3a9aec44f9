"""The Gluon choices' own timings (#16): runs `python -m benchmarks.attention` with the given arguments and prints,
for every choice the library makes on the way (`flash_gluon._choose`: forward, dQ, dK/dV, one pass or two), each
candidate's do_bench times in the choice's interleaved rounds, and what it took. Answers "did the choice pick the
faster kernel here, or was it a coin toss?" in the benchmark's own path.

    python scripts/probe_choice_timings.py --no-progress --out /tmp/sw --impls flash-triton sdpa-cudnn \\
        --head-dims 64 128 --seq-lens 2048 4096 --dtypes bf16 --causal yes --rep 100

A choice made inside another's timing (the two passes' dQ and dK/dV choices, on the one-pass choice's first run of
the two passes) prints its own line, before the outer one. On a CPU the library makes no Gluon choice: only the
benchmark's rows print.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _logged_choices() -> None:
    """Wrap flash_gluon._choose and triton.testing.do_bench so that each new choice prints its candidates' times."""
    import triton.testing

    from flashsys.ops.attention import flash_gluon

    real_bench, real_choose = triton.testing.do_bench, flash_gluon._choose
    state = {"depth": 0, "times": None}  # do_bench nesting, and the times of the choice being made

    def bench(fn, *args, **kwargs):
        state["depth"] += 1
        try:
            ms = real_bench(fn, *args, **kwargs)
        finally:
            state["depth"] -= 1
        if state["times"] is not None and state["depth"] == 0:
            state["times"].append(ms)
        return ms

    def choose(key, run):
        if key in flash_gluon._chosen:
            return real_choose(key, run)
        outer = state["times"], state["depth"]
        state["times"], state["depth"] = [], 0
        try:
            chosen = real_choose(key, run)
        finally:
            times = state["times"]
            state["times"], state["depth"] = outer
        candidates = key.candidates()
        rounds = "; ".join(f"{key.label(c)}: {', '.join(f'{t:.3f}' for t in times[i::len(candidates)])}"
                           for i, c in enumerate(candidates))
        print(f"CHOICE {key.kernel} D{key.head_dim} {str(key.dtype)[6:]} causal={key.bound_right} "
              f"N<={key.bucket}: {None if chosen is None else key.label(chosen)}; {rounds}", flush=True)
        return chosen

    triton.testing.do_bench = bench
    flash_gluon._choose = choose


def main() -> int:
    _logged_choices()
    from benchmarks import attention

    return attention.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
