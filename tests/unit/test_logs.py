"""The one JSON log format (app.logs): context fields always present, bound per request or task (issue 17)."""

from __future__ import annotations

import json
import logging

from app import logs
from workers.observability import job_id_of


def _line(msg: str = "hello", **extra: object) -> dict[str, object]:
    record = logging.LogRecord("x.y", logging.INFO, __file__, 1, msg, None, None)
    record.__dict__.update(extra)
    return json.loads(logs.JsonFormatter().format(record))


def test_every_line_has_the_context_fields() -> None:
    line = _line()
    assert {"ts", "level", "service", "logger", "msg", "request_id", "task_id", "job_id"} <= set(line)
    assert line["request_id"] is None and line["task_id"] is None and line["job_id"] is None


def test_bound_fields_appear_and_go_away() -> None:
    with logs.log_context(task_id="t1", job_id="job_1"):
        line = _line()
        assert (line["task_id"], line["job_id"]) == ("t1", "job_1")
    assert _line()["task_id"] is None


def test_record_extras_win_over_the_context() -> None:
    with logs.log_context(request_id="ctx"):
        assert _line(request_id="explicit", status=200)["request_id"] == "explicit"


def test_unknown_context_field_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError):
        logs.bind(user="x")


def test_job_id_of_node_tasks_and_keywords() -> None:
    assert job_id_of("inf.run_node", ["job_1", 3, "n", 1], {}) == "job_1"
    assert job_id_of("inf.other", [], {"job_id": "job_2"}) == "job_2"
    assert job_id_of("inf.sweep", [], {}) is None


def test_level_names() -> None:
    assert logs.level_name(20) == "INFO" and logs.level_name("debug") == "DEBUG" and logs.level_name(0) == "INFO"
