"""The op registry: every ``F.*`` op by name, so that code below ``app.pipeline.functional`` can reach the ops.

A leaf module. ``functional`` registers each op's eager implementation here as it defines it (``OPS``) and
installs itself as the namespace of the public ops; values (``value["key"]`` is ``F.select``) look ops up here
instead of importing ``functional``, which builds on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: op name ("F.render") -> (eager implementation, whether it accepts ERROR inputs)
OPS: dict[str, tuple[Callable[..., Any], bool]] = {}

_namespace: Any = None


def register(name: str, impl: Callable[..., Any], handles_errors: bool) -> None:
    """Record the eager implementation of op ``name`` (``"F.render"``)."""
    OPS[name] = (impl, handles_errors)


def install_namespace(namespace: Any) -> None:
    """Set where the public ops live (the ``app.pipeline.functional`` module)."""
    global _namespace
    _namespace = namespace


def public_op(name: str) -> Callable[..., Any]:
    """The public function ``F.<name>``, looked up at each call (so a patched ``F.select`` is the one used)."""
    if _namespace is None:
        raise RuntimeError(f"F.{name} is not available: app.pipeline.functional has not been imported")
    op: Callable[..., Any] = getattr(_namespace, name)
    return op
