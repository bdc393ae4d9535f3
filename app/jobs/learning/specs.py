"""The declarative parts of training and evaluation requests: datasets, losses (or metrics) and optimizers.

A request carries JSON; these functions check it (every problem is an ``InvalidJobInput`` naming the field) and
build the objects of ``app.pipeline.optimization`` from it. Loss specs:

* ``{"type": "verifier", "check": "exact"|"contains"|"regex"|"number"|"fields", "field": "verdict",
  "case_sensitive": false, "pattern": "..."}``: code compares the output (or one field of a dict output) with the
  example's target (``fields``: a structured output against a target dict, scored by the share of fields right);
  ``{"type": "verifier", "function": "name"}`` uses a verifier function the operator registered instead;
* ``{"type": "rubric", "criteria": "...", "rubric": {"1": "poor", "5": "excellent"}, "alias": "judge"}``;
* ``{"type": "judge", "criteria": "...", "alias": "judge"}`` (critique, no score);
* ``{"type": "preference", "criteria": "...", "alias": "judge"}`` (the output against the target as baseline);
* ``{"type": "composite", "losses": [{"loss": {...}, "weight": 0.3}, ...]}``;
* ``{"type": "human", "kind": "freeform"|"rubric"|"preference", "criteria": "...", "rubric": {...}}`` (trainings
  only: the questions appear at ``GET /v1/feedback/pending`` and are answered with ``POST /v1/feedback/{id}``);
* ``{"type": "python", "name": "my-loss", "options": {...}}``: a loss the operator registered (``app.jobs.registry``:
  a Loss instance, a Loss subclass or a factory returning one, built with ``options`` as keyword arguments).

A metric (evaluations) is the name of a verifier check (``"exact"``, ``"contains"``, ``"regex"``, ``"number"``,
``"fields"``)
or of a verifier function the operator registered. Nothing a request names is imported.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from app import json_limits
from app.jobs.errors import InvalidJobInput, PayloadTooLarge
from app.jobs.inputs import InputFileError
from app.jobs.registry import UnknownNameError, current_registry
from app.pipeline.optimization import (
    CompositeLoss,
    Example,
    FeedbackSource,
    HumanFeedbackLoss,
    HumanPreferenceLoss,
    HumanRubricLoss,
    LLMJudge,
    LLMPreferenceLoss,
    LLMRubricLoss,
    Loss,
    Optimizer,
    SelectionOptimizer,
    SFAOptimizer,
    VerifierLoss,
    field_match,
)
from app.pipeline.optimization.training import as_example

CHECKS = ("exact", "contains", "regex", "number", "fields")
LOSS_TYPES = ("verifier", "rubric", "judge", "preference", "composite", "human", "python")
OPTIMIZER_TYPES = ("gepa", "sfa", "basic")

#: what builds a human-feedback source for a training (None where human feedback cannot be asked: evaluations)
HumanSourceFactory = Callable[[], FeedbackSource] | None


# -- datasets ---------------------------------------------------------------------------------------------------
def dataset_name(dataset: Any) -> str | None:
    """The registered dataset a request names (``"sentiment:train"`` or ``{"name": "sentiment:train"}``), else
    None. A bare string is a name only when the operator registered it: otherwise it is an uploaded file's id."""
    if isinstance(dataset, Mapping) and set(dataset) == {"name"} and isinstance(dataset["name"], str):
        return str(dataset["name"])
    if isinstance(dataset, str) and dataset in current_registry().datasets:
        return dataset
    return None


def named_examples(name: str, *, param: str, max_items: int) -> list[Example]:
    """The examples of a registered dataset, checked like inline ones; an unknown name lists the known ones."""
    try:
        values = current_registry().dataset(name)
    except UnknownNameError as exc:
        raise InvalidJobInput(f"{param}: {exc}", param=param, code="unknown_dataset") from None
    return parse_examples(values, param=param, max_items=max_items)


def dataset_file_id(dataset: Any) -> str | None:
    """The uploaded file a dataset names (``"file-..."`` or ``{"file_id": "file-..."}``), else None."""
    if isinstance(dataset, str):
        return dataset
    if isinstance(dataset, Mapping) and set(dataset) == {"file_id"} and isinstance(dataset["file_id"], str):
        return str(dataset["file_id"])
    return None


def parse_examples(values: Any, *, param: str, max_items: int) -> list[Example]:
    """Examples from a JSON list: ``{"input": x, "target": y}``, ``{"inputs": {...}, "target": y}`` or
    ``[input, target]``."""
    if not isinstance(values, list) or not values:
        raise InvalidJobInput(
            f"{param} must be a non-empty list of examples like {{\"input\": ..., \"target\": ...}}, or the id of "
            "an uploaded JSONL file with one example per line",
            param=param,
        )
    if len(values) > max_items:
        raise PayloadTooLarge(
            f"{param} has {len(values)} examples; at most {max_items} are accepted (INF_ENGINE_JOBS_MAX_ITEMS)",
            param=param,
        )
    examples = []
    for index, value in enumerate(values):
        try:
            examples.append(as_example(value))
        except (TypeError, ValueError) as exc:
            raise InvalidJobInput(f"{param}[{index}]: {exc}", param=param) from None
    return examples


def examples_from_jsonl(text: str, *, source: str, param: str, max_items: int) -> list[Example]:
    values: list[Any] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values.append(json_limits.loads(line))
        except json.JSONDecodeError as exc:
            raise InvalidJobInput(f"{source}: line {number} is not valid JSON ({exc.msg})", param=param) from None
        except json_limits.JSONLimitError as exc:
            raise InvalidJobInput(f"{source}: line {number}: {exc}", param=param) from None
    if not values:
        raise InvalidJobInput(f"{source} has no examples", param=param)
    return parse_examples(values, param=param, max_items=max_items)


def decode_file(content: bytes, file_id: str) -> str:
    try:
        return bytes(content).decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"file {file_id} is not UTF-8 text") from None


# -- losses -----------------------------------------------------------------------------------------------------
@dataclass
class BuiltLoss:
    loss: Loss
    aliases: list[str] = field(default_factory=list)  # endpoint aliases its LLMs call
    human: bool = False


def loss_spec_of(loss: Any, metric: Any, *, param: str = "loss") -> dict[str, Any]:
    """The one loss spec of a request that gives ``loss`` or ``metric`` (a metric is a verifier shorthand)."""
    if isinstance(loss, str) and metric is None:  # a loss given by name is a metric
        loss, metric = None, loss
    if isinstance(metric, Mapping) and loss is None:  # a metric given as a spec is a loss
        loss, metric = metric, None
    if (loss is None) == (metric is None):
        raise InvalidJobInput("give exactly one of 'loss' (a loss spec) or 'metric' (e.g. \"exact\")", param=param)
    if metric is not None:
        if not isinstance(metric, str) or not metric.strip():
            raise InvalidJobInput(f"metric must be one of {', '.join(CHECKS)} or the name of a registered verifier",
                                  param="metric")
        metric = metric.strip()
        if metric in CHECKS:
            return {"type": "verifier", "check": metric}
        registry = current_registry()
        if metric not in registry.metrics:
            raise InvalidJobInput(
                f"unknown metric {metric!r}: registered metrics: {', '.join([*CHECKS, *sorted(registry.metrics)])} "
                "(an operator registers more with INF_ENGINE_PIPELINE_MODULES or an 'inf_engine.metrics' entry point)",
                param="metric", code="unknown_metric")
        return {"type": "verifier", "function": metric}
    if not isinstance(loss, Mapping):
        raise InvalidJobInput("loss must be an object such as {\"type\": \"verifier\", \"check\": \"exact\"}",
                              param=param)
    return dict(loss)


def build_loss(spec: Any, *, human: HumanSourceFactory = None, param: str = "loss") -> BuiltLoss:
    """The Loss a spec describes; raises InvalidJobInput with the field at fault."""
    if not isinstance(spec, Mapping):
        raise InvalidJobInput(f"{param} must be an object with a 'type' ({', '.join(LOSS_TYPES)})", param=param)
    kind = spec.get("type")
    try:
        if kind == "verifier":
            return BuiltLoss(_verifier(spec, param))
        if kind in ("rubric", "judge", "preference"):
            return _judge(kind, spec, param)
        if kind == "composite":
            return _composite(spec, human, param)
        if kind == "human":
            return _human(spec, human, param)
        if kind == "python":
            return BuiltLoss(_python_loss(spec, param))
    except InvalidJobInput:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise InvalidJobInput(f"{param}: {exc}", param=param) from None
    raise InvalidJobInput(f"{param}.type must be one of {', '.join(LOSS_TYPES)}, got {kind!r}", param=param)


def require_scores(spec: Mapping[str, Any], *, param: str = "loss") -> None:
    """Reject a loss that gives critique without a score where the optimizer selects by score (``gepa``)."""
    reason = _scoreless(spec)
    if reason is not None:
        raise InvalidJobInput(
            f"the gepa optimizer accepts a candidate only when its score beats its parent's, and {reason} gives "
            "critique without a score: use a verifier, rubric or preference loss (a composite needs one scored "
            "part), or choose {\"type\": \"sfa\"} as the optimizer", param=param)


def _scoreless(spec: Mapping[str, Any]) -> str | None:
    """Why a (checked) loss spec never scores, or None when it does."""
    kind = spec.get("type")
    if kind == "judge":
        return "a judge loss"
    if kind == "human" and spec.get("kind", "freeform") == "freeform":
        return "a freeform human loss"
    if kind == "composite":
        parts = [p["loss"] for p in spec.get("losses") or [] if isinstance(p, Mapping) and "loss" in p]
        if parts and all(isinstance(p, Mapping) and _scoreless(p) for p in parts):
            return "a composite of unscored losses"
    return None


def _text(spec: Mapping[str, Any], key: str, param: str, *, required: bool = True) -> str | None:
    value = spec.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidJobInput(f"{param}.{key} must be a non-empty string", param=param)
    return value


def _verifier(spec: Mapping[str, Any], param: str) -> VerifierLoss:
    function = spec.get("function")
    if function is not None:
        target = _registered("metric", function, param)
        if not callable(target):
            raise InvalidJobInput(f"{param}.function {function!r} is not a function", param=param)
        return VerifierLoss(target)
    check = spec.get("check", "exact")
    if check not in CHECKS:
        raise InvalidJobInput(f"{param}.check must be one of {', '.join(CHECKS)}, got {check!r}", param=param)
    pattern = spec.get("pattern")
    if pattern is not None:
        try:
            re.compile(str(pattern))
        except re.error as exc:
            raise InvalidJobInput(f"{param}.pattern is not a valid regular expression: {exc}", param=param) from None
    field_path = spec.get("field")
    if field_path is not None and not isinstance(field_path, str):
        raise InvalidJobInput(f"{param}.field must be a key of the output (dots for nested keys)", param=param)
    return VerifierLoss(make_check(str(check), field=field_path, case_sensitive=bool(spec.get("case_sensitive")),
                                   pattern=None if pattern is None else str(pattern)))


def make_check(
    check: str, *, field: str | None = None, case_sensitive: bool = False, pattern: str | None = None
) -> Callable[[Any, Any], tuple[bool | float, str]]:
    """A verifier ``(output, target) -> (passed, message)`` comparing the output (or ``field`` of it) with the
    target; the message says what was expected, which is the feedback an optimizer learns from."""

    def verify(output: Any, target: Any) -> tuple[bool | float, str]:
        if check == "fields":
            return field_match(_pick(output, field), target)
        text = _as_text(_pick(output, field))
        if check == "regex":
            regex = pattern if pattern is not None else _as_text(target)
            flags = 0 if case_sensitive else re.IGNORECASE
            ok = re.search(regex, text, flags) is not None
            return ok, "" if ok else f"The output {_shown(text)} does not match the pattern {regex!r}."
        if target is None:
            raise ValueError(f"the {check!r} check needs a target on every example")
        expected = _as_text(target)
        if check == "number":
            found = _first_number(text)
            ok = found is not None and _first_number(expected) is not None and math.isclose(
                found, _first_number(expected) or 0.0, rel_tol=1e-9, abs_tol=1e-9)
            return ok, "" if ok else f"The output {_shown(text)} should give the number {expected}."
        a, b = (text.strip(), expected.strip()) if case_sensitive else (text.strip().lower(), expected.strip().lower())
        if check == "exact":
            ok = _squash(a) == _squash(b)
            return ok, "" if ok else f"The output {_shown(text)} should be exactly {expected!r}, with nothing else."
        ok = b in a
        return ok, "" if ok else f"The output {_shown(text)} should contain {expected!r}."

    return verify


def _pick(output: Any, path: str | None) -> Any:
    if not path:
        return output
    value = output
    for key in path.split("."):
        payload = getattr(value, "payload", value)
        if isinstance(payload, Mapping) and key in payload:
            value = payload[key]
        else:
            raise ValueError(f"the output has no field {path!r} (it is {_shown(_as_text(output))})")
    return value


def _as_text(value: Any) -> str:
    value = getattr(value, "payload", value)
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(value)


def _squash(text: str) -> str:
    # "Positive." and "positive" are the same answer; inner whitespace runs are one space
    return " ".join(text.split()).strip(" .!\"'")


def _first_number(text: str) -> float | None:
    match = re.search(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(match.group()) if match else None


def _shown(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _judge_options(spec: Mapping[str, Any], param: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key in ("max_retries", "max_tokens"):
        if spec.get(key) is not None:
            value = spec[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "max_retries" else 1):
                raise InvalidJobInput(f"{param}.{key} must be a {'non-negative' if key == 'max_retries' else 'positive'} "
                                      "integer", param=param)
            options[key] = value
    return options


def _judge(kind: str, spec: Mapping[str, Any], param: str) -> BuiltLoss:
    alias = _text(spec, "alias", param, required=False) or "judge"
    options = _judge_options(spec, param)
    if kind == "rubric":
        criteria = _text(spec, "criteria", param)
        if not spec.get("rubric"):
            raise InvalidJobInput(f"{param}.rubric is required: e.g. {{\"1\": \"wrong\", \"5\": \"perfect\"}}",
                                  param=param)
        rubric = spec["rubric"]
        if isinstance(rubric, list):  # JSON has no tuples: [[1, "poor"], [5, "good", "details"]]
            rubric = [tuple(level) if isinstance(level, list) else level for level in rubric]
        return BuiltLoss(LLMRubricLoss(str(criteria), rubric, alias, **options), [alias])
    if kind == "preference":
        return BuiltLoss(LLMPreferenceLoss(str(_text(spec, "criteria", param)), alias, **options), [alias])
    return BuiltLoss(LLMJudge(alias, _text(spec, "criteria", param, required=False), **options), [alias])


def _composite(spec: Mapping[str, Any], human: HumanSourceFactory, param: str) -> BuiltLoss:
    parts = spec.get("losses")
    if not isinstance(parts, list) or not parts:
        raise InvalidJobInput(f"{param}.losses must be a list of {{\"loss\": {{...}}, \"weight\": w}}", param=param)
    pairs: list[tuple[Loss, float]] = []
    aliases: list[str] = []
    uses_human = False
    for index, part in enumerate(parts):
        where = f"{param}.losses[{index}]"
        if not isinstance(part, Mapping) or "loss" not in part:
            raise InvalidJobInput(f"{where} must be {{\"loss\": {{...}}, \"weight\": w}}", param=param)
        weight = part.get("weight", 1.0)
        if not isinstance(weight, int | float) or isinstance(weight, bool):
            raise InvalidJobInput(f"{where}.weight must be a number", param=param)
        built = build_loss(part["loss"], human=human, param=f"{where}.loss")
        pairs.append((built.loss, float(weight)))
        aliases.extend(built.aliases)
        uses_human = uses_human or built.human
    aggregator = _text(spec, "aggregator", param, required=False)
    if aggregator:
        aliases.append(aggregator)
    return BuiltLoss(CompositeLoss(pairs, aggregator=aggregator), sorted(set(aliases)), uses_human)


def _human(spec: Mapping[str, Any], human: HumanSourceFactory, param: str) -> BuiltLoss:
    if human is None:
        raise InvalidJobInput(f"{param}: human feedback is only available to trainings (a person answers each "
                              "request); use a verifier or an LLM judge here", param=param)
    kind = spec.get("kind", "freeform")
    criteria = _text(spec, "criteria", param, required=kind != "freeform")
    source = human()
    if kind == "freeform":
        return BuiltLoss(HumanFeedbackLoss(source, criteria=criteria), human=True)
    if kind == "rubric":
        if not spec.get("rubric"):
            raise InvalidJobInput(f"{param}.rubric is required for kind 'rubric'", param=param)
        loss: Loss = HumanRubricLoss(str(criteria), spec["rubric"], source,
                                     require_feedback=bool(spec.get("require_feedback", True)))
        return BuiltLoss(loss, human=True)
    if kind == "preference":
        return BuiltLoss(HumanPreferenceLoss(str(criteria), source), human=True)
    raise InvalidJobInput(f"{param}.kind must be freeform, rubric or preference, got {kind!r}", param=param)


def _python_loss(spec: Mapping[str, Any], param: str) -> Loss:
    # "path" is the field's older name; either way it is a registered name, never imported
    path = _text(spec, "name" if "name" in spec else "path", param)
    options = spec.get("options") or {}
    if not isinstance(options, Mapping):
        raise InvalidJobInput(f"{param}.options must be an object of keyword arguments", param=param)
    target = _registered("loss", path, param)
    if isinstance(target, Loss):
        if options:
            raise InvalidJobInput(f"{param}.path names a Loss instance, which takes no options", param=param)
        return target
    if callable(target):
        try:
            loss = target(**options)
        except TypeError as exc:
            raise InvalidJobInput(f"{param}.path {path!r} cannot be built with the options {dict(options)}: {exc}",
                                  param=param) from None
        if isinstance(loss, Loss):
            return loss
    raise InvalidJobInput(f"{param}.path {path!r} must name a Loss, a Loss subclass or a function returning a Loss",
                          param=param)


def _registered(kind: str, name: Any, param: str) -> Any:
    registry = current_registry()
    try:
        return registry.loss(name) if kind == "loss" else registry.metric(name)
    except UnknownNameError as exc:
        raise InvalidJobInput(f"{param}: {exc}", param=param, code=f"unknown_{kind}") from None


# -- optimizers -------------------------------------------------------------------------------------------------
#: the selection-gated optimizer's settings, their defaults and bounds (``{"type": "gepa", "budget": 600, ...}``)
SELECTION_FIELDS: dict[str, tuple[int, int, int]] = {
    "budget": (600, 1, 1_000_000),  # metric calls: one per example scored
    "candidates_per_step": (4, 1, 32),
    "minibatch_size": (8, 1, 1000),
    "max_demos": (4, 1, 32),
}
SFA_FIELDS = ("conservatism", "max_retries", "max_tokens", "reasoning_model")


@dataclass(frozen=True)
class OptimizerSpec:
    type: str = "gepa"
    conservatism: float = 0.7
    max_retries: int = 3
    max_tokens: int | None = 512
    reasoning_model: str | None = None
    budget: int = 600
    candidates_per_step: int = 4
    minibatch_size: int = 8
    max_demos: int = 4
    noise_z: float = 1.0
    demonstrations: bool = True
    rewrite_instructions: bool = True

    @property
    def selection(self) -> bool:
        """The selection-gated optimizer (``SelectionOptimizer``) rather than a feedback-ascent one."""
        return self.type == "gepa"

    def build(self, params: Any) -> Optimizer:
        if self.type == "basic":
            return Optimizer(params, reasoning_model=self.reasoning_model, max_retries=self.max_retries,
                             max_tokens=self.max_tokens)
        return SFAOptimizer(params, self.conservatism, self.max_retries, reasoning_model=self.reasoning_model,
                            max_tokens=self.max_tokens)

    def build_selection(self, module: Any, loss: Loss, *, seed: int | None,
                        on_step: Callable[[Any], Any] | None = None) -> SelectionOptimizer:
        return SelectionOptimizer(
            module, loss, budget=self.budget, candidates_per_step=self.candidates_per_step,
            minibatch_size=self.minibatch_size, max_demos=self.max_demos, noise_z=self.noise_z,
            seed=seed if seed is not None else 0, demonstrations=self.demonstrations,
            rewrite_instructions=self.rewrite_instructions, conservatism=self.conservatism,
            max_tokens=self.max_tokens, on_step=on_step,
        )

    def aliases(self) -> list[str]:
        if self.selection and not self.rewrite_instructions:
            return []
        aliases = [Optimizer.AGGREGATOR_ALIAS, Optimizer.UPDATER_ALIAS]
        return aliases + ([Optimizer.REASONING_ALIAS] if self.reasoning_model and not self.selection else [])

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": self.type, "conservatism": self.conservatism, "max_retries": self.max_retries,
                                "max_tokens": self.max_tokens, "reasoning_model": self.reasoning_model}
        if self.selection:
            data.update({name: getattr(self, name) for name in SELECTION_FIELDS})
            data.update(noise_z=self.noise_z, demonstrations=self.demonstrations,
                        rewrite_instructions=self.rewrite_instructions)
            del data["max_retries"], data["reasoning_model"]
        return data


def parse_optimizer(data: Any) -> OptimizerSpec:
    """The optimizer of a request: ``gepa`` (the default: selection-gated, with demonstrations), ``sfa`` or
    ``basic``; every field checked, an unknown one named."""
    if data is None:
        data = {"type": "gepa"}
    if isinstance(data, str):  # just the type: "gepa", "sfa" or "basic"
        data = {"type": data}
    if not isinstance(data, Mapping):
        raise InvalidJobInput("optimizer must be an object, e.g. {\"type\": \"gepa\", \"budget\": 600}, or a type",
                              param="optimizer")
    kind = data.get("type", "gepa")
    if kind not in OPTIMIZER_TYPES:
        raise InvalidJobInput(f"optimizer.type must be one of {', '.join(OPTIMIZER_TYPES)}, got {kind!r}",
                              param="optimizer")
    selection_only = (*SELECTION_FIELDS, "noise_z", "demonstrations", "rewrite_instructions")
    known = ("type", "conservatism", "max_tokens", *selection_only) if kind == "gepa" else ("type", *SFA_FIELDS)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InvalidJobInput(f"optimizer has unknown field(s) {unknown} for type {kind!r}; known: "
                              f"{', '.join(known)}", param="optimizer")
    conservatism = data.get("conservatism", 0.5 if kind == "gepa" else 0.7)
    if not isinstance(conservatism, int | float) or isinstance(conservatism, bool) or not 0 <= conservatism <= 1:
        raise InvalidJobInput("optimizer.conservatism must be a number within [0, 1] (1 = minimal edits)",
                              param="optimizer")
    max_retries = data.get("max_retries", 3)
    if not isinstance(max_retries, int) or isinstance(max_retries, bool) or not 0 <= max_retries <= 10:
        raise InvalidJobInput("optimizer.max_retries must be an integer within [0, 10]", param="optimizer")
    max_tokens = data.get("max_tokens", 256 if kind == "gepa" else 512)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise InvalidJobInput("optimizer.max_tokens must be a positive integer (or null for the model's limit)",
                              param="optimizer")
    reasoning = data.get("reasoning_model")
    if reasoning is not None and (not isinstance(reasoning, str) or not reasoning.strip()):
        raise InvalidJobInput("optimizer.reasoning_model must be a model name (or null)", param="optimizer")
    spec = OptimizerSpec(str(kind), float(conservatism), max_retries, max_tokens, reasoning)
    return _selection_settings(spec, data) if kind == "gepa" else spec


def _selection_settings(spec: OptimizerSpec, data: Mapping[str, Any]) -> OptimizerSpec:
    values: dict[str, Any] = {}
    for name, (default, low, high) in SELECTION_FIELDS.items():
        value = data.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise InvalidJobInput(f"optimizer.{name} must be an integer within [{low}, {high}], got {value!r}",
                                  param="optimizer")
        values[name] = value
    noise_z = data.get("noise_z", 1.0)
    if not isinstance(noise_z, int | float) or isinstance(noise_z, bool) or not 0 <= noise_z <= 10:
        raise InvalidJobInput("optimizer.noise_z must be a number within [0, 10] (standard errors a candidate's "
                              "minibatch gain must exceed)", param="optimizer")
    for name in ("demonstrations", "rewrite_instructions"):
        if not isinstance(data.get(name, True), bool):
            raise InvalidJobInput(f"optimizer.{name} must be true or false", param="optimizer")
    return replace(spec, **values, noise_z=float(noise_z), demonstrations=data.get("demonstrations", True),
                   rewrite_instructions=data.get("rewrite_instructions", True))
