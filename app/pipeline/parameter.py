"""Parameter: a learnable value (usually a prompt) owned by a module, improved by optimizers from feedback."""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from app.pipeline.values import Value, ValueKind, _infer_kind


class ParameterOwner(Protocol):
    """The module a parameter is attached to (``app.pipeline.module.Module``), as far as the parameter needs it."""

    _module_state_version: int

    def _path(self) -> str: ...

    def _bump_state_version(self) -> None: ...


class Parameter:
    """A value that optimizers may rewrite. A learnable parameter must say what it is for (``description``)."""

    def __init__(self, value: Any, description: str | None = None, requires_grad: bool = True) -> None:
        if requires_grad and not (description and description.strip()):
            raise ValueError(
                "a learnable Parameter needs a description of what it does, so that an optimizer knows what "
                "to improve: Parameter(value, description='...'), or pass requires_grad=False to freeze it"
            )
        self.value = value
        self.description = description
        self.requires_grad = requires_grad
        self._name: str | None = None
        self._parent: ParameterOwner | None = None
        self._id = uuid.uuid4().hex[:12]
        self._feedback: list[str] = []

    # -- naming -----------------------------------------------------------------------------------------------
    @property
    def name(self) -> str | None:
        """The dotted name in the module tree (``encoder.prompt``), once the parameter is attached."""
        if self._name is None:
            return None
        if self._parent is None:
            return self._name
        prefix = self._parent._path()
        return f"{prefix}.{self._name}" if prefix else self._name

    @property
    def ref(self) -> str:
        return f"param:{self.name or self._id}"

    def as_value(self, kind: ValueKind | None = None) -> Value:
        """Lift into a Value whose ref is ``param:<dotted.name>``."""
        version = self._parent._module_state_version if self._parent is not None else 0
        return Value(
            kind or (ValueKind.TEXT if isinstance(self.value, str) else _infer_kind(self.value)),
            self.value,
            self.ref,
            {
                "param_name": self.name,
                "param_id": self._id,
                "module_state_version": version,
                "requires_grad": self.requires_grad,
            },
        )

    # -- feedback and updates -----------------------------------------------------------------------------------
    def accumulate_feedback(self, text: str) -> None:
        """Keep feedback for the next optimizer step (ignored for frozen parameters)."""
        if self.requires_grad and text:
            self._feedback.append(text)

    def get_accumulated_feedback(self) -> list[str]:
        return list(self._feedback)

    def zero_feedback(self) -> None:
        self._feedback.clear()

    def apply_update(self, new_value: Any) -> None:
        """Replace the value (an optimizer step): bumps the owner's state version and clears feedback."""
        self.value = new_value
        if self._parent is not None:
            self._parent._bump_state_version()
        self._feedback.clear()

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return (
            f"Parameter({self.value!r}, description={self.description!r}, requires_grad={self.requires_grad})"
        )
