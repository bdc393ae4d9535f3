"""Bounded, fair dispatch: a node task remembers when its message was sent (``sent_at``). Ready nodes not sent
yet wait in PostgreSQL until their queue's dispatch window has room; two partial indexes serve the dispatcher.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# spelled out here rather than imported from app.db, so this revision keeps meaning what it meant
UNSENT = "(status = 'queued' AND sent_at IS NULL)"
IN_FLIGHT = "(status = 'running' OR (status = 'queued' AND sent_at IS NOT NULL))"


def upgrade() -> None:
    with op.batch_alter_table("node_tasks") as batch:
        batch.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
    # every queued node of the old dispatch had its message sent with the row
    op.execute("UPDATE node_tasks SET sent_at = updated_at WHERE status = 'queued'")
    op.create_index(
        "ix_node_tasks_unsent",
        "node_tasks",
        ["job_id", "queue", "priority", "item_id"],
        postgresql_where=sa.text(UNSENT),
        sqlite_where=sa.text(UNSENT),
    )
    op.create_index(
        "ix_node_tasks_in_flight",
        "node_tasks",
        ["queue", "job_id"],
        postgresql_where=sa.text(IN_FLIGHT),
        sqlite_where=sa.text(IN_FLIGHT),
    )


def downgrade() -> None:
    op.drop_index("ix_node_tasks_in_flight", table_name="node_tasks")
    op.drop_index("ix_node_tasks_unsent", table_name="node_tasks")
    with op.batch_alter_table("node_tasks") as batch:
        batch.drop_column("sent_at")
