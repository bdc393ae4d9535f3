"""A job's items as a table (``GET /v1/jobs/{id}/items``): filtered by status, searched, in input order or
failures first, a page at a time, with how many items match."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from app.db import Item, ItemStatus, to_unix
from app.db.repository import item_table
from app.jobs.encoding import decode_item_input, to_jsonable
from app.jobs.errors import InvalidJobInput
from app.jobs.inputs import BatchItem
from app.jobs.service import load_job

ORDERS = ("position", "failures_first")
MAX_LIMIT = 500
MAX_SEARCH = 1000  # characters of ``q``: a search, not a document
#: ``failures_first``: failed items, then cancelled ones, then the rest, each group in input order
_FAILURES_FIRST = {ItemStatus.FAILED.value: 0, ItemStatus.CANCELLED.value: 1}
_ALL = tuple(s.value for s in ItemStatus)


@dataclass(frozen=True)
class ItemQuery:
    """What a table or an export shows: the statuses (each with its rank in the order) and the search text."""

    ranks: dict[str, int]
    search: str | None

    @property
    def statuses(self) -> list[str]:
        return sorted(self.ranks)


def item_query(status: str | None = None, q: str | None = None, order: str = "position") -> ItemQuery:
    """The query of the ``status`` (comma-separated item statuses), ``q`` and ``order`` parameters, or
    InvalidJobInput (400) naming the parameter at fault."""
    statuses = list(_ALL)
    if status is not None and status.strip():
        statuses = [s.strip() for s in status.split(",") if s.strip()]
        unknown = sorted(set(statuses) - set(_ALL))
        if unknown:
            raise InvalidJobInput(f"unknown item status {', '.join(repr(s) for s in unknown)}; use one or more "
                                  f"of {', '.join(_ALL)}, separated by commas", param="status")
    if order not in ORDERS:
        raise InvalidJobInput(f"unknown order {order!r}; use one of {', '.join(ORDERS)}", param="order")
    if q is not None and len(q) > MAX_SEARCH:
        raise InvalidJobInput(f"q has {len(q)} characters; a search may have at most {MAX_SEARCH}", param="q")
    if order == "failures_first":
        ranks = {s: _FAILURES_FIRST.get(s, 2) for s in statuses}
    else:
        ranks = dict.fromkeys(statuses, 0)
    return ItemQuery(ranks, q or None)


def items_page(
    session: Session,
    job_id: str,
    *,
    owner: str | None = None,
    status: str | None = None,
    q: str | None = None,
    order: str = "position",
    offset: int = 0,
    limit: int = 50,
) -> dict[str, Any]:
    """``{"object": "list", "data": [item views], "total", "offset", "limit", "has_more"}``; ``total`` counts
    every item that matches the filters. Another tenant's job is a 404, like an unknown one."""
    query = item_query(status, q, order)
    if offset < 0:
        raise InvalidJobInput(f"offset must be 0 or more, not {offset}", param="offset")
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidJobInput(f"limit must be between 1 and {MAX_LIMIT}, not {limit}", param="limit")
    job = load_job(session, job_id, owner)
    rows = item_table.item_table_page(session, job_id=job.id, ranks=query.ranks, search=query.search,
                                      offset=offset, limit=limit)
    if query.search is None and len(query.ranks) == len(_ALL):
        total = job.total_items  # every item: the job row knows how many
    elif len(rows) < limit and (rows or offset == 0):
        total = offset + len(rows)  # the last page: no second pass over the job to count
    else:
        total = item_table.count_table_items(session, job_id=job.id, statuses=query.statuses, search=query.search)
    return {
        "object": "list",
        "data": [item_view(item) for _, item in rows],
        "total": total,
        "offset": offset,
        "limit": limit,
        "has_more": offset + len(rows) < total,
    }


def item_view(item: Item) -> dict[str, Any]:
    """One row: what the user submitted as ``input`` (as ``/v1/jobs`` took it), the output or error, times as
    unix seconds and the latency in milliseconds (null until the item has both started and finished)."""
    return {
        "custom_id": item.custom_id,
        "position": item.position,
        "status": item.status,
        "input": submitted_input(item.input),
        "output": item.output,
        "error": item.error,
        "latency_ms": latency_ms(item.started_at, item.finished_at),
        "started_at": to_unix(item.started_at),
        "finished_at": to_unix(item.finished_at),
    }


def submitted_input(stored: Any) -> Any:
    """The item's input as submitted, from its stored graph encoding (``{"args", "kwargs"}``): one positional
    argument is shown alone, keyword arguments as an object, several arguments as a list."""
    if not isinstance(stored, dict):
        return stored
    try:
        args, kwargs = decode_item_input(stored)
    except Exception:  # stored by another version in a form this one does not decode: show it as stored
        return stored
    return to_jsonable(BatchItem("", args, kwargs).input)


def latency_ms(started: datetime | None, finished: datetime | None) -> float | None:
    if started is None or finished is None:
        return None
    if (started.tzinfo is None) != (finished.tzinfo is None):  # SQLite hands back naive UTC datetimes
        started, finished = started.replace(tzinfo=None), finished.replace(tzinfo=None)
    return round(max((finished - started).total_seconds(), 0.0) * 1000, 3)
