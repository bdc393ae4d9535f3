"""Few-shot demonstrations: a Parameter holding ``{"input": ..., "output": ...}`` examples that an LLM call shows
the model before its real input, as alternating user and assistant turns after the system prompt.

    self.classify = LLMInference("assistant", system_prompt=..., demos=Demonstrations(
        [{"input": "Broke in a week.", "output": "negative"}],
        description="Labelled reviews shown to the classifier before the review to label",
    ))

An input is rendered as the call's real prompt would be (text as is, data as JSON with sorted keys); an output as
the model should answer (text as is, data as JSON in its own key order, as a schema-constrained answer comes).
Demonstrations are data, so the value stays JSON: a parameter version stores and restores them like a prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from app.pipeline.parameter import Parameter

Demo = dict[str, Any]


def as_text(payload: Any, *, sort_keys: bool = True) -> str:
    """How a payload reads in a chat message: text as is, data as JSON, anything else as ``str()``."""
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict | list):
        return json.dumps(payload, ensure_ascii=False, sort_keys=sort_keys, default=str)
    return str(payload)


def normalise_demos(demos: Any) -> list[Demo]:
    """``demos`` as a fresh list of ``{"input", "output"}`` dicts of JSON data; a ValueError says what is wrong."""
    if isinstance(demos, str | bytes | Mapping) or not isinstance(demos, Iterable):
        raise ValueError(
            f"demonstrations are a list of {{'input': ..., 'output': ...}} dicts, got {type(demos).__name__}"
        )
    out: list[Demo] = []
    for index, demo in enumerate(demos):
        if not isinstance(demo, Mapping) or set(demo) != {"input", "output"}:
            keys = sorted(map(str, demo)) if isinstance(demo, Mapping) else type(demo).__name__
            raise ValueError(f"demonstration {index} must have exactly the keys 'input' and 'output', got {keys}")
        try:  # a round trip through JSON: the value must survive a parameter version, and no caller's list aliases it
            out.append(json.loads(json.dumps({"input": demo["input"], "output": demo["output"]})))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"demonstration {index} is not JSON data: {exc}") from None
    return out


def demo_messages(demos: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The demonstrations as chat turns: a user message with each input, an assistant message with its output."""
    messages: list[dict[str, str]] = []
    for demo in demos:
        messages.append({"role": "user", "content": as_text(demo["input"])})
        messages.append({"role": "assistant", "content": as_text(demo["output"], sort_keys=False)})
    return messages


class Demonstrations(Parameter):
    """A learnable list of few-shot demonstrations (``[{"input": ..., "output": ...}, ...]``), in the order shown.

    Every assignment of ``value`` (construction, ``load_state_dict``, an optimizer's ``apply_update``) is checked
    and copied, so a bad value fails where it is set rather than when a request is built."""

    def __init__(
        self,
        demos: Iterable[Mapping[str, Any]] = (),
        description: str | None = None,
        requires_grad: bool = True,
    ) -> None:
        super().__init__(demos, description=description, requires_grad=requires_grad)

    @property  # type: ignore[override]  # Parameter.value is a plain attribute; here it is checked on every set
    def value(self) -> list[Demo]:
        return self._demos

    @value.setter
    def value(self, demos: Any) -> None:
        self._demos = normalise_demos(demos)

    def messages(self) -> list[dict[str, str]]:
        """Alternating user/assistant messages, one pair per demonstration, in order."""
        return demo_messages(self._demos)

    def __repr__(self) -> str:
        return (
            f"Demonstrations({self._demos!r}, description={self.description!r}, "
            f"requires_grad={self.requires_grad})"
        )
