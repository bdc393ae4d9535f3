"""Outputs produced in training mode carry the forward record that backward needs."""

from __future__ import annotations

from typing import Any


class TracedOutput:
    """A training-mode output: behaves like its ``value`` in comparisons and str(), and keeps ``record``."""

    __slots__ = ("record", "value")

    def __init__(self, value: Any, record: Any) -> None:
        self.value = value
        self.record = record

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return f"TracedOutput({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return self.value == (other.value if isinstance(other, TracedOutput) else other)

    def __hash__(self) -> int:
        return hash(self.value)

    def __getitem__(self, key: Any) -> Any:
        return self.value[key]


def unwrap_output(output: Any) -> Any:
    return output.value if isinstance(output, TracedOutput) else output


def split_output(output: Any, record: Any = None) -> tuple[Any, Any]:
    """``(value, record)`` of an output: a TracedOutput carries its record; an explicit ``record`` wins."""
    if isinstance(output, TracedOutput):
        return output.value, record if record is not None else output.record
    return output, record
