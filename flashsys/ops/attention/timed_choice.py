"""Timing kernel candidates on a call's own tensors: the measurement behind every timed choice of `dispatch`."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import TypeVar

Candidate = TypeVar("Candidate")


def fastest(candidates: Sequence[Candidate], run: Callable[[Candidate], object], rounds: int, rep_ms: float
            ) -> tuple[Candidate | None, dict[Candidate, Exception]]:
    """(the candidate with the lowest median time, the candidates that failed and why): each timed by
    `triton.testing.do_bench(run(candidate), rep=rep_ms)` in `rounds` interleaved rounds, so that a GPU's drift within
    the process falls on every candidate alike. A candidate that raises (out of shared memory or registers on this
    GPU, say) is left out; the first element is None where none ran."""
    from triton.testing import do_bench

    times: dict[Candidate, list[float]] = {}
    errors: dict[Candidate, Exception] = {}
    for _ in range(rounds):
        for candidate in candidates:
            if candidate in errors:
                continue
            try:
                times.setdefault(candidate, []).append(do_bench(lambda: run(candidate), warmup=2, rep=rep_ms))
            except Exception as exc:  # noqa: BLE001  (the caller reports every failure when none ran)
                errors[candidate] = exc
                times.pop(candidate, None)
    if not times:
        return None, errors
    return min(times, key=lambda c: statistics.median(times[c])), errors
