"""The traced graph: nodes with their dependencies, topological order, a Merkle hash, JSON and DOT forms."""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.pipeline.values import Value, ValueKind, ValueRef


class TracedModule(Protocol):
    """What the tracer and the graph call on a pipeline ``Module``: the graph and the module sit side by side (a module
    reaches the running tracer only through ``app.pipeline.context``), so the graph names it by this protocol."""

    def _path(self) -> str: ...

    def _is_leaf_module(self) -> bool: ...

    def output_kind(self) -> ValueKind: ...

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Any]]: ...

    def get_submodule(self, path: str) -> TracedModule: ...


GRAPH_FORMAT_VERSION = 1


@dataclass
class InputNode:
    """A graph input; ``value`` is the Value given for it (or None in a graph loaded without inputs)."""

    value: Value | None = None


@dataclass
class OpNode:
    """A functional op (``F.render`` ...) recorded in a trace; it runs at execution time on real payloads."""

    name: str

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
        from app.pipeline.functional import run_op

        return run_op(self.name, args, kwargs)


@dataclass
class GraphNode:
    id: str
    module: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    dependencies: list[str] = field(default_factory=list)
    priority: int = 0
    module_name: str = ""
    module_path: str = ""

    def __post_init__(self) -> None:
        self.kind = _node_kind(self.module)
        # the scheduler reads these on every dispatch: compute them once
        self.alias: str | None = getattr(self.module, "alias", None) if self.kind == "llm" else None

    def config(self) -> dict[str, Any]:
        if isinstance(self.module, InputNode):
            return {}
        if isinstance(self.module, OpNode):
            return {"op": self.module.name}
        return dict(self.module.node_config())


def _node_kind(module: Any) -> str:
    """``input``, ``op`` (F.*), ``llm`` (an LLMInference) or ``module`` (a leaf module's Python forward)."""
    if isinstance(module, InputNode):
        return "input"
    if isinstance(module, OpNode):
        return "op"
    if getattr(type(module), "graph_node_kind", None) == "llm":  # an LLMInference (it says so: llm sits above the graph)
        return "llm"
    if isinstance(module, UnboundModule) and "alias" in module.config_data:
        return "llm"
    return "module"


@dataclass
class InferenceGraph:
    nodes: dict[str, GraphNode]
    input_ids: list[str]
    output_ids: list[str]
    output_structure: Any = None
    parameters: dict[str, Any] = field(default_factory=dict)

    # -- structure ----------------------------------------------------------------------------------------------
    def dependents(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {node_id: [] for node_id in self.nodes}
        for node in self.nodes.values():
            for dep in node.dependencies:
                if dep not in out:
                    raise ValueError(f"node {node.id!r} depends on {dep!r}, which is not a node of this graph")
                out[dep].append(node.id)
        return out

    def topological_order(self) -> list[str]:
        """Node ids so that each comes after its dependencies; a cycle is a ValueError naming it."""
        waiting = {node_id: len(node.dependencies) for node_id, node in self.nodes.items()}
        dependents = self.dependents()
        ready = deque(node_id for node_id, n in waiting.items() if n == 0)
        order: list[str] = []
        while ready:
            node_id = ready.popleft()
            order.append(node_id)
            for child in dependents[node_id]:
                waiting[child] -= 1
                if waiting[child] == 0:
                    ready.append(child)
        if len(order) != len(self.nodes):
            cycle = self._find_cycle({n for n, count in waiting.items() if count > 0})
            raise ValueError(f"the graph has a cycle: {' -> '.join(cycle)}")
        return order

    def _find_cycle(self, candidates: set[str]) -> list[str]:
        color: dict[str, int] = {}
        stack: list[str] = []

        def visit(node_id: str) -> list[str] | None:
            color[node_id] = 1
            stack.append(node_id)
            for dep in self.nodes[node_id].dependencies:
                if color.get(dep) == 1:
                    return [*stack[stack.index(dep) :], dep]
                if dep in candidates and dep not in color:
                    found = visit(dep)
                    if found:
                        return found
            stack.pop()
            color[node_id] = 2
            return None

        for start in sorted(candidates):
            if start not in color:
                found = visit(start)
                if found:
                    return list(reversed(found))
        return sorted(candidates)

    def ancestors(self, node_id: str) -> set[str]:
        seen: set[str] = set()
        todo = list(self.nodes[node_id].dependencies)
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(self.nodes[current].dependencies)
        return seen

    def descendants(self, node_id: str) -> set[str]:
        dependents = self.dependents()
        seen: set[str] = set()
        todo = list(dependents[node_id])
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(dependents[current])
        return seen

    def depth(self) -> dict[str, int]:
        """Longest distance from an input, per node (inputs are 0)."""
        depth: dict[str, int] = {}
        for node_id in self.topological_order():
            deps = self.nodes[node_id].dependencies
            depth[node_id] = 1 + max((depth[d] for d in deps), default=-1)
        return depth

    # -- hashing ------------------------------------------------------------------------------------------------
    def node_hashes(self) -> dict[str, str]:
        """Merkle hashes: each node's type, config and priority together with its dependencies' hashes."""
        hashes: dict[str, str] = {}
        for node_id in self.topological_order():
            node = self.nodes[node_id]
            identity = node_id if node.kind == "input" else _type_name(node.module)
            material = {
                "type": identity,
                "config": node.config(),
                "deps": [hashes[d] for d in node.dependencies],
                "priority": node.priority,
                # literal arguments (an f-string's template, a constant) are part of the pipeline, not its input
                "args": _arg_material([node.args, node.kwargs], hashes),
            }
            blob = json.dumps(material, sort_keys=True, default=str).encode()
            hashes[node_id] = hashlib.sha256(blob).hexdigest()
        return hashes

    def compute_hash(self) -> str:
        hashes = self.node_hashes()
        material = {
            "inputs": [hashes[i] for i in self.input_ids],
            "outputs": [hashes[o] for o in self.output_ids],
            "nodes": sorted(hashes.values()),
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()

    # -- views --------------------------------------------------------------------------------------------------
    def to_dot(self) -> str:
        lines = ["digraph inference_graph {", "  rankdir=LR;", '  node [shape=box, fontname="Helvetica"];']
        for node_id in self.topological_order():
            node = self.nodes[node_id]
            shape = {"input": "ellipse", "op": "note", "llm": "box3d"}.get(node.kind, "box")
            label = node.module_name or node_id
            if node.kind == "llm":
                label += f"\\nalias={node.alias}"
            extra = ", peripheries=2" if node_id in self.output_ids else ""
            lines.append(f'  "{_dot_escape(node_id)}" [label="{_dot_escape(label)}", shape={shape}{extra}];')
        for node in self.nodes.values():
            for dep in node.dependencies:
                lines.append(f'  "{_dot_escape(dep)}" -> "{_dot_escape(node.id)}";')
        lines.append("}")
        return "\n".join(lines)

    # -- JSON ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for node_id in self.topological_order():
            node = self.nodes[node_id]
            entry: dict[str, Any] = {
                "id": node.id,
                "kind": node.kind,
                "module_name": node.module_name,
                "module_path": node.module_path,
                "type": None if node.kind == "input" else _type_name(node.module),
                "config": node.config(),
                "args": encode_json(node.args),
                "kwargs": encode_json(node.kwargs),
                "dependencies": list(node.dependencies),
                "priority": node.priority,
            }
            if isinstance(node.module, InputNode):
                entry["value"] = encode_json(node.module.value)
            nodes.append(entry)
        return {
            "version": GRAPH_FORMAT_VERSION,
            "hash": self.compute_hash(),
            "nodes": nodes,
            "input_ids": list(self.input_ids),
            "output_ids": list(self.output_ids),
            "output_structure": encode_json(self.output_structure),
            "parameters": {name: encode_json(_param_value(p)) for name, p in self.parameters.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any], root: TracedModule | None = None) -> InferenceGraph:
        """Rebuild a graph; with ``root`` (the traced module) the module nodes are bound and runnable again."""
        if data.get("version") != GRAPH_FORMAT_VERSION:
            raise ValueError(f"unsupported graph format version {data.get('version')!r}")
        nodes: dict[str, GraphNode] = {}
        for entry in data["nodes"]:
            kind = entry["kind"]
            module: Any
            if kind == "input":
                module = InputNode(decode_json(entry.get("value")))
            elif kind == "op":
                module = OpNode(entry["config"]["op"])
            elif root is not None:
                module = _bind_module(root, entry)
            else:
                module = UnboundModule(entry["type"], entry["module_path"], entry["config"])
            nodes[entry["id"]] = GraphNode(
                id=entry["id"],
                module=module,
                args=tuple(decode_json(entry["args"])),
                kwargs=decode_json(entry["kwargs"]),
                dependencies=list(entry["dependencies"]),
                priority=entry.get("priority", 0),
                module_name=entry.get("module_name", ""),
                module_path=entry.get("module_path", ""),
            )
        parameters: dict[str, Any] = {}
        if root is not None:
            parameters = dict(root.named_parameters())
        else:
            parameters = {k: decode_json(v) for k, v in data.get("parameters", {}).items()}
        graph = cls(
            nodes=nodes,
            input_ids=list(data["input_ids"]),
            output_ids=list(data["output_ids"]),
            output_structure=decode_json(data.get("output_structure")),
            parameters=parameters,
        )
        return graph

    @classmethod
    def from_json(cls, text: str, root: TracedModule | None = None) -> InferenceGraph:
        return cls.from_dict(json.loads(text), root)


@dataclass
class UnboundModule:
    """Stands in for a module in a graph loaded without its root module: inspectable, not runnable."""

    type_name: str
    module_path: str
    config_data: dict[str, Any]

    def node_config(self) -> dict[str, Any]:
        return self.config_data

    @property
    def alias(self) -> str | None:
        return self.config_data.get("alias")


def _type_name(module: Any) -> str:
    if isinstance(module, OpNode):
        return module.name
    if isinstance(module, UnboundModule):
        return module.type_name
    cls = type(module)
    return f"{cls.__module__}:{cls.__qualname__}"


def _bind_module(root: TracedModule, entry: dict[str, Any]) -> TracedModule:
    """The root's submodule at the node's path, checked to be the kind of module that was traced there."""
    path = entry.get("module_path", "")
    try:
        module = root.get_submodule(path)
    except AttributeError as exc:
        raise ValueError(f"node {entry['id']!r}: the root module has no submodule {path!r}") from exc
    if _type_name(module) != entry["type"]:
        raise ValueError(
            f"node {entry['id']!r} was traced from a {entry['type']} at {path!r}, but the root module has a "
            f"{_type_name(module)} there (was it a module created inside forward()?)"
        )
    return module


def _arg_material(obj: Any, hashes: dict[str, str]) -> Any:
    """Node arguments as stable hash material: traced inputs by their producer's hash, literals by content."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, ValueRef):
        return {"$dep": hashes.get(obj.ref, obj.ref)}
    if isinstance(obj, Value):
        return {"$value": [obj.kind.value, _arg_material(obj.payload, hashes)]}
    if isinstance(obj, dict):
        return {"$dict": [[_arg_material(k, hashes), _arg_material(v, hashes)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [_arg_material(v, hashes) for v in obj]
    if isinstance(obj, type) or callable(obj):  # a schema or a function (F.map_values): by name, not address
        return f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
    try:
        return encode_json(obj)
    except ValueError:
        return _type_name(obj)


def _param_value(param: Any) -> Any:
    return getattr(param, "value", param)


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# -- a small tagged JSON encoding for node arguments (tuples, Values, refs, types, bytes, errors) ------------
def encode_json(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, ValueRef):
        return {"$ref": obj.ref}
    if isinstance(obj, Value):
        return {"$value": {"kind": obj.kind.value, "payload": encode_json(obj.payload), "ref": obj.ref,
                           "meta": encode_json(obj.meta)}}
    if isinstance(obj, ValueKind):
        return {"$kind": obj.value}
    if isinstance(obj, list):
        return [encode_json(v) for v in obj]
    if isinstance(obj, tuple):
        return {"$tuple": [encode_json(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode_json(v) for k, v in obj.items()}
        return {"$dict": [[encode_json(k), encode_json(v)] for k, v in obj.items()]}
    if isinstance(obj, bytes | bytearray):
        return {"$bytes": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, BaseException):
        return {"$error": {"type": type(obj).__name__, "message": str(obj)}}
    if isinstance(obj, type):
        return {"$type": f"{obj.__module__}:{obj.__qualname__}"}
    if hasattr(obj, "model_dump"):
        return encode_json(obj.model_dump(mode="json"))
    raise ValueError(
        f"cannot serialise {type(obj).__name__} in a graph: node arguments must be JSON-like data, Values, "
        "types or bytes"
    )


def decode_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, body), = obj.items()
        if tag == "$ref":
            return ValueRef(body)
        if tag == "$value":
            return Value(ValueKind(body["kind"]), decode_json(body["payload"]), body.get("ref"),
                         decode_json(body.get("meta") or {}))
        if tag == "$kind":
            return ValueKind(body)
        if tag == "$tuple":
            return tuple(decode_json(v) for v in body)
        if tag == "$dict":
            return {_hashable(decode_json(k)): decode_json(v) for k, v in body}
        if tag == "$bytes":
            return base64.b64decode(body)
        if tag == "$error":
            return RestoredError(f"{body['type']}: {body['message']}")
        if tag == "$type":
            return _stored_type(str(body))
    return {k: decode_json(v) for k, v in obj.items()}


def _stored_type(path: str) -> Any:
    """A class named in stored JSON. Stored data is never a reason to import: the class must live in a module
    already loaded (the pipeline's own code, imported through the operator's registry) or in inf-engine."""
    module_name, _, qualname = path.partition(":")
    module = sys.modules.get(module_name)
    if module is None and (module_name == "app" or module_name.startswith("app.")):
        module = importlib.import_module(module_name)
    if module is None:
        raise ValueError(f"stored data names the type {path!r}, whose module is not loaded; load its pipeline first")
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


class RestoredError(Exception):
    """An error read back from JSON (its original type is named in the message)."""
