"""Every candidate a selection-gated training measured is history: a training step keeps the candidates it
proposed (text, parent, minibatch and validation scores, accepted or not) beside its scores.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# spelled out here rather than imported from app.db, so this revision keeps meaning what it meant
JSONDoc = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("training_steps") as batch:
        batch.add_column(sa.Column("candidates", JSONDoc, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_steps") as batch:
        batch.drop_column("candidates")
