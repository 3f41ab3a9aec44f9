"""One way to time work on any device, used by the trainer, the bucket-size cost model and every benchmark.

A host clock read right after a CUDA call measures only the launch: the GPU runs asynchronously. So every
reading here first waits for the device (`Stopwatch`), or brackets the work with CUDA events (`time_call`).
Across ranks, `Stopwatch(barrier=True)` starts each interval after a barrier, so all ranks start together and
the slowest rank's interval is the collective's time. Work timed in interleaved rounds (the benchmarks' cells,
the attention kernels' timed choices) takes its items in `round_order`'s order.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
Item = TypeVar("Item")


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on `device` (a no-op on a CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall-clock intervals (milliseconds) that include the device work queued before each reading.

    `start()` begins an interval (after a barrier on `group` when `barrier=True`); `lap()` returns the time
    since the previous reading and starts the next; `elapsed()` the time since `start()`.
    """

    def __init__(self, device: torch.device | str | None = None, *, barrier: bool = False, group=None) -> None:
        self.device, self.barrier, self.group = device, barrier, group
        self._t0 = self._last = None

    def start(self) -> Stopwatch:
        """Begin an interval (after the device's queued work and, with barrier=True, the other ranks)."""
        synchronize(self.device)
        if self.barrier:
            dist.barrier(group=self.group)
        self._t0 = self._last = time.perf_counter()
        return self

    def _started(self) -> None:
        if self._t0 is None:
            raise RuntimeError("Stopwatch: call start() before lap() or elapsed()")

    def lap(self) -> float:
        """Milliseconds since the previous reading (start or lap); starts the next lap."""
        self._started()
        synchronize(self.device)
        now = time.perf_counter()
        ms, self._last = (now - self._last) * 1e3, now
        return ms

    def elapsed(self, sync: bool = True) -> float:
        """Milliseconds since start(). `sync=False` reads the host clock alone, for a progress display: a device
        sync every step would cost the throughput it displays."""
        self._started()
        if sync:
            synchronize(self.device)
        return (time.perf_counter() - self._t0) * 1e3


class StepMarks:
    """Times of consecutive steps of a loop that never waits for the device between them.

    A per-step sync (Stopwatch) hides what a training loop overlaps across a step boundary: the host queueing the
    next step while the device finishes the last, or an all-gather left running by `optimizer.step()` that the next
    forward waits for. Here `mark()` is called at the start of every timed step and once after the last (after
    anything that step leaves pending has been waited for); `intervals_ms()` waits for the device once and returns
    the gaps between consecutive marks. On a GPU a mark is a CUDA event on the current stream, so a gap is that
    step's length on the device's timeline, stalls included; on a CPU it is a host clock reading.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self._marks: list = []

    def mark(self) -> None:
        """Record a point in time: a CUDA event on the current stream, or the host clock on a CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (one fewer than the marks)."""
        if self.cuda:
            if self._marks:
                self._marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self._marks, self._marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self._marks, self._marks[1:])]


def time_call(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[T, float]:
    """(fn(), milliseconds): CUDA events around the call on a GPU (no host sync before it), the host clock
    on a CPU."""
    if device is not None and torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end)
    t = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t) * 1e3


def repeat(fn: Callable[[], object], *, warmup: int, iters: int, device: torch.device | str | None = None,
           barrier: bool = False, group=None) -> list[float]:
    """Milliseconds of `iters` calls of fn after `warmup` untimed ones, each call its own Stopwatch interval."""
    watch = Stopwatch(device, barrier=barrier, group=group)
    samples = []
    for i in range(warmup + iters):
        watch.start()
        fn()
        ms = watch.lap()
        if i >= warmup:
            samples.append(ms)
    return samples


@dataclass
class Stats:
    """Summary of timing samples, in milliseconds."""

    mean: float
    std: float
    median: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.std:.3f}"


def summarize(samples: list[float]) -> Stats:
    """Mean, standard deviation (0 for one sample), median and count."""
    return Stats(statistics.fmean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0,
                 statistics.median(samples), len(samples))


def round_order(items: Sequence[Item], round_index: int) -> list[Item]:
    """The order in which round `round_index` of interleaved rounds times `items`: row `round_index` of a Williams
    design. Over n rounds (2n for an odd count n) each item runs equally often in every position and right after
    every other item; round 0 keeps the given order. A fixed order gives each item the same place and the same
    neighbour before it every round, with the clock and power state that neighbour leaves, and the median over the
    rounds keeps that bias (the same forward kernel, in two columns of one FlashAttention-4 run in a fixed order, read
    up to 8% apart); a plain rotation moves the place but keeps the neighbour."""
    n = len(items)
    if n == 0:
        return []
    first_row, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
    while len(first_row) < n:
        if len(first_row) % 2:
            first_row.append(low)
            low += 1
        else:
            first_row.append(high)
            high -= 1
    r = round_index % (n if n % 2 == 0 else 2 * n)
    row = [(i + r) % n for i in first_row]
    if r >= n:  # an odd count's second n rounds: the rows mirrored, which completes the balance of neighbours
        row.reverse()
    label = {design: given for given, design in enumerate(first_row)}  # relabelled so that round 0 is the given order
    return [items[label[i]] for i in row]
