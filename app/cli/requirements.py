"""What a command needs that an install may lack: the engine extra (torch and friends) and the Flower extra.

``pip install inf-engine`` brings the platform without torch; the commands that run a model in this process say
in one line to install ``inf-engine[engine]`` (exit status 2) instead of dying with a traceback.
"""

from __future__ import annotations

from importlib.util import find_spec

from app.cli.console import fail

#: the top-level modules of the ``engine`` extra (pyproject.toml)
ENGINE_MODULES = frozenset(
    {"torch", "transformers", "safetensors", "tokenizers", "gguf", "jinja2", "numpy", "xgrammar"}
)
#: backends that run a model inside this process (the others call a server)
IN_PROCESS_BACKENDS = frozenset({"native", "transformers"})


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken parent package
        return False


def engine_missing_message(module: str, command: str) -> str:
    return (
        f"`inf-engine {command}` needs the engine, and {module} is not installed: "
        "pip install 'inf-engine[engine]'"
    )


def missing_extra_message(exc: ModuleNotFoundError, command: str) -> str | None:
    """The one line for a module of an extra that an install lacks; None for any other missing module."""
    root = (exc.name or "").split(".")[0]
    if root in ENGINE_MODULES:
        return engine_missing_message(root, command)
    if root in {"flower", "tornado"}:
        return f"`inf-engine {command}` needs Flower, which is not installed: pip install 'inf-engine[flower]'"
    return None


def require_engine(command: str) -> None:
    """Stop ``command`` in one line (exit status 2) when a module of the engine extra is not installed."""
    missing = [module for module in sorted(ENGINE_MODULES, key=lambda m: m != "torch") if not _installed(module)]
    if missing:
        raise fail(engine_missing_message(missing[0], command))


def require_framework(framework: str, command: str) -> None:
    """A model runner framework (jax, tinygrad) comes with its own extra."""
    if not _installed(framework):
        raise fail(
            f"`inf-engine {command} --framework {framework}` needs {framework}, which is not installed: "
            f"pip install 'inf-engine[{framework}]'"
        )


def require_flower() -> None:
    if not _installed("flower"):
        raise fail("`inf-engine flower` needs Flower, which is not installed: pip install 'inf-engine[flower]'")
