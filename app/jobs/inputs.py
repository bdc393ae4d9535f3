"""Reading batch inputs from JSONL: one item per line, each with a unique ``custom_id``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import json_limits


class InputFileError(ValueError):
    """The input file is missing or a line is not a valid item; the message names the line."""


@dataclass
class BatchItem:
    """One line: ``args``/``kwargs`` for the pipeline's forward, and the id results are keyed by."""

    custom_id: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def input(self) -> Any:
        if self.kwargs and not self.args:
            return self.kwargs
        return self.args[0] if len(self.args) == 1 else list(self.args)


def parse_item(data: Any, default_id: str) -> BatchItem:
    """A JSON value → item. Objects may hold ``custom_id`` and ``input`` (an object → keyword arguments, a list
    → positional ones, anything else → one argument); without ``input`` the other keys are keyword arguments.
    Any other JSON value is the single argument."""
    if not isinstance(data, dict):
        return BatchItem(default_id, (data,))
    custom_id = data.get("custom_id", default_id)
    if not isinstance(custom_id, str | int) or isinstance(custom_id, bool) or str(custom_id) == "":
        raise ValueError("custom_id must be a non-empty string")
    if "input" in data:
        value = data["input"]
        if isinstance(value, dict):
            return BatchItem(str(custom_id), (), dict(value))
        if isinstance(value, list):
            return BatchItem(str(custom_id), tuple(value))
        return BatchItem(str(custom_id), (value,))
    kwargs = {k: v for k, v in data.items() if k != "custom_id"}
    if not kwargs:
        raise ValueError("the item has no input: add an 'input' field")
    return BatchItem(str(custom_id), (), kwargs)


def parse_jsonl(text: str, *, source: str = "input") -> list[BatchItem]:
    items: list[BatchItem] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = parse_item(json_limits.loads(line), default_id=str(number))
        except json.JSONDecodeError as exc:
            raise InputFileError(f"{source}: line {number} is not valid JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:
            raise InputFileError(f"{source}: line {number}: {exc}") from None
        if item.custom_id in seen:
            raise InputFileError(f"{source}: line {number}: duplicate custom_id {item.custom_id!r}")
        seen.add(item.custom_id)
        items.append(item)
    if not items:
        raise InputFileError(f"{source} has no items")
    return items


def read_jsonl(path: str | Path) -> list[BatchItem]:
    file = Path(path)
    if not file.is_file():
        raise InputFileError(f"input file {file} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"input file {file} is not UTF-8 text") from None
    return parse_jsonl(text, source=str(file))
