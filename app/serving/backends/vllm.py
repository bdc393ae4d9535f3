"""vLLM as a managed subprocess: ``<python> -m vllm.entrypoints.openai.api_server`` on a free loopback port.

``start`` resolves the model to a Hugging Face folder (a GGUF such as the default SmolLM2 goes through the
converted cache), launches vLLM's OpenAI server from the configured Python (a virtual environment that has
vLLM; ours need not), waits for its ``/health``, then proxies exactly like the ``openai`` backend. ``stop``
terminates it (SIGTERM, then SIGKILL to its process group after a grace period), so no engine process is
left behind. vLLM's output goes to a log file whose tail is quoted when it fails to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from app.serving.backends.base import BackendUnavailableError, HealthStatus
from app.serving.backends.local import default_served_name, resolve_hf_folder
from app.serving.backends.openai_proxy import OpenAIProxyBackend
from app.settings import child_environment

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def vllm_engine_args(settings: Settings) -> list[str]:
    """The engine settings that `vllm serve` takes under the same names, as its flags (only those set away from
    the defaults, so that vLLM keeps its own defaults; our int8/gguf quantization and float32 KV cache have no
    vLLM counterpart and stay ours)."""
    args: list[str] = []
    if settings.dtype != "auto":
        args += ["--dtype", settings.dtype]
    if settings.kv_cache_dtype == "bfloat16":
        args += ["--kv-cache-dtype", "bfloat16"]
    for name in ("max_model_len", "max_num_batched_tokens", "seed"):
        value = getattr(settings, name)
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    if settings.max_num_seqs != 256:
        args += ["--max-num-seqs", str(settings.max_num_seqs)]
    if settings.block_size != 16:
        args += ["--block-size", str(settings.block_size)]
    if not settings.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if settings.chat_template is not None:
        args += ["--chat-template", settings.chat_template]
    if settings.enforce_eager:
        args.append("--enforce-eager")
    return args


class VLLMBackend(OpenAIProxyBackend):
    name = "vllm"

    def __init__(
        self,
        *,
        python: str | Path,
        model: str | None = None,
        served_model_name: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 900.0,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        name = default_served_name(model, served_model_name)
        super().__init__(
            base_url="http://127.0.0.1:0/v1", upstream_model=name, served_model_name=name, timeout=timeout
        )
        self.python = Path(python)
        self.model_path = model
        self.extra_args = list(extra_args or [])
        self.startup_timeout = startup_timeout
        self.env = dict(env or {})
        self.process: asyncio.subprocess.Process | None = None
        self.log_path: Path | None = None
        self.port: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> VLLMBackend:
        if settings.vllm_python is None:
            raise ValueError(
                "the vllm backend needs INF_ENGINE_VLLM_PYTHON: the python executable of a virtual "
                "environment with vLLM installed (e.g. /opt/vllm-env/bin/python)"
            )
        return cls(
            python=settings.vllm_python,
            model=settings.model,
            served_model_name=settings.served_model_name,
            extra_args=[*vllm_engine_args(settings), *settings.vllm_extra_args],
            startup_timeout=settings.vllm_startup_timeout,
            timeout=settings.upstream_timeout,
        )

    def command(self, model_folder: Path, port: int) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_folder),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.extra_args,
        ]

    async def start(self) -> None:
        if self.process is not None:
            return
        if not self.python.is_file():
            raise BackendUnavailableError(f"the vLLM python {self.python} does not exist")
        folder = await asyncio.to_thread(resolve_hf_folder, self.model_path)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        fd, log_name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
        self.log_path = Path(log_name)
        env = child_environment(self.env)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command(folder, self.port),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=fd,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stop() can kill vLLM's workers with it
            )
        finally:
            os.close(fd)
        log.info("started vLLM (pid %d) on port %d; its log: %s", self.process.pid, self.port, self.log_path)
        try:
            await self._wait_ready()
            await super().start()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://127.0.0.1:{self.port}/health"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                assert self.process is not None
                if self.process.returncode is not None:
                    raise BackendUnavailableError(
                        f"vLLM exited with code {self.process.returncode} while starting. "
                        f"Its log ({self.log_path}) ends with:\n{self.log_tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise BackendUnavailableError(
                        f"vLLM did not answer {url} within {self.startup_timeout:.0f}s "
                        f"(raise INF_ENGINE_VLLM_STARTUP_TIMEOUT?). Its log ends with:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:])

    async def stop(self) -> None:
        await super().stop()
        proc, self.process = self.process, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_SECONDS)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group we created: vLLM and its engine workers
            await proc.wait()
        # Engine-core children may outlive a parent that exited on SIGTERM; end the group's stragglers.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def health(self) -> HealthStatus:
        if self.process is None or self.process.returncode is not None:
            code = None if self.process is None else self.process.returncode
            return HealthStatus(False, f"the vLLM process is not running (exit code {code})")
        return await super().health()
