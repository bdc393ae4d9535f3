"""The items of a job as a table: pages filtered by status and a text search, in input order or with chosen
statuses first, and how many items match.

A page reads one branch per status from the index on ``items(job_id, status, position)``, each already in
position order and cut at ``offset + limit`` rows, and merges them: a page of a 50,000-item job reads about a
page of rows per status instead of sorting the whole job (there is no index on ``(job_id, position)``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Integer, Select, Text, cast, func, literal, or_, select, union_all
from sqlalchemy.orm import Session

from app.db.models import Item

_LIKE_ESCAPE = "\\"


def item_table_page(
    session: Session,
    *,
    job_id: str,
    ranks: Mapping[str, int],
    search: str | None = None,
    offset: int = 0,
    limit: int = 50,
    after: tuple[int, int] | None = None,
) -> list[tuple[int, Item]]:
    """``(rank, item)`` pairs of the job's items whose status is a key of ``ranks``, ordered by rank, then by
    position; ``search`` keeps the items whose custom_id, input, output or error contain it (case-insensitive).
    ``after`` is the ``(rank, position)`` of the last row of the previous page (a keyset cursor, for exports)."""
    condition = search_condition(session, search)
    branches = [
        branch for status, rank in sorted(ranks.items(), key=lambda pair: (pair[1], pair[0]))
        if (branch := _branch(job_id, status, rank, condition, after, offset + limit)) is not None
    ]
    if not branches:
        return []
    merged = branches[0] if len(branches) == 1 else union_all(*branches)
    rows = merged.subquery("matching")
    page = (
        select(rows.c.id, rows.c.rank, rows.c.position)
        .order_by(rows.c.rank, rows.c.position)
        .offset(offset)
        .limit(limit)
        .subquery("page")
    )
    stmt = select(page.c.rank, Item).join(page, Item.id == page.c.id).order_by(page.c.rank, page.c.position)
    return [(int(row[0]), row[1]) for row in session.execute(stmt)]


def count_table_items(session: Session, *, job_id: str, statuses: Sequence[str], search: str | None = None) -> int:
    """How many of the job's items have one of ``statuses`` and match ``search``."""
    stmt = select(func.count()).select_from(Item).where(Item.job_id == job_id, Item.status.in_(list(statuses)))
    condition = search_condition(session, search)
    if condition is not None:
        stmt = stmt.where(condition)
    return int(session.scalar(stmt) or 0)


def _branch(
    job_id: str, status: str, rank: int, condition: ColumnElement[bool] | None, after: tuple[int, int] | None,
    limit: int,
) -> Select[Any] | None:
    stmt = select(Item.id.label("id"), literal(rank, Integer).label("rank"), Item.position.label("position"))
    stmt = stmt.where(Item.job_id == job_id, Item.status == status)
    if after is not None:
        after_rank, after_position = after
        if rank < after_rank:
            return None  # wholly before the cursor
        if rank == after_rank:
            stmt = stmt.where(Item.position > after_position)
    if condition is not None:
        stmt = stmt.where(condition)
    # wrapped: SQLite allows no ORDER BY or LIMIT on the members of a UNION
    inner = stmt.order_by(Item.position).limit(limit).subquery()
    return select(inner.c.id, inner.c.rank, inner.c.position)


def search_condition(session: Session, text: str | None) -> ColumnElement[bool] | None:
    """Items whose custom_id, input, output or error text contain ``text``, ignoring case. JSON columns are
    searched as the database stores their text, so the text is also sought as JSON writes it inside a string
    (quotes and backslashes escaped; on SQLite, whose JSON text is ASCII, non-ASCII characters as ``\\uXXXX``)."""
    if not text:
        return None
    ascii_json = session.get_bind().dialect.name == "sqlite"
    cases = {text} if text.isascii() else {text, text.lower(), text.upper()}  # LIKE folds only ASCII on SQLite
    forms = cases | {json.dumps(case, ensure_ascii=ascii_json)[1:-1] for case in cases}
    patterns = [f"%{_like_escaped(form)}%" for form in sorted(forms)]
    columns = [cast(Item.input, Text), cast(Item.output, Text), cast(Item.error, Text)]
    matches = [Item.custom_id.ilike(f"%{_like_escaped(case)}%", escape=_LIKE_ESCAPE) for case in sorted(cases)]
    matches += [column.ilike(pattern, escape=_LIKE_ESCAPE) for column in columns for pattern in patterns]
    return or_(*matches)


def _like_escaped(text: str) -> str:
    return text.replace(_LIKE_ESCAPE, _LIKE_ESCAPE * 2).replace("%", _LIKE_ESCAPE + "%").replace("_", _LIKE_ESCAPE + "_")
