"""The initial job platform schema: pipelines, graph nodes, jobs, items, node results, job metrics,
parameter versions and files.

Revision ID: 0001
Revises:
Create Date: 2026-02-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# spelled out here rather than imported from app.db, so this revision keeps meaning what it meant
JSONDoc = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    _create_pipeline_and_job_tables()
    _create_item_and_result_tables()


def _create_pipeline_and_job_tables() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(500), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_table(
        "pipelines",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("name", sa.String(300), nullable=False),
        sa.Column("import_path", sa.String(500), nullable=False),
        sa.Column("graph", JSONDoc, nullable=True),
        sa.Column("graph_hash", sa.String(64), nullable=True),
        sa.Column("parameter_state", JSONDoc, nullable=False),
        sa.Column("parameter_version", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pipelines")),
        sa.UniqueConstraint("name", name=op.f("uq_pipelines_name")),
    )
    op.create_table(
        "graph_nodes",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("pipeline_id", BigId, nullable=False),
        sa.Column("graph_hash", sa.String(64), nullable=False),
        sa.Column("node_id", sa.String(300), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("type", sa.String(500), nullable=True),
        sa.Column("module_path", sa.String(500), nullable=False),
        sa.Column("alias", sa.String(200), nullable=True),
        sa.Column("dependencies", JSONDoc, nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"], name=op.f("fk_graph_nodes_pipeline_id_pipelines"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_graph_nodes")),
        sa.UniqueConstraint("pipeline_id", "graph_hash", "node_id",
                            name=op.f("uq_graph_nodes_pipeline_id_graph_hash_node_id")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("pipeline_id", BigId, nullable=False),
        sa.Column("pipeline_name", sa.String(300), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("metadata", JSONDoc, nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=True),
        sa.Column("total_items", sa.Integer(), nullable=False),
        sa.Column("completed_items", sa.Integer(), nullable=False),
        sa.Column("failed_items", sa.Integer(), nullable=False),
        sa.Column("cancelled_items", sa.Integer(), nullable=False),
        sa.Column("results_seq", sa.Integer(), nullable=False),
        sa.Column("error", JSONDoc, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("cancelling_at", TS, nullable=True),
        sa.Column("cancelled_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("failed_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("expires_at", TS, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"], name=op.f("fk_jobs_pipeline_id_pipelines")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("owner", "idempotency_key", name=op.f("uq_jobs_owner_idempotency_key")),
    )
    op.create_index("ix_jobs_status_priority_id", "jobs", ["status", "priority", "id"])


def _create_item_and_result_tables() -> None:
    op.create_table(
        "parameter_versions",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("pipeline_id", BigId, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("state", JSONDoc, nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("metadata", JSONDoc, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["pipeline_id"], ["pipelines.id"],
                                name=op.f("fk_parameter_versions_pipeline_id_pipelines"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_parameter_versions")),
        sa.UniqueConstraint("pipeline_id", "version", name=op.f("uq_parameter_versions_pipeline_id_version")),
    )
    op.create_table(
        "items",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("custom_id", sa.String(255), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("input", JSONDoc, nullable=False),
        sa.Column("output", JSONDoc, nullable=True),
        sa.Column("error", JSONDoc, nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("graph_hash", sa.String(64), nullable=True),
        sa.Column("result_seq", sa.Integer(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_items_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_items")),
        sa.UniqueConstraint("job_id", "custom_id", name=op.f("uq_items_job_id_custom_id")),
    )
    op.create_index("ix_items_job_id_result_seq", "items", ["job_id", "result_seq"])
    op.create_index("ix_items_job_id_status_position", "items", ["job_id", "status", "position"])
    op.create_table(
        "job_metrics",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("llm_calls", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.Float(), nullable=False),
        sa.Column("latency_ms_total", sa.Float(), nullable=False),
        sa.Column("latency_ms_max", sa.Float(), nullable=False),
        sa.Column("trace", JSONDoc, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_metrics_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_job_metrics")),
    )
    op.create_table(
        "node_results",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("item_id", sa.BigInteger(), nullable=False),
        sa.Column("node_id", sa.String(300), nullable=False),
        sa.Column("value", JSONDoc, nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["item_id"], ["items.id"], name=op.f("fk_node_results_item_id_items"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_node_results_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_results")),
        sa.UniqueConstraint("job_id", "item_id", "node_id", name=op.f("uq_node_results_job_id_item_id_node_id")),
    )
    op.create_index(op.f("ix_node_results_item_id"), "node_results", ["item_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_node_results_item_id"), table_name="node_results")
    op.drop_table("node_results")
    op.drop_table("job_metrics")
    op.drop_index("ix_items_job_id_status_position", table_name="items")
    op.drop_index("ix_items_job_id_result_seq", table_name="items")
    op.drop_table("items")
    op.drop_table("parameter_versions")
    op.drop_index("ix_jobs_status_priority_id", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("graph_nodes")
    op.drop_table("pipelines")
    op.drop_table("files")
