"""When serving counts as normal again after a fault, from the requests' timeline alone."""

from __future__ import annotations

from kvtier.tools.chaos.load import Record, RequestKey
from kvtier.tools.chaos.run import WINDOW, latency_bound, normal_after

KEY = RequestKey(0, chat=False, stream=False)
FAULT, END, BOUND = 0.0, 10.0, 3.0


def timeline(*requests: tuple[float, float] | tuple[float, float, str]) -> list[Record]:
    """(start, latency[, outcome]) -> records."""
    return [Record(KEY, r[0], r[0] + r[1], r[2] if len(r) > 2 else "ok") for r in requests]


STEADY = [(t, 1.0) for t in range(0, 30, 2)]


def test_no_slow_or_failed_request_is_normal_throughout() -> None:
    assert normal_after(timeline(*STEADY), FAULT, END, BOUND, WINDOW) == 0.0


def test_one_slow_request_alone_is_noise_but_the_strict_figure_counts_it() -> None:
    records = timeline(*STEADY, (21.0, 5.0))
    assert normal_after(records, FAULT, END, BOUND, WINDOW) == 0.0
    assert normal_after(records, FAULT, END, BOUND, 1) == 22.0 - END


def test_two_slow_requests_among_five_hold_normal_back_until_one_of_them_leaves() -> None:
    # starts 0, 2, ..., 28; those at 14 and 18 are slow (three requests apart: one window)
    records = timeline(*[(t, 5.0 if t in (14, 18) else 1.0) for t in range(0, 30, 2)])
    assert normal_after(records, FAULT, END, BOUND, WINDOW) == 16.0 - END
    # further apart than a window: each is alone
    records = timeline(*[(t, 5.0 if t in (4, 18) else 1.0) for t in range(0, 30, 2)])
    assert normal_after(records, FAULT, END, BOUND, WINDOW) == 0.0


def test_any_failure_holds_normal_back_until_the_next_request() -> None:
    records = timeline(*STEADY, (23.0, 0.1, "connect_error"))
    assert normal_after(records, FAULT, END, BOUND, WINDOW) == 24.0 - END


def test_a_breach_at_the_very_end_is_not_normal_within_the_run() -> None:
    records = timeline(*STEADY, (29.0, 0.1, "http_error"))
    assert normal_after(records, FAULT, END, BOUND, WINDOW) is None


def test_requests_before_the_fault_do_not_count() -> None:
    records = timeline((-4.0, 9.0), (-3.0, 9.0, "hang"), *STEADY)
    assert normal_after(records, FAULT, END, BOUND, WINDOW) == 0.0


def test_the_slow_bound_is_three_medians_at_least_the_slowest_before_and_a_second() -> None:
    assert latency_bound([0.4, 0.5, 0.6]) == 3 * 0.5
    assert latency_bound([0.4, 0.5, 2.5]) == 2.5  # one slow request before: no false alarm
    assert latency_bound([0.1, 0.1]) == 1.0
    assert latency_bound([]) == 1.0
