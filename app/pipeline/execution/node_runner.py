"""How one graph node runs once its inputs are known: LLM calls (chats and embeddings), leaf modules, and inline
ops."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from app.pipeline.demonstrations import as_text
from app.pipeline.execution.state import ExecutionState
from app.pipeline.graph import GraphNode, OpNode
from app.pipeline.resources.errors import ConfigurationError
from app.pipeline.resources.types import EmbeddingRequest, LLMRequest
from app.pipeline.values import Value, ValueKind, ValueRef, _infer_kind, error_value, unwrap

_REQUEST_FIELDS = {"stop", "tools", "tool_choice", "extra_body", "temperature", "max_tokens"}
#: ``graph_node_call`` of an endpoint call that sends ``/v1/embeddings`` (``app.pipeline.embedding.Embedding``)
EMBEDDINGS = "embeddings"


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
    return as_text(payload)  # as a demonstration's input is rendered, so that demonstrations read like the input


def build_request(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LLMRequest:
    if not args and "prompt" not in kwargs:
        raise ValueError(f"{type(module).__name__} was called without a prompt")
    prompt = args[0] if args else kwargs["prompt"]
    options = {k: unwrap(v) for k, v in kwargs.items() if k in _REQUEST_FIELDS}
    system = module.system_prompt.value if module.system_prompt is not None else None
    text = _prompt_of(prompt)
    demos = module.demo_messages() if hasattr(module, "demo_messages") else []
    if demos:  # the demonstrations' turns, then the real input (LLMRequest puts the system prompt first)
        text = [*demos, *(text if isinstance(text, list) else [{"role": "user", "content": text}])]
    return LLMRequest(
        prompt=text,
        system_prompt=str(system) if system else None,
        temperature=options.pop("temperature", module.temperature),
        max_tokens=options.pop("max_tokens", module.max_tokens),
        response_format=module.response_format,
        tools=options.pop("tools", getattr(module, "tools", None)),
        tool_choice=options.pop("tool_choice", getattr(module, "tool_choice", None)),
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
    if is_embedding_call(node):
        return await run_embedding_node(manager, node, args, kwargs, on_ready)
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
    calls = list(getattr(response, "tool_calls", None) or ())
    if calls:
        meta["tool_calls"] = calls
    content: Any = response.content
    if module.response_format is not None and not calls:
        try:
            content = parse_response(content, module.response_format)
        except ValueError as exc:
            problem = ValueError(f"the response of {node.id} {exc}{_cut_short(response, request)}")
            return error_value(problem, node_id=node.id, raw=response.content, **meta)
    if getattr(module, "tools", None):
        answer = {"content": None if content == "" else content, "tool_calls": calls}
        return Value(ValueKind.STRUCTURED, answer, node.id, meta)
    if module.response_format is not None and not calls:
        return Value(ValueKind.STRUCTURED, content, node.id, meta)
    return Value(ValueKind.RESPONSE, response.content, node.id, meta)


def is_embedding_call(node: GraphNode) -> bool:
    """Whether an endpoint-call node sends ``/v1/embeddings`` rather than a chat."""
    return getattr(type(node.module), "graph_node_call", None) == EMBEDDINGS


def build_embedding_request(node: GraphNode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> EmbeddingRequest:
    """The embeddings request of an Embedding node: its input (a text, texts, token ids), ``dimensions`` (the
    call's, else the module's) and ``extra_body``; a ValueError naming the node for an input it cannot send."""
    if not args and "input" not in kwargs:
        raise ValueError(f"{node.id} ({node.module_name}) was called without an input")
    payload = unwrap(args[0] if args else kwargs["input"])
    dimensions = unwrap(kwargs.get("dimensions", getattr(node.module, "dimensions", None)))
    extra = unwrap(kwargs.get("extra_body")) or {}
    if isinstance(payload, tuple):
        payload = list(payload)
    problem = _embedding_input_problem(payload)
    if problem is not None:
        raise ValueError(f"{node.id} ({node.module_name}): {problem}")
    return EmbeddingRequest(payload, dimensions=dimensions, extra_body=dict(extra))


def _embedding_input_problem(payload: Any) -> str | None:
    if isinstance(payload, str):
        return None if payload else "the input is an empty string; every input needs at least one character"
    if not isinstance(payload, list):
        return f"an embedding's input is a string or a list of strings (or token ids), not {type(payload).__name__}"
    if all(isinstance(x, int) and not isinstance(x, bool) for x in payload):
        return None
    for index, item in enumerate(payload):
        if isinstance(item, list) and item and all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            continue
        if isinstance(item, str) and item:
            continue
        if isinstance(item, str | list) and not item:
            return f"input[{index}] is empty; every input needs at least one character or token"
        return f"input[{index}] is a {type(item).__name__}: embed strings (or lists of token ids)"
    if len({isinstance(item, str) for item in payload}) > 1:
        return "the input mixes strings and token ids: send one kind per call"
    return None


async def run_embedding_node(
    manager: Any,
    node: GraphNode,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_ready: Callable[[], None] | None = None,
) -> Value:
    """An Embedding node: one vector for a text (or one token-id list), a list of vectors for a list."""
    module = node.module
    request = build_embedding_request(node, args, kwargs)
    single = isinstance(request.input, str) or (bool(request.input) and isinstance(request.input[0], int))
    meta: dict[str, Any] = {"alias": module.alias}
    if not request.input:  # nothing to embed: no request
        return Value(ValueKind.STRUCTURED, [], node.id, {**meta, "input_tokens": 0, "output_tokens": 0})
    if on_ready is not None:
        response = await manager.embed(module.alias, request, on_ready=on_ready)
    else:
        response = await manager.embed(module.alias, request)
    vectors = [list(v) for v in response.embeddings]
    meta.update({
        "model": response.model,
        "input_tokens": response.input_tokens,
        "output_tokens": 0,
        "dimensions": len(vectors[0]) if vectors else 0,
        "latency_ms": response.completion_time_ms,
        "queue_time_ms": response.queue_time_ms,
    })
    return Value(ValueKind.STRUCTURED, vectors[0] if single else vectors, node.id, meta)


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_response(text: str, response_format: Any) -> Any:
    """``text`` validated against ``response_format`` (``Model.model_validate_json`` for a pydantic model, a
    ``TypeAdapter`` for any other type), as JSON data (``model_dump(mode="json")``); a fenced ``json`` block is
    accepted, for providers that cannot constrain their output. A ValueError saying why it does not validate."""
    from pydantic import BaseModel, TypeAdapter, ValidationError

    fenced = _FENCE.match(text)
    raw = fenced.group(1) if fenced else text
    name = getattr(response_format, "__name__", None) or repr(response_format)
    try:
        if isinstance(response_format, type) and issubclass(response_format, BaseModel):
            validated: Any = response_format.model_validate_json(raw)
        else:
            adapter: TypeAdapter[Any] = TypeAdapter(response_format)
            validated = adapter.validate_json(raw)
            return adapter.dump_python(validated, mode="json")
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'the answer'}: {e['msg']}" for e in exc.errors()[:5]
        )
        preview = raw if len(raw) <= 200 else raw[:200] + "..."
        raise ValueError(f"is not a valid {name} ({problems}): {preview!r}") from None
    return validated.model_dump(mode="json")


def _cut_short(response: Any, request: LLMRequest) -> str:
    if response.finish_reason == "length":
        limit = f"max_tokens={request.max_tokens}" if request.max_tokens else "the context length"
        return f"; the answer was cut at {limit} (finish_reason 'length'): raise max_tokens"
    return ""


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
