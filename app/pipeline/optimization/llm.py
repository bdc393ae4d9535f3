"""The LLM calls that losses and optimizers make themselves (judges, aggregator, updater, reasoning).

Each is a private ``LLMInference`` run through the normal runtime (rate limits, retries on transient errors,
profiling), bound to the owner's resources or, failing that, to the active ``ExecutionSettings``. Answers that
must be structured are parsed leniently (code fences, prose around the JSON), validated, and re-asked with the
problem spelled out; after the last attempt a ``JudgeResponseError`` says what was wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from app.pipeline.resources.errors import ConfigurationError

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)


class JudgeResponseError(ValueError):
    """An LLM used by a loss or an optimizer kept answering in a form that could not be used."""


class AnswerProblem(ValueError):
    """One unusable answer; the message is sent back to the LLM when it is asked again."""


def missing_aliases(resources: Any, aliases: list[str]) -> list[str]:
    """The aliases that ``resources`` certainly lacks (a ResourceConfig, a dict, or a manager with
    ``has_alias``); anything else (a scripted fake) cannot be checked ahead and reports none."""
    if resources is None:
        return list(aliases)
    if isinstance(resources, Mapping):
        return [a for a in aliases if a not in resources]
    has_alias = getattr(resources, "has_alias", None)
    if callable(has_alias):
        return [a for a in aliases if not has_alias(a)]
    return []


def resources_in_scope(bound: Any) -> Any:
    """The resources an internal call would use: the bound ones, else the active ExecutionSettings' ones."""
    if bound is not None:
        return bound
    from app.pipeline.run_settings import get_execution_settings

    settings = get_execution_settings()
    return settings.resources if settings is not None else None


class ChatLLM:
    """One internal LLM role: ``await llm(prompt) -> str``."""

    def __init__(
        self,
        alias: str,
        system_prompt: str,
        *,
        owner: str,
        temperature: float = 0.0,
        max_tokens: int | None = None,
    ) -> None:
        from app.pipeline.llm import LLMInference

        self.alias = alias
        self.owner = owner
        self.module = LLMInference(alias, system_prompt=system_prompt, temperature=temperature,
                                   max_tokens=max_tokens)
        self.resources: Any = None

    @property
    def system_prompt(self) -> str:
        return str(self.module.system_prompt.value)

    def bind(self, resources: Any) -> None:
        self.resources = resources
        self.module.bind(resources)

    async def __call__(self, prompt: str) -> str:
        from app.pipeline.record import unwrap_output

        resources = resources_in_scope(self.resources)
        if resources is None:
            raise ConfigurationError(
                f"{self.owner} calls an LLM under the alias {self.alias!r} but has no resources: call "
                f"{self.owner}.bind(resources) or run it inside `ExecutionSettings(resources=...)`, with "
                f"{self.alias!r} configured"
            )
        if missing_aliases(resources, [self.alias]):
            raise ConfigurationError(
                f"{self.owner} needs an endpoint for the alias {self.alias!r}, which the resources do not "
                f"configure; add it, e.g. ResourceConfig({{{self.alias!r}: EndpointConfig('openai', "
                "'gpt-4o-mini'), ...})"
            )
        output = await self.module(prompt)
        text = unwrap_output(output)
        return text if isinstance(text, str) else str(text)

    async def ask(self, prompt: str, parse: Callable[[str], T], *, attempts: int, what: str) -> T:
        """Ask until ``parse`` accepts the answer (it raises AnswerProblem otherwise), at most ``attempts``
        times; each retry tells the LLM what was wrong with its previous answer."""
        attempts = max(1, attempts)
        question, last_answer, problem = prompt, "", ""
        for _ in range(attempts):
            last_answer = await self(question)
            try:
                return parse(last_answer)
            except AnswerProblem as exc:
                problem = str(exc)
                question = (
                    f"{prompt}\n\nYour previous answer could not be used: {problem}\n"
                    "Answer again, following the required format exactly."
                )
        shown = last_answer if len(last_answer) <= 400 else last_answer[:400] + "..."
        raise JudgeResponseError(
            f"{self.owner}: the LLM under alias {self.alias!r} did not give {what} in {attempts} attempt(s); "
            f"last problem: {problem}; last answer: {shown!r}. Use a model that follows the format "
            "instructions, or allow more attempts (max_retries)"
        )


def non_empty(text: str) -> str:
    """Accept any answer with visible text (an LLM sometimes returns nothing)."""
    cleaned = text.strip()
    if not cleaned:
        raise AnswerProblem("the answer was empty")
    return cleaned


def extract_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in an answer: inside a code fence, or the first parseable ``{...}`` in prose."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        for start in (i for i, ch in enumerate(candidate) if ch == "{"):
            try:
                obj, _ = decoder.raw_decode(candidate[start:])
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    if not text.strip():
        raise AnswerProblem("the answer was empty; a JSON object was required")
    raise AnswerProblem("no JSON object was found in the answer")


def parse_model(text: str, model: type[M]) -> M:
    """Parse and validate an answer against a pydantic model, with the problem phrased for the LLM."""
    data = extract_json_object(text)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'object'}: {err['msg']}" for err in exc.errors()
        )
        raise AnswerProblem(f"the JSON object is invalid ({problems})") from None


def schema_hint(model: type[BaseModel]) -> str:
    """The fields an answer must have, for the instructions given to a judge."""
    fields = ", ".join(f'"{name}"' for name in model.model_fields)
    return f"Answer with one JSON object with the fields {fields} and nothing else."
