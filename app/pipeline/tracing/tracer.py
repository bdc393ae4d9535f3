"""Value-driven tracing: run ``forward`` on placeholder Values and record every leaf call as a graph node.

Composite modules (those with child modules) are traced through: their ``forward`` runs at trace time.
Leaf modules (``LLMInference``, or a module with no children) and ``F.*`` ops are recorded and run later on
real payloads. A traced Value formatted into a string (``str(v)``, an f-string) becomes a placeholder that is
turned into an ``F.render`` node as soon as the string reaches a module call, an op, or the output.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from app.pipeline.context import trace_context
from app.pipeline.graph import GraphNode, InferenceGraph, InputNode, OpNode, TracedModule
from app.pipeline.parameter import Parameter
from app.pipeline.values import Value, ValueKind, collect_refs, replace_values_with_refs, valueify

_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(.*?){_CLOSE}")


class Tracer:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.nodes: dict[str, GraphNode] = {}
        self.input_ids: list[str] = []
        self.output_ids: list[str] = []
        self._counter = 0
        self._input_counter = 0
        self._module_stack: list[str] = []
        self._root_path = ""

    # -- ids and ownership --------------------------------------------------------------------------------------
    def owns_ref(self, ref: str) -> bool:
        return ref in self.nodes

    def _next_id(self, name: str) -> str:
        self._counter += 1
        return f"{name}_{self._counter}"

    def placeholder_for(self, value: Value) -> str:
        return f"{_OPEN}{value.ref}{_CLOSE}"

    # -- inputs -------------------------------------------------------------------------------------------------
    def bind_inputs(self, obj: Any, name: str | None = None) -> Any:
        """Give every Value in ``obj`` an input node (``input:input_0``; dict keys as ``input_<key>_<i>``)."""
        if isinstance(obj, Value):
            index = self._input_counter
            self._input_counter += 1
            node_id = f"input:{name}_{index}" if name else f"input:input_{index}"
            self.nodes[node_id] = GraphNode(
                id=node_id, module=InputNode(obj), module_name=f"Input({node_id[6:]})", module_path=""
            )
            self.input_ids.append(node_id)
            return Value(obj.kind, obj.payload, node_id, dict(obj.meta))
        if isinstance(obj, dict):
            return {k: self.bind_inputs(v, f"{name or 'input'}_{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.bind_inputs(v, name) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self.bind_inputs(v, name) for v in obj)
        return obj

    # -- recording ----------------------------------------------------------------------------------------------
    def record_call(self, module: TracedModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
        args = self._materialise_strings(args)
        kwargs = self._materialise_strings(kwargs)
        node_id = self._next_id(type(module).__name__)
        return self._add_node(
            node_id,
            module,
            args,
            kwargs,
            module_name=type(module).__name__,
            module_path=self._relative_path(module),
            kind=module.output_kind(),
        )

    def _relative_path(self, module: TracedModule) -> str:
        """The module's dotted path from the traced root (what ``root.get_submodule`` resolves)."""
        path = module._path()
        if self._root_path and path.startswith(self._root_path + "."):
            return path[len(self._root_path) + 1 :]
        return "" if path == self._root_path else path

    def record_op(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Value:
        args = self._materialise_strings(args)
        kwargs = self._materialise_strings(kwargs)
        return self._add_node(self._next_id(name), OpNode(name), args, kwargs, module_name=name, module_path="")

    def _add_node(
        self,
        node_id: str,
        module: Any,
        args: Any,
        kwargs: Any,
        *,
        module_name: str,
        module_path: str,
        kind: ValueKind = ValueKind.OTHER,
    ) -> Value:
        deps = [ref for ref in collect_refs(*args, **kwargs) if ref in self.nodes]
        self.nodes[node_id] = GraphNode(
            id=node_id,
            module=module,
            args=tuple(self._store(a) for a in args),
            kwargs={k: self._store(v) for k, v in kwargs.items()},
            dependencies=deps,
            priority=int(getattr(module, "priority", 0) or 0),
            module_name=module_name,
            module_path=module_path,
        )
        return Value(kind, None, node_id)

    def _store(self, obj: Any) -> Any:
        """Values from this trace become ValueRefs; literal Values are kept as they are, and a Parameter passed
        as an argument is lifted into its Value (``param:<name>`` ref, current value) so the graph serialises."""
        if isinstance(obj, Value):
            return replace_values_with_refs(obj) if obj.ref in self.nodes else obj
        if isinstance(obj, Parameter):
            return obj.as_value()
        if isinstance(obj, dict):
            return {k: self._store(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._store(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._store(v) for v in obj)
        return obj

    def is_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether any argument depends on this trace (a traced Value or a string holding a placeholder)."""
        return any(
            ref in self.nodes for ref in collect_refs(*args, **kwargs)
        ) or _has_placeholder((args, kwargs))

    def _materialise_strings(self, obj: Any) -> Any:
        """Turn strings that embed traced Values into F.render nodes (escaping the literal braces)."""
        if isinstance(obj, str) and _OPEN in obj:
            return self._render_node(obj)
        if isinstance(obj, dict):
            return {k: self._materialise_strings(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._materialise_strings(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._materialise_strings(v) for v in obj)
        return obj

    def _render_node(self, text: str) -> Value:
        variables: dict[str, Any] = {}
        pieces: list[str] = []
        position = 0
        for match in _PLACEHOLDER.finditer(text):
            pieces.append(_escape_braces(text[position : match.start()]))
            ref = match.group(1)
            if ref not in self.nodes:
                raise ValueError(f"a formatted string refers to {ref!r}, which is not part of this trace")
            var = f"v{len(variables)}"
            variables[var] = Value(ValueKind.OTHER, None, ref)
            pieces.append("{" + var + "}")
            position = match.end()
        pieces.append(_escape_braces(text[position:]))
        template = "".join(pieces)
        if _OPEN in template or _CLOSE in template:
            # a piece of a placeholder is left: the string was sliced or split after formatting a traced Value
            raise TypeError(
                "a string holding a traced Value was cut or changed at trace time (str(v)[:n], .split(), ...); "
                "its text is only known at run time: transform it with F ops (F.strip, F.select, ...) instead"
            )
        return self.record_op("F.render", (template, variables), {})

    def trace_forward(self, module: TracedModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a composite module's forward at trace time (it must be synchronous: it only wires nodes)."""
        output = module.forward(*args, **kwargs)
        if inspect.isawaitable(output):
            if inspect.iscoroutine(output):
                output.close()  # never awaited: close it so Python does not warn
            raise TypeError(
                f"{type(module).__name__}.forward is async, but a module with child modules is traced through at "
                "trace time and must be a plain `def forward`; only leaf modules may be async"
            )
        return output

    # -- the whole trace ----------------------------------------------------------------------------------------
    def trace_values(self, module: TracedModule, *args: Any, **kwargs: Any) -> InferenceGraph:
        self.reset()
        self._root_path = module._path()
        with trace_context(self):
            bound_args = tuple(self.bind_inputs(valueify(a)) for a in args)
            bound_kwargs = {k: self.bind_inputs(valueify(v), f"input_{k}") for k, v in kwargs.items()}
            if module._is_leaf_module():
                # a leaf at the root (an LLMInference, a plain-Python module) is itself the one node
                output = self.record_call(module, bound_args, bound_kwargs)
            else:
                output = self.trace_forward(module, bound_args, bound_kwargs)
            output = self._materialise_strings(output)
            output = self._lift_literals(output)
            structure = self._output_structure(output)
        return InferenceGraph(
            nodes=dict(self.nodes),
            input_ids=list(self.input_ids),
            output_ids=list(self.output_ids),
            output_structure=structure,
            parameters=dict(module.named_parameters()),
        )

    def _lift_literals(self, output: Any) -> Any:
        """A literal returned from forward becomes a constant node, so every output has a node id."""
        if isinstance(output, Value) and output.ref in self.nodes:
            return output
        if isinstance(output, dict):
            return {k: self._lift_literals(v) for k, v in output.items()}
        if isinstance(output, list | tuple):
            lifted = [self._lift_literals(v) for v in output]
            return tuple(lifted) if isinstance(output, tuple) else lifted
        value = output if isinstance(output, Value) else valueify(output)
        if not isinstance(value, Value):
            value = Value(ValueKind.STRUCTURED, output)
        return self.record_op("F.constant", (Value(value.kind, value.payload, None, dict(value.meta)),), {})

    def _output_structure(self, output: Any) -> Any:
        if isinstance(output, Value):
            assert output.ref is not None
            if output.ref not in self.output_ids:
                self.output_ids.append(output.ref)
            return output.ref
        if isinstance(output, dict):
            return {k: self._output_structure(v) for k, v in output.items()}
        if isinstance(output, tuple):
            return tuple(self._output_structure(v) for v in output)
        if isinstance(output, list):
            return [self._output_structure(v) for v in output]
        raise TypeError(f"forward() returned an unsupported output type {type(output).__name__}")


def _escape_braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _has_placeholder(obj: Any) -> bool:
    if isinstance(obj, str):
        return _OPEN in obj
    if isinstance(obj, dict):
        return any(_has_placeholder(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_placeholder(v) for v in obj)
    return False


def trace(module: TracedModule, *args: Any, **kwargs: Any) -> InferenceGraph:
    """Trace ``module`` on example inputs into an InferenceGraph."""
    return Tracer().trace_values(module, *args, **kwargs)
