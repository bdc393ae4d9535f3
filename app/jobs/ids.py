"""Identifiers that sort by creation time, so "newest first" and cursors are simple ``ORDER BY id``."""

from __future__ import annotations

import os
import time


def _time_ordered() -> str:
    # 13 hex digits of microseconds since the epoch, then 10 random hex digits
    return f"{time.time_ns() // 1000:013x}{os.urandom(5).hex()}"


def new_job_id() -> str:
    return f"job_{_time_ordered()}"


def new_file_id() -> str:
    return f"file-{_time_ordered()}"


def new_batch_id() -> str:
    return f"batch_{_time_ordered()}"


def new_training_id() -> str:
    return f"train_{_time_ordered()}"


def new_evaluation_id() -> str:
    return f"eval_{_time_ordered()}"


def new_schedule_id() -> str:
    return f"evsched_{_time_ordered()}"
