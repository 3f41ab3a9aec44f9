"""Timing kernel candidates on a call's own tensors: the measurement behind every timed choice of `dispatch`.

A candidate is timed as its GPU work alone. During the choice each candidate launches through Triton's full path
(JIT dispatch, descriptors built and checked), whose host time can exceed the kernels' own at the smaller shape
classes; a later call replays the chosen launches from a plan, natively, at a fraction of that host time. Timed with
the host in it, a candidate whose launches take longer in Python (the one-pass backward's, between its prologue and
its kernel) would lose to one whose kernels run longer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ...timing import round_order

Candidate = TypeVar("Candidate")

# What a timing flushes before each run, as triton.testing.do_bench does: more than an H100's or H200's L2, so that
# every candidate starts from memory, as a call does after the rest of a model's step.
FLUSH_BYTES = 256 << 20
# The spin ahead of each run lasts this many times the host's time to issue the run, plus SPIN_MARGIN_MS.
SPIN_FACTOR = 2.0
SPIN_MARGIN_MS = 0.05
_spin_cycles: dict[int, float] = {}  # device index -> `torch.cuda._sleep` cycles per millisecond


def spin_cycles_per_ms(device: int) -> float:
    """How many cycles of `torch.cuda._sleep` the GPU spins in a millisecond (measured once per device)."""
    if device not in _spin_cycles:
        cycles = 2_000_000
        with torch.cuda.device(device):
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)  # the clock up to speed
            first.record()
            torch.cuda._sleep(cycles)
            last.record()
            last.synchronize()
        _spin_cycles[device] = cycles / max(first.elapsed_time(last), 1e-3)
    return _spin_cycles[device]


def flush_buffer(device: int | None = None) -> torch.Tensor:
    """A FLUSH_BYTES buffer on the device (default: the current one), whose `zero_()` evicts what the L2 cache
    holds."""
    if device is None:
        device = torch.cuda.current_device()
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device=f"cuda:{device}")


def behind_spin_ms(fn: Callable[[], object], rep_ms: float, calls: int = 1,
                   before: Callable[[], object] | None = None) -> float:
    """Median milliseconds per call of `calls` back-to-back calls of `fn` on the current device, timed as GPU work
    alone: each repeat starts behind a spin kernel that lasts longer than the host takes to issue the calls, so their
    kernels run back to back between the events around them, however long their host side takes. `before` runs
    ahead of each spin (an L2 flush). Repeats for about `rep_ms`, spins included (at least 3 repeats), after one
    untimed call (it compiles, or makes a nested choice) and one untimed repeat (it times the host)."""
    device = torch.cuda.current_device()
    fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    issue_ms = (time.perf_counter() - began) * 1e3
    torch.cuda.synchronize()
    spin_ms = SPIN_FACTOR * issue_ms + SPIN_MARGIN_MS
    spin = int(spin_ms * spin_cycles_per_ms(device))
    repeats: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def repeat_once() -> None:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        torch.cuda._sleep(spin)
        first.record()
        for _ in range(calls):
            fn()
        last.record()
        repeats.append((first, last))

    repeat_once()
    torch.cuda.synchronize()
    estimate = repeats[0][0].elapsed_time(repeats[0][1])
    for _ in range(max(3, min(1000, int(rep_ms / max(estimate + spin_ms, 1e-3)))) - 1):
        repeat_once()
    torch.cuda.synchronize()
    return statistics.median(first.elapsed_time(last) / calls for first, last in repeats)


def gpu_ms(fn: Callable[[], object], rep_ms: float, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of `fn`'s GPU work on the current device, its inputs out of the L2 cache, however long its
    host side takes (`behind_spin_ms`, the L2 flushed before each run). `flush`: a `flush_buffer` of the current
    device to reuse (one is allocated otherwise)."""
    if flush is None:
        flush = flush_buffer()
    return behind_spin_ms(fn, rep_ms, before=flush.zero_)


def fastest(candidates: Sequence[Candidate], run: Callable[[Candidate], object], rounds: int, rep_ms: float
            ) -> tuple[Candidate | None, dict[Candidate, Exception]]:
    """(the candidate with the lowest median time, the candidates that failed and why): each timed by
    `gpu_ms(run(candidate), rep_ms)` in `rounds` interleaved rounds, so that a GPU's drift within the process falls
    on every candidate alike, each round in `round_order`'s order, so that no candidate keeps one place and one
    neighbour before it (the clock and power state that neighbour leaves) in every round. A candidate that raises
    (out of shared memory or registers on this GPU, say) is left out; the first element is None where none ran."""
    times: dict[Candidate, list[float]] = {}
    errors: dict[Candidate, Exception] = {}
    flush = flush_buffer() if candidates else None  # one for the whole choice
    for r in range(rounds):
        for candidate in round_order(candidates, r):
            if candidate in errors:
                continue
            try:
                times.setdefault(candidate, []).append(gpu_ms(lambda: run(candidate), rep_ms, flush))
            except Exception as exc:  # noqa: BLE001  (the caller reports every failure when none ran)
                errors[candidate] = exc
                times.pop(candidate, None)
    if not times:
        return None, errors
    return min(times, key=lambda c: statistics.median(times[c])), errors
