"""Modules: the PyTorch-like building blocks of a pipeline.

A module registers child modules and Parameters as attributes, like ``torch.nn.Module``. Calling one:
inside a trace records a node; with resources (``bind`` or ``ExecutionSettings``) returns an awaitable that
traces and runs it (or an async iterator of ``BatchResult`` when streaming); otherwise runs ``forward``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Self

from app.pipeline.context import get_active_tracer
from app.pipeline.parameter import Parameter
from app.pipeline.values import ValueKind

if TYPE_CHECKING:
    from app.pipeline.backward import BackwardContext, BackwardResult

#: what ``module(...)`` returns when resources are available, given ``(module, args, kwargs)``: the runtime
#: (``app.pipeline.execution``, which builds on modules) installs it with ``install_runner``.
Runner = Callable[["Module", tuple[Any, ...], dict[str, Any]], Any]
_runner: Runner | None = None


def install_runner(runner: Runner) -> None:
    """Set what runs a module called with resources (``app.pipeline.execution`` installs ``call_module``)."""
    global _runner
    _runner = runner


def _run(module: Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _runner is None:
        raise RuntimeError("no pipeline runtime is installed: import app.pipeline (or app.pipeline.execution)")
    return _runner(module, args, kwargs)


class Module:
    """Base class of every pipeline component. Subclasses define ``forward``."""

    #: a composite is traced through; a leaf is recorded as one node. None: leaf iff it has no child modules.
    is_leaf: bool | None = None
    #: parameters this kind of module can add on demand (``attach_parameter``), e.g. an LLM call's ``demos``
    attachable_parameters: ClassVar[frozenset[str]] = frozenset()

    _modules: dict[str, Module]
    _parameters: dict[str, Parameter]
    _name: str | None
    _parent: Module | None
    _bound_resources: Any
    _bound_settings: dict[str, Any]
    _module_state_version: int
    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_name", None)
        object.__setattr__(self, "_parent", None)
        object.__setattr__(self, "_bound_resources", None)
        object.__setattr__(self, "_bound_settings", {})
        object.__setattr__(self, "_module_state_version", 0)
        object.__setattr__(self, "training", False)

    def _ensure_init(self) -> None:
        if "_modules" not in self.__dict__:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ must call super().__init__() before assigning attributes"
            )

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Module | Parameter):
            self._ensure_init()
            # assigning over an existing entry keeps its position (ModuleList[i] = m, Sequential order)
            if isinstance(value, Module):
                self._parameters.pop(name, None)
                self._modules[name] = value
            else:
                self._modules.pop(name, None)
                self._parameters[name] = value
            # object.__setattr__: going through Module.__setattr__ would register the parent as a child
            object.__setattr__(value, "_name", name)
            object.__setattr__(value, "_parent", self)
        elif "_modules" in self.__dict__:
            self._modules.pop(name, None)
            self._parameters.pop(name, None)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._modules.pop(name, None)
        self._parameters.pop(name, None)
        object.__delattr__(self, name)

    # -- the tree -------------------------------------------------------------------------------------------
    def _path(self) -> str:
        parts: list[str] = []
        node: Module | None = self
        while node is not None and node._parent is not None:
            parts.append(str(node._name))
            node = node._parent
        return ".".join(reversed(parts))

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from self._modules.items()

    def modules(self) -> Iterator[Module]:
        for _, module in self.named_modules():
            yield module

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        seen: set[int] = set()

        def walk(module: Module, path: str) -> Iterator[tuple[str, Module]]:
            if id(module) in seen:
                return
            seen.add(id(module))
            yield path, module
            for name, child in module._modules.items():
                yield from walk(child, f"{path}.{name}" if path else name)

        yield from walk(self, prefix)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        modules = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for path, module in modules:
            for name, param in module._parameters.items():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield (f"{path}.{name}" if path else name), param

    def get_submodule(self, path: str) -> Module:
        module: Module = self
        for part in [p for p in path.split(".") if p]:
            if part not in module._modules:
                raise AttributeError(f"{type(module).__name__} has no child module {part!r} (path {path!r})")
            module = module._modules[part]
        return module

    def state_dict(self) -> dict[str, Any]:
        return {name: param.value for name, param in self.named_parameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self.named_parameters())
        missing = [name for name in state if name not in params]
        attach = {name: self._attach_point(name) for name in missing}
        unknown = sorted(name for name, point in attach.items() if point is None)
        if unknown:
            raise KeyError(f"unknown parameter(s) {unknown}; this module has {sorted(params)}")
        # a state saved after an optimizer attached parameters (demonstrations) restores them on a fresh instance
        for point in attach.values():
            if point is not None:
                point[0].attach_parameter(point[1])
        params = dict(self.named_parameters()) if missing else params
        for name, value in state.items():
            param = params[name]
            if param.value != value:
                param.value = value
                owner = param._parent
                if owner is not None:
                    owner._bump_state_version()

    def attach_parameter(self, name: str) -> Parameter:
        """Add the parameter ``name`` that this kind of module may carry without declaring it (listed in
        ``attachable_parameters``) and return it; a module that already has it returns its own."""
        raise KeyError(f"{type(self).__name__} cannot attach a parameter named {name!r}")

    def _attach_point(self, name: str) -> tuple[Module, str] | None:
        """``(module, attribute)`` where a state key names an attachable parameter the module lacks, else None."""
        path, _, attr = name.rpartition(".")
        try:
            owner = self.get_submodule(path)
        except AttributeError:
            return None
        if attr in owner.attachable_parameters and attr not in owner._parameters:
            return owner, attr
        return None

    def train(self, mode: bool = True) -> Self:
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> Self:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Self:
        params = list(self.parameters())
        for param in params:  # check them all first, so a failure leaves every flag as it was
            if requires_grad and not param.description:
                raise ValueError(f"parameter {param.name} has no description and cannot be made learnable")
        for param in params:
            param.requires_grad = requires_grad
        return self

    def _bump_state_version(self) -> None:
        object.__setattr__(self, "_module_state_version", self._module_state_version + 1)

    # -- tracing hooks ----------------------------------------------------------------------------------------
    def _is_leaf_module(self) -> bool:
        if self.is_leaf is not None:
            return self.is_leaf
        # parameter containers hold state, not computation: they do not make a module composite
        return not any(not isinstance(m, ParameterList | ParameterDict) for m in self._modules.values())

    def node_config(self) -> dict[str, Any]:
        """What identifies this module's behaviour in a graph hash (not its inputs)."""
        return {"class": f"{type(self).__module__}:{type(self).__qualname__}"}

    def output_kind(self) -> ValueKind:
        return ValueKind.OTHER

    # -- calling ----------------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def bind(self, resources: Any, max_concurrent: int = 100, **settings: Any) -> Self:
        """Attach resources (and run settings) so that ``await module(x)`` runs the pipeline."""
        from app.pipeline.run_settings import validate_setting_names

        validate_setting_names(settings)
        object.__setattr__(self, "_bound_resources", resources)
        object.__setattr__(self, "_bound_settings", {"max_concurrent": max_concurrent, **settings})
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = get_active_tracer()
        if tracer is not None:
            if self._is_leaf_module():
                return tracer.record_call(self, args, kwargs)
            return tracer.trace_forward(self, args, kwargs)
        from app.pipeline.run_settings import get_execution_settings

        settings = get_execution_settings()
        if self._bound_resources is not None or (settings is not None and settings.resources is not None):
            return _run(self, args, kwargs)
        return self.forward(*args, **kwargs)

    def run_sync(self, *args: Any, **kwargs: Any) -> Any:
        """Run from a script (no event loop running): traces, executes and returns the result."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("run_sync() cannot be used inside a running event loop; use `await module(...)`")

        async def main() -> Any:
            result = _run(self, args, {**kwargs, "streaming": False})
            return await result

        return asyncio.run(main())

    async def backward(self, feedback: Any, ctx: BackwardContext) -> BackwardResult:
        """Default: pass the feedback unchanged to every input."""
        from app.pipeline.backward import BackwardResult

        return BackwardResult(input_feedback={name: feedback for name in ctx.input_names()})

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child_repr}")
        return "\n".join(lines) + ")" if self._modules else f"{type(self).__name__}()"


InferenceModule = Module


# -- containers -----------------------------------------------------------------------------------------------
def _checked(container: Module, item: Any, kind: type) -> Any:
    """Containers hold only modules (or parameters): anything else would silently become a plain attribute."""
    if not isinstance(item, kind):
        raise TypeError(f"{type(container).__name__} holds {kind.__name__}s, got {type(item).__name__}")
    return item


class Sequential(Module):
    """Calls its children in order, each on the previous one's output."""

    def __init__(self, *modules: Module | dict[str, Module]) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], dict):
            for name, child in modules[0].items():
                setattr(self, name, _checked(self, child, Module))
        else:
            for index, item in enumerate(modules):
                if not isinstance(item, Module):
                    raise TypeError(f"Sequential takes modules, got {type(item).__name__}")
                setattr(self, str(index), item)

    def forward(self, x: Any) -> Any:
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class ModuleList(Module):
    def __init__(self, modules: list[Module] | None = None) -> None:
        super().__init__()
        for module in modules or []:
            self.append(module)

    def append(self, module: Module) -> Self:
        setattr(self, str(len(self._modules)), _checked(self, module, Module))
        return self

    def extend(self, modules: list[Module]) -> Self:
        for module in modules:
            self.append(module)
        return self

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def __setitem__(self, index: int, module: Module) -> None:
        key = list(self._modules)[index]
        setattr(self, key, _checked(self, module, Module))

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ModuleList is a container; call its modules from a parent's forward()")


class ModuleDict(Module):
    def __init__(self, modules: dict[str, Module] | None = None) -> None:
        super().__init__()
        for name, module in (modules or {}).items():
            self[name] = module

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        setattr(self, key, _checked(self, module, Module))

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._modules))

    def keys(self) -> list[str]:
        return list(self._modules)

    def values(self) -> list[Module]:
        return list(self._modules.values())

    def items(self) -> list[tuple[str, Module]]:
        return list(self._modules.items())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ModuleDict is a container; call its modules from a parent's forward()")


class ParameterList(Module):
    def __init__(self, parameters: list[Parameter] | None = None) -> None:
        super().__init__()
        for param in parameters or []:
            self.append(param)

    def append(self, param: Parameter) -> Self:
        setattr(self, str(len(self._parameters)), _checked(self, param, Parameter))
        return self

    def __getitem__(self, index: int) -> Parameter:
        return list(self._parameters.values())[index]

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self) -> Iterator[Parameter]:
        return iter(list(self._parameters.values()))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ParameterList holds parameters; it cannot be called")


class ParameterDict(Module):
    def __init__(self, parameters: dict[str, Parameter] | None = None) -> None:
        super().__init__()
        for name, param in (parameters or {}).items():
            self[name] = param

    def __getitem__(self, key: str) -> Parameter:
        return self._parameters[key]

    def __setitem__(self, key: str, param: Parameter) -> None:
        setattr(self, key, _checked(self, param, Parameter))

    def __contains__(self, key: object) -> bool:
        return key in self._parameters

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._parameters))

    def keys(self) -> list[str]:
        return list(self._parameters)

    def values(self) -> list[Parameter]:
        return list(self._parameters.values())

    def items(self) -> list[tuple[str, Parameter]]:
        return list(self._parameters.items())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ParameterDict holds parameters; it cannot be called")
