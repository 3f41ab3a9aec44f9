"""flashsys.timing: the one timer of the trainer, the cost model and the benchmarks."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from flashsys.timing import StepMarks, Stopwatch, repeat, round_order, summarize, time_call


def test_stopwatch_laps_add_up_to_elapsed():
    watch = Stopwatch("cpu").start()
    time.sleep(0.02)
    first = watch.lap()
    time.sleep(0.01)
    second = watch.lap()
    total = watch.elapsed()
    assert first >= 19 and second >= 9
    assert first + second <= total + 1e-6


def test_time_call_returns_the_result_and_milliseconds():
    out, ms = time_call(lambda: time.sleep(0.01) or 42, "cpu")
    assert out == 42 and ms >= 9


def test_repeat_times_only_the_timed_calls():
    calls = []
    samples = repeat(lambda: calls.append(1), warmup=2, iters=5, device="cpu")
    assert len(calls) == 7 and len(samples) == 5 and all(s >= 0 for s in samples)


def test_step_marks_give_one_gap_per_step_in_order():
    marks = StepMarks("cpu")
    assert marks.intervals_ms() == []
    for pause in (0.01, 0.03):
        marks.mark()
        time.sleep(pause)
    marks.mark()
    first, second = marks.intervals_ms()
    assert first >= 10 and second >= 30 and second > first


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 10.0])
    assert s.mean == pytest.approx(4.0) and s.median == pytest.approx(2.5) and s.n == 4
    assert summarize([5.0]).std == 0.0


def test_reading_a_stopwatch_that_was_not_started_is_a_clear_error():
    for read in (Stopwatch("cpu").lap, Stopwatch("cpu").elapsed):
        with pytest.raises(RuntimeError, match="call start"):
            read()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_order_is_balanced_for_position_and_for_the_item_before(n):
    """`round_order` over a full cycle (n rounds, 2n for odd n): every item equally often in every position
    and right after every other item; round 0 keeps the given order, and the cycle repeats."""
    items = list("abcdef"[:n])
    cycle = n if n % 2 == 0 else 2 * n
    orders = [round_order(items, r) for r in range(cycle)]
    assert orders[0] == items and round_order(items, cycle + 1) == orders[1 % cycle]
    assert all(sorted(o) == items for o in orders)
    places = Counter((o[i], i) for o in orders for i in range(n))
    assert set(places.values()) == {cycle // n} and len(places) == n * n
    before = Counter((o[i - 1], o[i]) for o in orders for i in range(1, n))
    assert len(before) == n * (n - 1) and set(before.values()) <= {cycle // n}
    assert round_order([], 3) == []
