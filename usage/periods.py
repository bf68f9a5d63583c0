"""Read the time ranges that usage reports accept: "30m", "24h", "7d" or a date."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

_DURATION = re.compile(r"(\d{1,6})\s*([smhdw])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}

PERIOD_HELP = (
    'a duration back from now ("30m", "24h", "7d", "2w") or an ISO 8601 date '
    'or date-time ("2026-11-20", "2026-11-20T08:00:00Z")'
)


def parse_duration(text: str) -> timedelta:
    """Return the timedelta of a duration like "30m", "24h" or "7d".

    Raises ValueError, with a message fit for the user, when it is not one.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 30m, 24h or 7d.")
    amount, unit = match.groups()
    return timedelta(**{_UNITS[unit]: int(amount)})


def parse_moment(text: str, *, now: datetime | None = None) -> datetime:
    """Return the aware datetime a duration ago, or the given date or date-time.

    A date means its midnight and a date-time without an offset means UTC.
    Raises ValueError, with a message fit for the user, on anything else.
    """
    try:
        ago = parse_duration(text)
    except ValueError:
        pass
    else:
        try:
            return (now or timezone.now()) - ago
        except OverflowError:
            raise ValueError(f"{text!r} reaches back too far.") from None
    moment: datetime | None = None
    try:
        moment = parse_datetime(text.strip())
        if moment is None:
            day = parse_date(text.strip())
            if day is not None:
                moment = datetime(day.year, day.month, day.day)
    except ValueError:
        moment = None  # well-formed but impossible, like 2026-02-30
    if moment is None:
        raise ValueError(f"{text!r} is not {PERIOD_HELP}.")
    if timezone.is_naive(moment):
        moment = moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{text!r} is out of range.") from None
