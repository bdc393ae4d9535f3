"""Helpers for server tests: a tiny random-weight Llama folder and uvicorn on a free 127.0.0.1 port."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from app.serving.backends.base import Backend


def native_available() -> bool:
    return importlib.util.find_spec("app.engine.async_engine") is not None


def build_tiny_llama(folder: Path) -> Path:
    """The colleague's tiny GQA Llama (random weights, peaked logits) saved as an HF folder."""
    from tests.support.engine_models import build_hf_model, save_hf_model

    if not (folder / "config.json").is_file():
        save_hf_model(build_hf_model("llama_gqa_llama3"), folder)
    return folder


# A tools-aware chat template (compact: the tool names only). The tiny model has 512 positions and about one
# token per character, too few for the fallback prompt that lists every tool's schema.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_tools_template(model: Path, folder: Path) -> Path:
    """A copy of the model folder ``model`` at ``folder`` whose chat template is :data:`TOOLS_TEMPLATE`."""
    if not (folder / "config.json").is_file():
        shutil.copytree(model, folder, dirs_exist_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return folder


def make_backend(kind: str, model: Path | None, *, max_waiting: int = 256, **engine_kwargs: Any) -> Backend:
    if kind == "native":
        from app.serving.backends.native import NativeBackend

        options = {"kv_cache_memory_bytes": 64 << 20, "warmup": False, **engine_kwargs}  # tests start fast
        return NativeBackend(
            model=None if model is None else str(model), max_waiting=max_waiting, engine_kwargs=options
        )
    if kind == "transformers":
        from app.serving.backends.transformers_backend import TransformersBackend

        return TransformersBackend(model=None if model is None else str(model), max_waiting=max_waiting)
    raise ValueError(kind)


class ServerThread:
    """A uvicorn server for ``app`` in a background thread, on a socket bound before it starts."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def start(self, timeout: float = 120.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in time")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
