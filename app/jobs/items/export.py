"""Every item of a job that matches a table's filters, as a download (``GET /v1/jobs/{id}/items/export``):
JSON Lines (the table's rows) or CSV. Rows are read a page at a time, each page on its own short session, as
the download streams: a 50,000-item export never holds the job in memory nor a transaction open while the
client reads."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy.orm import Session

from app.db.repository import item_table
from app.jobs.errors import InvalidJobInput
from app.jobs.items.table import ItemQuery, item_query, item_view
from app.jobs.service import load_job

FORMATS = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}
CSV_COLUMNS = ("custom_id", "status", "input", "output", "error", "latency_ms")
EXPORT_PAGE = 1000

#: opens a short session (committed when the block ends): the runtime's ``session``
SessionOpener = Callable[[], AbstractContextManager[Session]]


@dataclass(frozen=True)
class ItemExport:
    """A checked export: what to call the file, its media type, and its rows as they stream."""

    job_id: str
    owner: str | None
    format: str
    query: ItemQuery

    @property
    def filename(self) -> str:
        return f"{self.job_id}.items.{self.format}"

    @property
    def media_type(self) -> str:
        return FORMATS[self.format]

    def chunks(self, open_session: SessionOpener) -> Iterator[bytes]:
        """The file's bytes, one page of rows per chunk (CSV starts with its header)."""
        if self.format == "csv":
            yield _csv_line(CSV_COLUMNS)
        for page in self._pages(open_session):
            if self.format == "csv":
                yield b"".join(_csv_line(_csv_row(view)) for view in page)
            else:
                yield b"".join(_json(view) + b"\n" for view in page)

    def _pages(self, open_session: SessionOpener) -> Iterator[list[dict[str, Any]]]:
        after: tuple[int, int] | None = None
        while True:
            with open_session() as session:
                load_job(session, self.job_id, self.owner)  # still there (and still the caller's)
                rows = item_table.item_table_page(session, job_id=self.job_id, ranks=self.query.ranks,
                                                  search=self.query.search, limit=EXPORT_PAGE, after=after)
                page = [item_view(item) for _, item in rows]
            if page:
                yield page
            if len(rows) < EXPORT_PAGE:
                return
            rank, last = rows[-1]
            after = (rank, last.position)


def item_export(
    session: Session,
    job_id: str,
    *,
    owner: str | None = None,
    format: str = "jsonl",
    status: str | None = None,
    q: str | None = None,
    order: str = "position",
) -> ItemExport:
    """Check the export's parameters and the job (400 and 404 come before any byte is sent)."""
    if format not in FORMATS:
        raise InvalidJobInput(f"unknown format {format!r}; use one of {', '.join(FORMATS)}", param="format")
    query = item_query(status, q, order)
    job = load_job(session, job_id, owner)
    return ItemExport(job.id, owner, format, query)


def _json(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # past 64 bits or a lone surrogate, stored before the API refused them
        return json.dumps(value, default=str, separators=(",", ":")).encode()


def _csv_row(view: dict[str, Any]) -> list[str]:
    """Strings as they are; anything else (numbers, objects, null) as JSON, so a cell reads back exactly."""
    return [value if isinstance(value, str) else _json(value).decode() for value in
            (view[column] for column in CSV_COLUMNS)]


def _csv_line(cells: Any) -> bytes:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerow(cells)
    return buffer.getvalue().encode("utf-8", "replace")
