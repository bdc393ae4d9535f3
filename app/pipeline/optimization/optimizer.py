"""Optimizers: turn the feedback accumulated in Parameters into new parameter values, with LLMs.

Like ``torch.optim``: ``Optimizer(module.parameters())``, then per batch ``zero_feedback()``, backward passes,
``await step()``. The LLMs use fixed aliases that the resources must configure: ``optimizer/aggregator`` merges
several feedback items of one parameter, ``optimizer/updater`` writes the new value, and ``optimizer/reasoning``
(only with ``reasoning_model``) helps modules' backward explain their feedback.

``SFAOptimizer`` updates parameters level by level in graph order: a parameter is updated after every learnable
parameter upstream of it, and its updater prompt shows those upstream changes (old and new values).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Self

import app.pipeline.optimization.state as state
from app.pipeline.optimization.llm import (
    AnswerProblem,
    ChatLLM,
    JudgeResponseError,
    missing_aliases,
    non_empty,
    resources_in_scope,
)
from app.pipeline.parameter import Parameter
from app.pipeline.resources.errors import ConfigurationError

_FENCED = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.DOTALL)
_TAGGED = re.compile(r"<new[-_]value>(.*?)</new[-_]value>", re.DOTALL | re.IGNORECASE)


@dataclass
class ParameterUpdate:
    """One parameter change of one ``step()``: what it was, what it became, and why. ``changed`` is False when
    the updater kept the value, or gave no usable answer (``error`` says why; the old value stays)."""

    name: str
    old_value: Any
    new_value: Any
    feedback: str
    feedback_items: list[str]
    scores: list[float]
    step: int
    level: int
    upstream: list[str] = field(default_factory=list)  # upstream parameters changed earlier in this step
    attempts: int = 0
    error: str | None = None

    @property
    def changed(self) -> bool:
        return self.error is None and self.new_value != self.old_value

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changed": self.changed}


class Optimizer:
    """Updates every parameter that has feedback, independently and concurrently (see SFAOptimizer for ordered,
    conservative updates). ``step()`` returns ``{name: new_value}``; ``last_updates`` and ``history`` keep the
    ParameterUpdates, and ``on_update(update)`` (sync or async) is called for each, e.g. to persist it."""

    AGGREGATOR_ALIAS = "optimizer/aggregator"
    UPDATER_ALIAS = "optimizer/updater"
    REASONING_ALIAS = "optimizer/reasoning"

    def __init__(
        self,
        params: Iterable[Parameter],
        *,
        reasoning_model: str | None = None,
        max_retries: int = 3,
        on_update: Callable[[ParameterUpdate], Any] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.params: list[Parameter] = []
        for param in params:
            if not isinstance(param, Parameter):
                raise TypeError(f"an optimizer takes Parameters (module.parameters()), got {type(param).__name__}")
            if not any(param is p for p in self.params):
                self.params.append(param)
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.max_retries = max_retries
        self.on_update = on_update
        self.reasoning_model = reasoning_model
        owner = type(self).__name__
        self.aggregator = ChatLLM(
            self.AGGREGATOR_ALIAS,
            "You merge several feedback items about one parameter of an LLM pipeline into one coherent, "
            "actionable summary: common themes first, conflicts resolved, concrete changes named.",
            owner=owner,
            max_tokens=max_tokens,
        )
        self.updater = ChatLLM(
            self.UPDATER_ALIAS,
            "You improve a text parameter of an LLM pipeline (usually a prompt) from feedback. Make the changes "
            "the feedback calls for and keep what works. Reply with the new value only.",
            owner=owner,
            temperature=0.7,  # a retry after an empty answer should not repeat it
            max_tokens=max_tokens,
        )
        self.reasoning_llm: ChatLLM | None = None
        if reasoning_model:
            self.reasoning_llm = ChatLLM(
                self.REASONING_ALIAS,
                "You analyse why an LLM pipeline's output received its feedback and which part of a parameter "
                "caused it.",
                owner=owner,
                max_tokens=max_tokens,
            )
        self.resources: Any = None
        self.step_count = 0
        self.last_updates: list[ParameterUpdate] = []
        self.history: list[ParameterUpdate] = []
        self._records: list[Any] = []

    # -- configuration --------------------------------------------------------------------------------------
    def required_aliases(self) -> list[str]:
        aliases = [self.AGGREGATOR_ALIAS, self.UPDATER_ALIAS]
        return aliases + ([self.REASONING_ALIAS] if self.reasoning_llm is not None else [])

    def _check_aliases(self, resources: Any) -> None:
        name = type(self).__name__
        if resources is None:
            raise ConfigurationError(
                f"{name} has no resources for its LLMs: call optimizer.bind(resources) or run inside "
                f"`ExecutionSettings(resources=...)`, with the aliases {self.required_aliases()} configured"
            )
        missing = missing_aliases(resources, self.required_aliases())
        if missing:
            example = ", ".join(f"{a!r}: EndpointConfig('openai', 'gpt-4o-mini')" for a in missing)
            raise ConfigurationError(
                f"{name} needs endpoints for the aliases {missing}, which the resources do not configure; add "
                f"them, e.g. ResourceConfig({{{example}, ...}}) (they may point at the same model as the pipeline)"
            )

    def bind(self, resources: Any) -> Self:
        """Use ``resources`` (ResourceConfig, dict or ResourceManager) for the optimizer's LLMs."""
        self._check_aliases(resources)
        self.resources = resources
        for llm in (self.aggregator, self.updater, self.reasoning_llm):
            if llm is not None:
                llm.bind(resources)
        return self

    # -- the feedback cycle -----------------------------------------------------------------------------------
    def zero_feedback(self) -> None:
        """Clear every parameter's accumulated feedback (and what backward noted about it): call before each
        batch, like ``zero_grad()``."""
        for param in self.params:
            param.zero_feedback()
            state.forget(param)
        self._records.clear()

    def capture_record(self, record: Any) -> None:
        """Called by backward with each forward record it walks (``feedback.backward(optimizer=...)``)."""
        if not any(record is r for r in self._records):
            self._records.append(record)

    async def step(self) -> dict[str, Any]:
        """Update every parameter with feedback; returns ``{name: new_value}`` for the parameters whose updater
        answered (unchanged values included)."""
        todo = [p for p in self.params if p.requires_grad and p.get_accumulated_feedback()]
        if not todo:
            self.last_updates = []
            return {}
        self._check_aliases(resources_in_scope(self.resources))
        self.step_count += 1
        before = {id(p): p.value for p in self.params}
        changed: dict[int, ParameterUpdate] = {}
        updates: list[ParameterUpdate] = []
        for level, group in enumerate(self._plan(todo)):
            # within a level the parameters are independent: ask for their updates concurrently
            async with asyncio.TaskGroup() as tasks:
                jobs = [tasks.create_task(self._update(p, level, before, changed)) for p in group]
            for param, job in zip(group, jobs, strict=True):
                update = job.result()
                if update.error is None:
                    param.apply_update(update.new_value)
                    if update.changed:
                        changed[id(param)] = update
                else:
                    param.zero_feedback()  # keep the value; the feedback was spent on a failed attempt
                state.forget(param)
                updates.append(update)
                await self._notify(update)
        self.last_updates = updates
        self.history.extend(updates)
        return {u.name: u.new_value for u in updates if u.error is None}

    async def _notify(self, update: ParameterUpdate) -> None:
        if self.on_update is not None:
            result = self.on_update(update)
            if inspect.isawaitable(result):
                await result

    # -- hooks for subclasses -------------------------------------------------------------------------------
    def _plan(self, params: list[Parameter]) -> list[list[Parameter]]:
        """Groups of parameters to update one after the other (the base optimizer: one group)."""
        return [params]

    def _upstream_changes(self, param: Parameter, changed: dict[int, ParameterUpdate]) -> list[ParameterUpdate]:
        return []

    def _guidelines(self) -> str:
        return "Make the changes the feedback calls for; keep what already works."

    # -- one parameter ----------------------------------------------------------------------------------------
    async def _update(
        self, param: Parameter, level: int, before: dict[int, Any], changed: dict[int, ParameterUpdate]
    ) -> ParameterUpdate:
        items = param.get_accumulated_feedback()
        ctx = state.peek(param)
        upstream = self._upstream_changes(param, changed)
        update = ParameterUpdate(
            name=param.name or param.ref,
            old_value=before.get(id(param), param.value),
            new_value=param.value,
            feedback="",
            feedback_items=list(items),
            scores=list(ctx.scores) if ctx is not None else [],
            step=self.step_count,
            level=level,
            upstream=[u.name for u in upstream],
        )
        update.feedback = await self._aggregate(param, items)
        prompt = self._update_prompt(param, update.feedback, upstream)
        attempts = 0

        def parse(text: str) -> Any:
            nonlocal attempts
            attempts += 1
            return _clean_value(text, param.value)

        try:
            update.new_value = await self.updater.ask(prompt, parse, attempts=self.max_retries + 1,
                                                      what=f"a new value for {update.name}")
        except JudgeResponseError as exc:
            update.error = str(exc)
            update.new_value = param.value
        update.attempts = attempts
        return update

    async def _aggregate(self, param: Parameter, items: list[str]) -> str:
        if len(items) == 1:
            return items[0]
        listing = "\n".join(f'<feedback index="{i + 1}">\n{text}\n</feedback>' for i, text in enumerate(items))
        prompt = (
            f"Parameter: {_label(param)}\nDescription: {param.description}\nCurrent value:\n{param.value}\n\n"
            f"{len(items)} feedback items:\n{listing}\n\n"
            "Summarise them into one paragraph of specific, actionable recommendations for this parameter."
        )
        try:
            return await self.aggregator.ask(prompt, non_empty, attempts=self.max_retries + 1,
                                             what="a feedback summary")
        except JudgeResponseError:
            # the raw items still carry everything the updater needs
            return "\n\n".join(items)

    def _update_prompt(self, param: Parameter, feedback: str, upstream: list[ParameterUpdate]) -> str:
        parts = [
            f"Parameter: {_label(param)}",
            f"Description: {param.description}",
            f"Current value:\n<current-value>\n{param.value}\n</current-value>",
            f"Feedback:\n{feedback}",
        ]
        if upstream:
            changes = "\n\n".join(
                f"Upstream parameter: {u.name}\nPrevious value:\n{u.old_value}\nUpdated value:\n{u.new_value}"
                for u in upstream
            )
            parts.append(
                "These parameters come earlier in the pipeline and were already updated in this step; keep this "
                f"parameter consistent with their new values:\n{changes}"
            )
        parts.append(f"Task: write an improved value for {_label(param)} ({param.description}) that addresses the "
                     f"feedback. Guidelines: {self._guidelines()}")
        parts.append("Reply with the complete new value only: no explanation, no quotes, no markdown.")
        return "\n\n".join(parts)


class SFAOptimizer(Optimizer):
    """Stochastic feedback ascent: small, feedback-driven edits in graph order.

    Parameters are updated level by level: level 0 has no learnable parameter upstream of it in the recorded
    graphs; level k waits for levels below it, and its updater prompts show those upstream changes.
    ``conservatism`` in [0, 1] says how much to preserve (1: minimal edits, 0: free rewrites); ``max_retries``
    re-asks an updater that answered with nothing (after that the old value stays and the update reports an
    error)."""

    def __init__(
        self,
        params: Iterable[Parameter],
        conservatism: float = 0.7,
        max_retries: int = 3,
        *,
        reasoning_model: str | None = None,
        on_update: Callable[[ParameterUpdate], Any] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        if not 0.0 <= conservatism <= 1.0:
            raise ValueError(f"conservatism must be within [0, 1] (1 = minimal changes), got {conservatism}")
        super().__init__(params, reasoning_model=reasoning_model, max_retries=max_retries, on_update=on_update,
                         max_tokens=max_tokens)
        self.conservatism = conservatism

    def _plan(self, params: list[Parameter]) -> list[list[Parameter]]:
        return update_levels(params)

    def _upstream_changes(self, param: Parameter, changed: dict[int, ParameterUpdate]) -> list[ParameterUpdate]:
        ctx = state.peek(param)
        if ctx is None:
            return []
        return [changed[key] for key in ctx.upstream if key in changed]

    def _guidelines(self) -> str:
        c = self.conservatism
        if c >= 0.8:
            how = "make the smallest edit that addresses the feedback; keep the wording and change or add at most a sentence"
        elif c >= 0.5:
            how = "make targeted edits that address the feedback; keep the structure and everything that works"
        elif c >= 0.2:
            how = "rework the parts the feedback criticises, substantially if needed"
        else:
            how = "rewrite the value freely if that serves the feedback better"
        return f"conservatism {c:.2f} (0 = free rewrite, 1 = minimal change): {how}."


def update_levels(params: list[Parameter]) -> list[list[Parameter]]:
    """Order parameters into levels: each after every parameter recorded upstream of it (within ``params``)."""
    ids = {id(p): p for p in params}
    upstream: dict[int, set[int]] = {}
    for param in params:
        ctx = state.peek(param)
        upstream[id(param)] = {key for key in (ctx.upstream if ctx else {}) if key in ids and key != id(param)}
    depth: dict[int, int] = {}
    for param in params:
        ctx = state.peek(param)
        depth[id(param)] = ctx.depth if ctx is not None and ctx.depth is not None else 0
    levels: list[list[Parameter]] = []
    done: set[int] = set()
    while len(done) < len(params):
        level = [p for p in params if id(p) not in done and upstream[id(p)] <= done]
        if not level:
            # parameters upstream of each other in different graphs: take the shallowest first
            remaining = [p for p in params if id(p) not in done]
            shallowest = min(depth[id(p)] for p in remaining)
            level = [p for p in remaining if depth[id(p)] == shallowest]
        levels.append(level)
        done.update(id(p) for p in level)
    return levels


def _clean_value(text: str, current: Any) -> Any:
    """The updater's answer as a parameter value: fences, tags and wrapping quotes removed; not empty; for a
    non-string parameter, JSON of the same type."""
    value = text.strip()
    tagged = _TAGGED.search(value)
    if tagged:
        value = tagged.group(1).strip()
    fenced = _FENCED.match(value)
    if fenced:
        value = fenced.group(1).strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" and value.count(value[0]) == 2:
        value = value[1:-1].strip()
    if not value:
        raise AnswerProblem("the answer was empty; reply with the complete new value")
    if isinstance(current, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise AnswerProblem(f"this parameter holds a {type(current).__name__}; reply with it as JSON") from None
    if type(parsed) is not type(current) and not (isinstance(current, float) and isinstance(parsed, int)):
        raise AnswerProblem(f"expected a {type(current).__name__} as JSON, got a {type(parsed).__name__}")
    return parsed


def _label(param: Parameter) -> str:
    """How prompts name a parameter: its dotted name, or "the parameter" when it belongs to no module."""
    return param.name or "the parameter"
