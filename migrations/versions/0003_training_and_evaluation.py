"""Training and evaluation: trainings and their steps, evaluations, evaluation schedules, human feedback requests.

Revision ID: 0003
Revises: 0002
Create Date: 2026-02-12
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# spelled out here rather than imported from app.db, so this revision keeps meaning what it meant
JSONDoc = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    _create_training_and_schedule_tables()
    _create_evaluation_and_feedback_tables()


def _create_training_and_schedule_tables() -> None:
    op.create_table(
        "trainings",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("pipeline_id", BigId, nullable=False),
        sa.Column("pipeline_name", sa.String(300), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request", JSONDoc, nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("completed_steps", sa.Integer(), nullable=False),
        sa.Column("base_version", sa.Integer(), nullable=True),
        sa.Column("final_version", sa.Integer(), nullable=True),
        sa.Column("result", JSONDoc, nullable=True),
        sa.Column("error", JSONDoc, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"],
                                name=op.f("fk_trainings_pipeline_id_pipelines"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trainings")),
    )
    op.create_index("ix_trainings_status_id", "trainings", ["status", "id"])
    op.create_table(
        "training_steps",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("training_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("scores", JSONDoc, nullable=False),
        sa.Column("updates", JSONDoc, nullable=False),
        sa.Column("errors", JSONDoc, nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["training_id"], ["trainings.id"],
                                name=op.f("fk_training_steps_training_id_trainings"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_steps")),
        sa.UniqueConstraint("training_id", "step", name=op.f("uq_training_steps_training_id_step")),
    )
    op.create_table(
        "evaluation_schedules",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("pipeline_id", BigId, nullable=False),
        sa.Column("pipeline_name", sa.String(300), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("request", JSONDoc, nullable=False),
        sa.Column("cron", sa.String(200), nullable=False),
        sa.Column("margin", sa.Float(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("next_fire_at", TS, nullable=False),
        sa.Column("last_fire_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"],
                                name=op.f("fk_evaluation_schedules_pipeline_id_pipelines"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluation_schedules")),
    )
    op.create_index("ix_evaluation_schedules_enabled_next_fire_at", "evaluation_schedules",
                    ["enabled", "next_fire_at"])


def _create_evaluation_and_feedback_tables() -> None:
    op.create_table(
        "evaluations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("pipeline_id", BigId, nullable=False),
        sa.Column("pipeline_name", sa.String(300), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request", JSONDoc, nullable=False),
        sa.Column("schedule_id", sa.String(64), nullable=True),
        sa.Column("fire_time", TS, nullable=True),
        sa.Column("parameter_version", sa.Integer(), nullable=True),
        sa.Column("total_examples", sa.Integer(), nullable=False),
        sa.Column("completed_examples", sa.Integer(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("scores", JSONDoc, nullable=True),
        sa.Column("details", JSONDoc, nullable=True),
        sa.Column("error", JSONDoc, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"],
                                name=op.f("fk_evaluations_pipeline_id_pipelines"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["schedule_id"], ["evaluation_schedules.id"],
                                name=op.f("fk_evaluations_schedule_id_evaluation_schedules"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
        sa.UniqueConstraint("schedule_id", "fire_time", name=op.f("uq_evaluations_schedule_id_fire_time")),
    )
    op.create_index("ix_evaluations_status_id", "evaluations", ["status", "id"])
    op.create_table(
        "feedback_requests",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("training_id", sa.String(64), nullable=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request", JSONDoc, nullable=False),
        sa.Column("answer", JSONDoc, nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("answered_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["training_id"], ["trainings.id"],
                                name=op.f("fk_feedback_requests_training_id_trainings"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback_requests")),
    )
    op.create_index("ix_feedback_requests_status_created_at", "feedback_requests", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_feedback_requests_status_created_at", table_name="feedback_requests")
    op.drop_table("feedback_requests")
    op.drop_index("ix_evaluations_status_id", table_name="evaluations")
    op.drop_table("evaluations")
    op.drop_index("ix_evaluation_schedules_enabled_next_fire_at", table_name="evaluation_schedules")
    op.drop_table("evaluation_schedules")
    op.drop_table("training_steps")
    op.drop_index("ix_trainings_status_id", table_name="trainings")
    op.drop_table("trainings")
