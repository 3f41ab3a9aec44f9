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


def test_each_round_takes_the_candidates_in_round_orders_order(monkeypatch):
    """The candidates of a choice go in `round_order`'s order, a new one each round: a fixed order would give each
    candidate the same place and the same neighbour before it every round, and the medians would keep that bias. A
    candidate that raises is timed no more; the lowest median wins among the rest."""
    from flashsys.timing import round_order

    medians = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.5}
    timed = []

    def fake_gpu_ms(fn, rep_ms, flush):
        return fn()

    def run(candidate):
        timed.append(candidate)
        if candidate == "d" and timed.count("d") == 2:
            raise RuntimeError("out of resources: registers")
        return medians[candidate]

    monkeypatch.setattr(timed_choice, "gpu_ms", fake_gpu_ms)
    monkeypatch.setattr(timed_choice, "flush_buffer", lambda device=None: None)
    best, errors = timed_choice.fastest(list("abcd"), run, rounds=4, rep_ms=1)
    expected = [c for r in range(4) for c in round_order(list("abcd"), r)]
    d_again = [i for i, c in enumerate(expected) if c == "d"][1]
    expected = expected[:d_again + 1] + [c for c in expected[d_again + 1:] if c != "d"]
    assert timed == expected and timed[:4] != timed[4:8]
    assert best == "b" and list(errors) == ["d"]
