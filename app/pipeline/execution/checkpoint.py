"""File checkpoints: completed node results appended to a JSONL file per execution, so a rerun resumes.

Each line is one record; the first is a header with the graph hash. Appending keeps a flush O(records), and a
crash loses at most the unflushed buffer. Node keys are ``<input fingerprint>/<node id>``, so a resumed batch
reuses a result only for the same item input.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.pipeline.execution.state import TaskResult
from app.pipeline.graph import decode_json, encode_json
from app.pipeline.values import Value, ValueKind

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    execution_id: str
    timestamp: float
    graph_hash: str
    completed_nodes: dict[str, TaskResult] = field(default_factory=dict)
    failed_nodes: dict[str, str] = field(default_factory=dict)
    pending_nodes: list[str] = field(default_factory=list)


def input_fingerprint(values: Any) -> str:
    """A stable short hash of one item's inputs (their payloads, not their refs)."""
    blob = json.dumps(encode_json(_payloads(values)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _payloads(obj: Any) -> Any:
    if isinstance(obj, Value):
        return obj.payload
    if isinstance(obj, dict):
        return {str(k): _payloads(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_payloads(v) for v in obj]
    return obj


class CheckpointManager:
    def __init__(self, dir: str | Path, buffer_size: int = 10, flush_interval: float = 60.0) -> None:
        if buffer_size < 1:
            raise ValueError("buffer_size must be at least 1")
        self.dir = Path(dir)
        self.buffer_size = buffer_size
        self.flush_interval = flush_interval
        self._hashes: dict[str, str] = {}
        self._buffers: dict[str, list[dict[str, Any]]] = {}
        self._last_flush: dict[str, float] = {}

    def path(self, execution_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in execution_id)
        return self.dir / f"{safe}.checkpoint.jsonl"

    def set_graph_hash(self, execution_id: str, graph_hash: str) -> None:
        """Start (or continue) an execution; an existing file for another graph is moved aside."""
        self._hashes[execution_id] = graph_hash
        self._buffers.setdefault(execution_id, [])
        self._last_flush.setdefault(execution_id, time.monotonic())
        path = self.path(execution_id)
        existing = self.load(execution_id)
        if existing is not None and existing.graph_hash == graph_hash:
            return
        if existing is not None:
            stale = path.with_suffix(f".stale-{int(time.time())}.jsonl")
            log.warning("checkpoint %s was for another graph (hash %s); moved to %s", path, existing.graph_hash, stale)
            path.rename(stale)
        self.dir.mkdir(parents=True, exist_ok=True)
        header = {"type": "header", "execution_id": execution_id, "graph_hash": graph_hash, "ts": time.time()}
        path.write_text(json.dumps(header) + "\n")

    def record_completion(self, execution_id: str, node_key: str, result: TaskResult) -> bool:
        """Buffer a completion; True when the buffer should be flushed now (size or interval reached)."""
        self._buffers.setdefault(execution_id, []).append(
            {
                "type": "completed",
                "node": node_key,
                "value": encode_json(result.value),
                "duration_ms": result.duration_ms,
                "retry_count": result.retry_count,
            }
        )
        return self._due(execution_id)

    def record_failure(self, execution_id: str, node_key: str, error: BaseException) -> bool:
        self._buffers.setdefault(execution_id, []).append(
            {"type": "failed", "node": node_key, "error": f"{type(error).__name__}: {error}"}
        )
        return self._due(execution_id)

    def _due(self, execution_id: str) -> bool:
        elapsed = time.monotonic() - self._last_flush.get(execution_id, 0.0)
        return len(self._buffers[execution_id]) >= self.buffer_size or elapsed >= self.flush_interval

    def flush_sync(self, execution_id: str) -> None:
        buffer = self._buffers.get(execution_id)
        self._last_flush[execution_id] = time.monotonic()
        if not buffer:
            return
        if execution_id not in self._hashes:
            raise RuntimeError(f"call set_graph_hash() for {execution_id!r} before recording results")
        lines = "".join(json.dumps(record) + "\n" for record in buffer)
        with self.path(execution_id).open("a") as fh:
            fh.write(lines)
        buffer.clear()

    async def flush(self, execution_id: str) -> None:
        self.flush_sync(execution_id)

    async def flush_all(self) -> None:
        for execution_id in list(self._buffers):
            self.flush_sync(execution_id)

    def load(self, execution_id: str) -> Checkpoint | None:
        path = self.path(execution_id)
        if not path.is_file():
            return None
        checkpoint: Checkpoint | None = None
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line after a crash: everything before it is valid
            if record.get("type") == "header":
                checkpoint = Checkpoint(execution_id, record.get("ts", 0.0), record["graph_hash"])
            elif checkpoint is not None and record.get("type") == "completed":
                value = decode_json(record["value"])
                if not isinstance(value, Value):
                    value = Value(ValueKind.OTHER, value)
                checkpoint.completed_nodes[record["node"]] = TaskResult(
                    record["node"], value, record.get("duration_ms", 0.0), record.get("retry_count", 0)
                )
                checkpoint.failed_nodes.pop(record["node"], None)
            elif checkpoint is not None and record.get("type") == "failed":
                checkpoint.failed_nodes[record["node"]] = record["error"]
        return checkpoint

    def completed_values(self, execution_id: str, graph_hash: str, fingerprint: str) -> dict[str, Value]:
        """Values of the nodes an earlier run completed for this item, when the graph is the same."""
        checkpoint = self.load(execution_id)
        if checkpoint is None or checkpoint.graph_hash != graph_hash:
            return {}
        prefix = f"{fingerprint}/"
        return {
            key[len(prefix) :]: result.value
            for key, result in checkpoint.completed_nodes.items()
            if key.startswith(prefix)
        }
