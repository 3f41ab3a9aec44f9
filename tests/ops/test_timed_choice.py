"""`timed_choice.gpu_ms`: a candidate's time is its GPU work alone, however long its launches take on the host.

A CPU machine has no GPU to time, so these tests run it against a simulated device: a stream whose work starts when
both the host has queued it and the work before it has finished, with CUDA events stamped where the stream reaches
them. The simulation shows the mechanism: behind the spin the events time the kernels; without it, the host.
"""

from __future__ import annotations

import time

import pytest
import torch

from flashsys.ops.attention import timed_choice

CYCLES_PER_MS = 1_000_000.0


class _Stream:
    """One simulated CUDA stream on the host's clock (milliseconds)."""

    def __init__(self):
        self.free_at = 0.0
        self.order: list[str] = []
        self.flush_buffers = 0  # how many `flush_buffer`s were allocated

    @staticmethod
    def now() -> float:
        return time.perf_counter() * 1e3

    def enqueue(self, what: str, ms: float) -> float:
        start = max(self.free_at, self.now())
        self.free_at = start + ms
        self.order.append(what)
        return start

    def synchronize(self) -> None:
        while self.now() < self.free_at:
            time.sleep(1e-4)


@pytest.fixture
def stream(monkeypatch):
    s = _Stream()

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = s.enqueue("event", 0.0)

        def elapsed_time(self, other):
            return other.at - self.at

        def synchronize(self):
            s.synchronize()

    class Flush:
        def zero_(self):
            s.enqueue("flush", 0.05)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: s.enqueue("spin", cycles / CYCLES_PER_MS))
    monkeypatch.setattr(torch.cuda, "synchronize", s.synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    def flush_buffer(device=None):
        s.flush_buffers += 1
        return Flush()

    monkeypatch.setattr(timed_choice, "flush_buffer", flush_buffer)
    monkeypatch.setattr(timed_choice, "spin_cycles_per_ms", lambda device: CYCLES_PER_MS)
    return s


def _slow_launch(stream, host_ms: float, kernel_ms: float):
    """A candidate whose launch takes host_ms of Python before its kernel_ms kernel is queued."""
    def fn():
        time.sleep(host_ms / 1e3)
        stream.enqueue("kernel", kernel_ms)
    return fn


def test_behind_the_spin_the_events_time_the_kernels_not_the_host(stream):
    measured = timed_choice.gpu_ms(_slow_launch(stream, host_ms=4.0, kernel_ms=0.3), rep_ms=40)
    assert measured == pytest.approx(0.3, abs=0.05)
    timed = stream.order[stream.order.index("flush"):]  # the untimed runs queue kernels alone
    assert timed[:5] == ["flush", "spin", "event", "kernel", "event"]  # each run: cold L2, spin, then the timing
    assert 3 <= timed.count("kernel") <= 40 / 4.0 + 1  # about rep_ms of wall time, spins included


def test_back_to_back_calls_behind_one_spin_time_a_call_each(stream):
    """What benchmarks.harness.warm_l2_ms times (its inputs left in the L2): several calls behind each spin, no flush."""
    measured = timed_choice.behind_spin_ms(_slow_launch(stream, host_ms=2.0, kernel_ms=0.3), rep_ms=40, calls=3)
    assert measured == pytest.approx(0.3, abs=0.05)
    assert "flush" not in stream.order
    timed = stream.order[stream.order.index("spin"):]
    assert timed[:6] == ["spin", "event", "kernel", "kernel", "kernel", "event"]


def test_without_the_spin_the_same_device_times_the_host(stream, monkeypatch):
    monkeypatch.setattr(timed_choice, "SPIN_FACTOR", 0.0)
    monkeypatch.setattr(timed_choice, "SPIN_MARGIN_MS", 0.0)
    assert timed_choice.gpu_ms(_slow_launch(stream, host_ms=4.0, kernel_ms=0.3), rep_ms=40) > 3.0


def test_the_fastest_gpu_work_wins_over_the_fastest_launch(stream):
    """The choice's question: a candidate with slow launches and short kernels against one with fast launches and
    longer kernels. Replayed from plans both launch in microseconds, so the shorter kernels must win."""
    candidates = {"slow launch, short kernels": (4.0, 0.3), "fast launch, long kernels": (0.0, 0.6)}
    best, errors = timed_choice.fastest(list(candidates), lambda c: _slow_launch(stream, *candidates[c])(),
                                        rounds=2, rep_ms=20)
    assert best == "slow launch, short kernels" and not errors
    assert stream.flush_buffers == 1  # one buffer for the whole choice, not one per timing
