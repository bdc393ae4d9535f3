"""``inf-engine serve [MODEL]``: the OpenAI-compatible server, with vLLM's engine flags under vLLM's names.

Every flag is a setting (``INF_ENGINE_<NAME>`` or ``inf-engine.toml``) given on the command line; a bad value is
one line naming the flag, and exit status 2.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.console import fail
from app.cli.requirements import IN_PROCESS_BACKENDS, require_engine, require_framework

_ENGINE = "Engine (vLLM's names and meanings)"

ModelArgument = Annotated[str | None, typer.Argument(
    metavar="MODEL", help="HF folder or .gguf file to serve, as `vllm serve MODEL` (same as --model)")]

#: each setting a flag overrides, and the flag (for error lines)
FLAGS = {
    "serve_host": "--host", "serve_port": "--port", "backend": "--backend", "model": "MODEL/--model",
    "api_keys": "--api-key", "dtype": "--dtype", "quantization": "--quantization",
    "kv_cache_dtype": "--kv-cache-dtype", "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens", "block_size": "--block-size",
    "enable_prefix_caching": "--enable-prefix-caching", "served_model_name": "--served-model-name",
    "chat_template": "--chat-template", "seed": "--seed", "enforce_eager": "--enforce-eager",
    "embedding_model": "--embedding-model", "embedding_dtype": "--embedding-dtype", "framework": "--framework",
    "pooler_config": "--pooler-config",
}


def serve_command(
    model_arg: ModelArgument = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default: settings.serve_host)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: settings.serve_port)")] = None,
    backend: Annotated[str | None, typer.Option(
        help="native, transformers, vllm or openai (default: settings.backend)")] = None,
    model: Annotated[str | None, typer.Option(
        help="HF folder or .gguf file to serve (default: settings.model or SmolLM2)")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Bearer key clients must send (repeat for several; 'tenant:key' names a tenant); "
        "replaces settings.api_keys")] = None,
    dtype: Annotated[str | None, typer.Option(
        help="auto, float32 (float), bfloat16 or float16 (half)", rich_help_panel=_ENGINE)] = None,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", "-q", help="none, int8 (weight-only) or gguf (the GGUF file's own blocks); unset: per CPU class",
        rich_help_panel=_ENGINE)] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(
        help="auto, float32 or bfloat16", rich_help_panel=_ENGINE)] = None,
    max_model_len: Annotated[str | None, typer.Option(
        help="Context length (prompt + output), e.g. 4096, 4k (4000) or 4K (4096)", rich_help_panel=_ENGINE)] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences in one step", rich_help_panel=_ENGINE)] = None,
    max_num_batched_tokens: Annotated[str | None, typer.Option(
        help="Token budget of one step", rich_help_panel=_ENGINE)] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Tokens per KV-cache block: 1, 8, 16, 32, 64 or 128", rich_help_panel=_ENGINE)] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV blocks of shared prompt prefixes",
        rich_help_panel=_ENGINE)] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="The model id clients send and /v1/models lists", rich_help_panel=_ENGINE)] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="A Jinja file, or the template itself, instead of the model's", rich_help_panel=_ENGINE)] = None,
    seed: Annotated[int | None, typer.Option(
        help="Seeds sampling for requests without their own seed", rich_help_panel=_ENGINE)] = None,
    embedding_model: Annotated[str | None, typer.Option(
        help="Also serve /v1/embeddings from this model: a sentence-transformers folder, or all-MiniLM-L6-v2 (the "
        "packaged one)")] = None,
    embedding_dtype: Annotated[str | None, typer.Option(
        help="The embedding model's products: float32, or bfloat16 on CPUs with AVX512-BF16 or AMX")] = None,
    enforce_eager: Annotated[bool | None, typer.Option(
        "--enforce-eager/--no-enforce-eager", help="CUDA: never replay decode steps from CUDA graphs",
        rich_help_panel=_ENGINE)] = None,
    framework: Annotated[str | None, typer.Option(
        help="The native engine's model runner: torch, jax or tinygrad (the last two need their extra)",
        rich_help_panel=_ENGINE)] = None,
    pooler_config: Annotated[str | None, typer.Option(
        help='The chat model also serves /v1/embeddings: {"pooling_type": "LAST" or "MEAN", "normalize": true}',
        rich_help_panel=_ENGINE)] = None,
) -> None:
    """Serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...) with uvicorn.

    The flags override the settings (INF_ENGINE_* and inf-engine.toml), which stay the source of truth."""
    if model_arg is not None and model is not None and model_arg != model:
        raise fail(f"MODEL {model_arg!r} and --model {model!r} differ: give the model once")
    given = {
        "serve_host": host, "serve_port": port, "backend": backend, "model": model_arg or model, "api_keys": api_key,
        "dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
        "enable_prefix_caching": enable_prefix_caching, "served_model_name": served_model_name,
        "chat_template": chat_template, "seed": seed, "enforce_eager": enforce_eager,
        "embedding_model": embedding_model, "embedding_dtype": embedding_dtype, "framework": framework,
        "pooler_config": pooler_config,
    }
    settings = serve_settings({k: v for k, v in given.items() if v is not None})
    if settings.backend in IN_PROCESS_BACKENDS:
        require_engine("serve")
    _run(settings)


def _run(settings: Any) -> None:
    import uvicorn

    from api.main import create_app
    from app.serving.logs import configure_logging

    configure_logging(settings.log_level)
    try:
        application = create_app(settings)
    except ValueError as exc:  # e.g. a backend that misses its settings
        raise fail(str(exc)) from None
    logging.getLogger("inf_engine.cli").info(
        "serving %r with the %s backend on http://%s:%s/v1",
        application.state.backend.served_model_name, settings.backend, settings.serve_host, settings.serve_port,
    )
    uvicorn.run(application, host=settings.serve_host, port=settings.serve_port, log_config=None,
                access_log=False, timeout_graceful_shutdown=10)


def serve_settings(overrides: dict[str, Any]) -> Any:
    """The settings with the command line's flags on top (each flag named in its own error line)."""
    from app.serving.backends.local import load_chat_template
    from app.settings import Settings, settings_error_message

    try:
        settings = Settings(**overrides)
    except Exception as exc:
        message = settings_error_message(exc, {k: FLAGS[k] for k in overrides})
        if message is None:
            raise
        raise fail(message) from None
    model = overrides.get("model")
    if model is not None and not Path(model).expanduser().exists() and settings.backend != "openai":
        raise fail(f"model {model} does not exist (give an HF folder or a .gguf file; nothing is downloaded)")
    chosen = settings.model
    if settings.quantization == "gguf" and settings.backend == "native" and chosen and Path(chosen).expanduser().is_dir():
        where = "--quantization gguf" if "quantization" in overrides else "INF_ENGINE_QUANTIZATION=gguf"
        raise fail(
            f"{where} runs a GGUF file's own 4-bit blocks, and {chosen} is a folder: give a .gguf model (or none, "
            "for the default one), or leave quantization unset"
        )
    if settings.pooler_config is not None and settings.backend != "native":
        raise fail(f"--pooler-config pools our engine's hidden states: it needs the native backend, not "
                   f"{settings.backend}")
    if settings.framework != "torch" and settings.backend == "native":
        require_framework(settings.framework, "serve")
        _check_framework_options(settings)
    if settings.embedding_model is not None:
        _check_embedding_model(settings.embedding_model, settings.embedding_dtype)
    if settings.chat_template is not None and settings.backend != "vllm":
        try:
            load_chat_template(settings.chat_template)
        except ValueError as exc:
            raise fail(f"--chat-template: {exc}") from None
    return settings


def _check_framework_options(settings: Any) -> None:
    """What the jax and tinygrad runners refuse (a dtype, a KV cache dtype, a quantization) stops the server before
    it starts, in one line, rather than in the engine's start-up."""
    from app.engine.llm_engine import EngineConfig

    try:
        EngineConfig(framework=settings.framework, dtype=settings.dtype, kv_cache_dtype=settings.kv_cache_dtype,
                     quantization=settings.quantization)
    except ValueError as exc:
        raise fail(f"--framework {settings.framework}: {exc}") from None


def _check_embedding_model(spec: str, dtype: str = "float32") -> None:
    """A missing or unreadable embedding model, or bfloat16 on a CPU without it, stops the server before it
    starts, in one line."""
    try:
        from app.engine.embedding import resolve_embedding_model
    except ModuleNotFoundError as exc:  # the engine extra (torch) is not installed
        raise fail(f"--embedding-model needs the engine: {exc}") from None
    try:
        resolve_embedding_model(spec)
    except (FileNotFoundError, ValueError) as exc:
        raise fail(f"--embedding-model: {exc}") from None
    from app.engine.kernels.cpu_features import bf16_products_supported

    if dtype == "bfloat16" and not bf16_products_supported():
        raise fail("--embedding-dtype bfloat16 needs a CPU with AVX512-BF16 or AMX (this one has neither): use "
                   "float32")
