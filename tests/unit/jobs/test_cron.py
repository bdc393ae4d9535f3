"""The five-field cron parser behind scheduled evaluations."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from app.jobs.learning.cron import CronError, parse_cron


def at(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        ("* * * * *", at(2026, 1, 1, 10, 0, 30), at(2026, 1, 1, 10, 1)),
        ("*/15 * * * *", at(2026, 1, 1, 10, 14), at(2026, 1, 1, 10, 15)),
        ("*/15 * * * *", at(2026, 1, 1, 10, 15), at(2026, 1, 1, 10, 30)),
        ("0 3 * * *", at(2026, 1, 1, 3, 0), at(2026, 1, 2, 3, 0)),
        ("30 9 * * mon-fri", at(2026, 1, 2, 10, 0), at(2026, 1, 5, 9, 30)),  # Friday → Monday
        ("0 0 1 */3 *", at(2026, 2, 10), at(2026, 4, 1)),
        ("0 12 31 * *", at(2026, 4, 1), at(2026, 5, 31, 12)),  # April has no 31st
        ("0 0 29 feb *", at(2026, 3, 1), at(2028, 2, 29)),  # the next leap day
        ("5/20 8-9 * * *", at(2026, 1, 1, 8, 6), at(2026, 1, 1, 8, 25)),
        ("0 0 * * 7", at(2026, 1, 1), at(2026, 1, 4)),  # 7 is Sunday too
        ("@hourly", at(2026, 1, 1, 10, 59), at(2026, 1, 1, 11, 0)),
        ("@weekly", at(2026, 1, 1), at(2026, 1, 4)),
        ("0 0 31 12 *", at(2026, 12, 31, 0, 0), at(2027, 12, 31)),
    ],
)
def test_next_after(expression: str, after: datetime, expected: datetime) -> None:
    assert parse_cron(expression).next_after(after) == expected


def test_both_day_fields_restricted_match_either() -> None:
    cron = parse_cron("0 0 13 * fri")  # the 13th, or any Friday (classic cron semantics)
    assert cron.next_after(at(2026, 1, 1)) == at(2026, 1, 2)  # a Friday
    assert cron.next_after(at(2026, 1, 12)) == at(2026, 1, 13)  # a Tuesday, the 13th


def test_at_or_before_inverts_next_after() -> None:
    cron = parse_cron("*/10 9-17 * * mon-fri")
    moment = at(2026, 3, 7, 12, 34)  # a Saturday
    previous = cron.at_or_before(moment)
    assert previous == at(2026, 3, 6, 17, 50)
    assert cron.next_after(previous) == at(2026, 3, 9, 9, 0)
    assert cron.at_or_before(at(2026, 3, 9, 9, 0)) == at(2026, 3, 9, 9, 0)


def test_naive_times_are_utc_and_seconds_are_dropped() -> None:
    cron = parse_cron("* * * * *")
    assert cron.next_after(datetime(2026, 1, 1, 10, 0, 59)) == at(2026, 1, 1, 10, 1)
    assert cron.matches(datetime(2026, 1, 1, 10, 0))


def test_walk_is_consistent_with_matches() -> None:
    cron = parse_cron("7,37 */5 1-10 * *")
    t = at(2026, 1, 1)
    for _ in range(50):
        nxt = cron.next_after(t)
        assert cron.matches(nxt) and nxt > t
        minute = t + timedelta(minutes=1)
        while minute < nxt:  # nothing in between matches
            assert not cron.matches(minute)
            minute += timedelta(minutes=1)
        t = nxt


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("* * * *", "4 field"),
        ("60 * * * *", "outside 0-59"),
        ("* 24 * * *", "outside 0-23"),
        ("* * 0 * *", "outside 1-31"),
        ("* * * 13 *", "outside 1-12"),
        ("* * * * 8", "outside 0-7"),
        ("*/0 * * * *", "at least 1"),
        ("5-1 * * * *", "backwards"),
        ("* * * foo *", "expected a number"),
        ("1,,2 * * * *", "empty list entry"),
        ("0 0 30 2 *", "matches no time"),
        ("", "0 field"),
    ],
)
def test_invalid_expressions_say_why(expression: str, problem: str) -> None:
    with pytest.raises(CronError, match=problem):
        parse_cron(expression)
