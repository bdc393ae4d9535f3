"""A minimal five-field cron parser: ``minute hour day-of-month month day-of-week``, in UTC.

Each field takes ``*``, a number, a range ``a-b``, a step ``*/n`` or ``a-b/n`` or ``a/n``, and comma lists of
those; months and weekdays also take names (``jan``, ``mon``); Sunday is 0 or 7. ``@hourly``, ``@daily``
(``@midnight``), ``@weekly``, ``@monthly`` and ``@yearly`` (``@annually``) are shorthands. As in classic cron,
when both day fields are restricted a day matches if either does.

Written here rather than taken from a package: it is small, and scheduled evaluations need only this.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTHS = {name: i for i, name in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], start=1)}
_DAYS = {name: i for i, name in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (  # name, low, high, names
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
#: a cron expression that matches nothing (e.g. February 30th) is refused instead of searched forever
_SEARCH_YEARS = 8


class CronError(ValueError):
    """The expression is not valid five-field cron; the message says which field and why."""


@dataclass(frozen=True)
class Cron:
    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_restricted: bool
    weekdays_restricted: bool

    # -- matching -------------------------------------------------------------------------------------------
    def _day_matches(self, moment: datetime) -> bool:
        in_days = moment.day in self.days
        in_weekdays = (moment.isoweekday() % 7) in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return in_days or in_weekdays
        return in_days and in_weekdays

    def matches(self, moment: datetime) -> bool:
        moment = _utc(moment)
        return (moment.minute in self.minutes and moment.hour in self.hours and moment.month in self.months
                and self._day_matches(moment))

    # -- searching ------------------------------------------------------------------------------------------
    def next_after(self, moment: datetime) -> datetime:
        """The first matching minute strictly after ``moment`` (UTC, seconds zero)."""
        t = _utc(moment).replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t + timedelta(days=366 * _SEARCH_YEARS)
        while t < limit:
            if t.month not in self.months:
                t = _first_of_next_month(t)
            elif not self._day_matches(t):
                t = (t + timedelta(days=1)).replace(hour=0, minute=0)
            elif t.hour not in self.hours:
                t = (t + timedelta(hours=1)).replace(minute=0)
            elif t.minute not in self.minutes:
                t += timedelta(minutes=1)
            else:
                return t
        raise CronError(f"cron {self.expression!r} matches no time in the next {_SEARCH_YEARS} years")

    def at_or_before(self, moment: datetime) -> datetime:
        """The last matching minute at or before ``moment``."""
        t = _utc(moment).replace(second=0, microsecond=0)
        limit = t - timedelta(days=366 * _SEARCH_YEARS)
        while t > limit:
            if t.month not in self.months:
                t = t.replace(day=1, hour=0, minute=0) - timedelta(minutes=1)
            elif not self._day_matches(t):
                t = t.replace(hour=0, minute=0) - timedelta(minutes=1)
            elif t.hour not in self.hours:
                t = t.replace(minute=0) - timedelta(minutes=1)
            elif t.minute not in self.minutes:
                t -= timedelta(minutes=1)
            else:
                return t
        raise CronError(f"cron {self.expression!r} matched no time in the last {_SEARCH_YEARS} years")


def parse_cron(expression: str) -> Cron:
    """Parse and check an expression (it must match some time); raises CronError with a readable reason."""
    text = " ".join(str(expression).split()).lower()
    text = _ALIASES.get(text, text)
    parts = text.split(" ") if text else []
    if len(parts) != 5:
        raise CronError(
            f"cron {expression!r} has {len(parts)} field(s); give five: minute hour day-of-month month "
            "day-of-week, e.g. '0 3 * * *' (03:00 UTC daily) or '*/15 * * * *', or @hourly/@daily/@weekly"
        )
    sets = [_field(part, *spec) for part, spec in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(0 if d == 7 else d for d in sets[4])
    cron = Cron(
        expression=text, minutes=sets[0], hours=sets[1], days=sets[2], months=sets[3], weekdays=weekdays,
        days_restricted=not parts[2].startswith("*"), weekdays_restricted=not parts[4].startswith("*"),
    )
    cron.next_after(datetime(2000, 1, 1, tzinfo=UTC))  # refuses expressions that never fire (Feb 30)
    return cron


def _field(text: str, name: str, low: int, high: int, names: dict[str, int]) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise CronError(f"cron {name} field {text!r} has an empty list entry")
        base, slash, step_text = part.partition("/")
        step = 1
        if slash:
            step = _number(step_text, name, {})
            if step < 1:
                raise CronError(f"cron {name} step must be at least 1, got {step_text!r}")
        if base == "*":
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start, end = _number(first, name, names), _number(last, name, names)
            if start > end:
                raise CronError(f"cron {name} range {base!r} runs backwards")
        else:
            start = _number(base, name, names)
            end = high if slash else start  # "5/15" means from 5 to the end in steps of 15
        for value in (start, end):
            if not low <= value <= high:
                raise CronError(f"cron {name} value {value} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return frozenset(values)


def _number(text: str, name: str, names: dict[str, int]) -> int:
    if text in names:
        return names[text]
    if not text.isdigit():
        hint = f" (or a name: {', '.join(names)})" if names else ""
        raise CronError(f"cron {name} field has {text!r}; expected a number{hint}")
    return int(text)


def _utc(moment: datetime) -> datetime:
    # naive datetimes (SQLite hands them back) are UTC
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _first_of_next_month(t: datetime) -> datetime:
    days = calendar.monthrange(t.year, t.month)[1]
    return (t.replace(day=1, hour=0, minute=0) + timedelta(days=days))
