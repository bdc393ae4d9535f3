"""Database errors that bad input causes: a value the database refuses to store or compare (a NUL character in
text, a number out of range, other data of the wrong form). The API answers them with a 400 (``api.errors``);
anything else the database raises stays a server error.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from sqlalchemy.exc import DataError, StatementError

#: the exception types that may be such an error (``refused_input`` decides): handlers register for these
CANDIDATE_TYPES: tuple[type[Exception], ...] = (StatementError, psycopg.DataError, ValueError, OverflowError)

NUL_MESSAGE = ("A value of the request contains a NUL character (\\u0000), which cannot be stored: remove it from "
               "the request's text, ids and names.")
RANGE_MESSAGE = "A number in the request is out of the range this server stores (integers must fit in 32 or 64 bits)."


@dataclass(frozen=True)
class RefusedInput:
    code: str  # nul_character, number_out_of_range or invalid_value
    message: str


def refused_input(exc: BaseException) -> RefusedInput | None:
    """What was wrong with the input when ``exc`` is the database (or its driver) refusing a value, else None."""
    if isinstance(exc, StatementError):
        found = refused_input(exc.orig) if exc.orig is not None else None
        if found is None and isinstance(exc, DataError):  # any other data the database refuses
            found = _unstorable(exc.orig or exc)
        return found
    text = str(exc)
    # psycopg refuses NUL in text itself; PostgreSQL refuses the \u0000 escape in JSONB
    if isinstance(exc, ValueError | psycopg.DataError) and ("NUL (0x00)" in text or "\\u0000" in text):
        return RefusedInput("nul_character", NUL_MESSAGE)
    # OverflowError: sqlite3 cannot bind an integer past 64 bits
    if isinstance(exc, OverflowError | psycopg.errors.NumericValueOutOfRange):
        return RefusedInput("number_out_of_range", RANGE_MESSAGE)
    if isinstance(exc, psycopg.DataError):
        return _unstorable(exc)
    return None


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def _unstorable(exc: BaseException) -> RefusedInput:
    return RefusedInput("invalid_value", f"A value of the request cannot be stored: {first_line(exc)}")
