"""How one graph node runs once its inputs are known: LLM calls, leaf modules, and inline ops."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from app.pipeline.execution.state import ExecutionState
from app.pipeline.graph import GraphNode, OpNode
from app.pipeline.resources.errors import ConfigurationError
from app.pipeline.resources.types import LLMRequest
from app.pipeline.values import Value, ValueKind, ValueRef, _infer_kind, error_value, unwrap

_REQUEST_FIELDS = {"stop", "tools", "tool_choice", "extra_body", "temperature", "max_tokens"}


def is_inline(node: GraphNode) -> bool:
    """F.* ops are cheap pure functions: they run inside the dispatcher without taking a concurrency slot."""
    return isinstance(node.module, OpNode)


def resolve_args(state: ExecutionState, node: GraphNode) -> tuple[tuple[Any, ...], dict[str, Any]]:
    results = state.results
    if len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], ValueRef):
        return (results[node.args[0].ref].value,), {}  # the common single-input case, without recursion

    def resolve(obj: Any) -> Any:
        if isinstance(obj, ValueRef):
            return results[obj.ref].value
        if isinstance(obj, dict):
            return {k: resolve(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [resolve(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(resolve(v) for v in obj)
        return obj

    return tuple(resolve(a) for a in node.args), {k: resolve(v) for k, v in node.kwargs.items()}


def _prompt_of(value: Any) -> str | list[dict[str, Any]]:
    payload = unwrap(value)
    if isinstance(payload, str):
        return payload
    if isinstance(payload, list) and all(isinstance(m, dict) and "role" in m for m in payload):
        return payload
    if isinstance(payload, dict | list):
        return json.dumps(payload, ensure_ascii=False, sort_keys=True, default=str)
    return str(payload)


def build_request(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LLMRequest:
    if not args and "prompt" not in kwargs:
        raise ValueError(f"{type(module).__name__} was called without a prompt")
    prompt = args[0] if args else kwargs["prompt"]
    options = {k: unwrap(v) for k, v in kwargs.items() if k in _REQUEST_FIELDS}
    system = module.system_prompt.value if module.system_prompt is not None else None
    return LLMRequest(
        prompt=_prompt_of(prompt),
        system_prompt=str(system) if system else None,
        temperature=options.pop("temperature", module.temperature),
        max_tokens=options.pop("max_tokens", module.max_tokens),
        response_format=module.response_format,
        **options,
    )


async def run_llm_node(
    manager: Any,
    node: GraphNode,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_ready: Callable[[], None] | None = None,
) -> Value:
    module = node.module
    if manager is None:
        raise ConfigurationError(
            f"node {node.id} needs the endpoint alias {module.alias!r}, but no resources were given: pass "
            "resources=ResourceConfig({...}) to run()/bind() or ExecutionSettings"
        )
    request = build_request(module, args, kwargs)
    if on_ready is not None:
        response = await manager.complete(module.alias, request, on_ready=on_ready)
    else:
        response = await manager.complete(module.alias, request)
    meta = {
        "alias": module.alias,
        "model": response.model,
        "finish_reason": response.finish_reason,
        "input_tokens": response.input_tokens,
        "output_tokens": response.output_tokens,
        "latency_ms": response.completion_time_ms,
        "queue_time_ms": response.queue_time_ms,
    }
    if module.response_format is None:
        return Value(ValueKind.RESPONSE, response.content, node.id, meta)
    import app.pipeline.functional as F

    parsed = F.parse_structured(response.content, module.response_format)
    if parsed.kind is ValueKind.ERROR:
        return error_value(
            ValueError(f"the response of {node.id} does not match {module.response_format.__name__}: "
                       f"{parsed.payload}"),
            node_id=node.id, raw=response.content, **meta,
        )
    return Value(ValueKind.STRUCTURED, parsed.payload, node.id, meta)


async def run_module_node(node: GraphNode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
    """A leaf module's own forward, called with plain payloads (as it would be outside a pipeline)."""
    forward = getattr(node.module, "forward", None)
    if forward is None:
        raise RuntimeError(f"node {node.id} ({node.module_name}) has no runnable module bound to it")
    result = forward(*unwrap(args), **unwrap(kwargs))
    if inspect.isawaitable(result):
        result = await result
    if isinstance(result, Value):
        return result
    return Value(_infer_kind(result), result, node.id)
