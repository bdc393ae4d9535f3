"""`inf-engine serve --host --port --backend --model` as a user starts it: a real process on 127.0.0.1.

Driven by the async ``openai`` client and by a pipeline whose ``native`` endpoint has the server's base_url;
stopped with SIGTERM, which must shut it down cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator

import openai
import pytest

from app.pipeline import LLMInference, ResourceConfig, run
from tests.support.cli_process import Served, cli, wait_healthy
from tests.support.cluster import free_port
from tests.support.server_helpers import build_tiny_llama

pytestmark = pytest.mark.timeout(120)
KEY = "sk-serve-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("cli-serve")
    model = build_tiny_llama(root / "tiny-llama")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(INF_ENGINE_API_KEYS=json.dumps([KEY]), INF_ENGINE_NUM_THREADS="1", INF_ENGINE_DATA_DIR=str(root))
    log = root / "serve.log"
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--backend", "native", "--model", str(model)]
    with log.open("wb") as sink:
        proc = subprocess.Popen([*cli(), *args], cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT)
    served = Served(proc, port, log)
    try:
        wait_healthy(proc, port, log)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_serves_the_model_it_was_given_with_openai_errors(served: Served) -> None:
    client = openai.AsyncOpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=60)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    chat = await client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "the fox"}], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 5
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=served.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


async def test_a_pipeline_reaches_the_server_through_a_native_endpoint(served: Served) -> None:
    resources = ResourceConfig(
        {"assistant": {"provider": "native", "model": "tiny-llama", "base_url": served.base_url, "api_key": KEY}}
    )
    answer = await run(LLMInference("assistant", temperature=0.0, max_tokens=4), "the fox", resources=resources)
    assert isinstance(answer, str)


def test_sigterm_stops_the_server_cleanly(served: Served) -> None:
    # Runs last in this module: the fixture's process is stopped here.
    served.proc.send_signal(signal.SIGTERM)
    code = served.proc.wait(30)
    log = served.log.read_text()
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status still says "terminated".
    assert code in (0, -signal.SIGTERM), log
    assert "Application shutdown complete." in log
    assert "serving 'tiny-llama' with the native backend on http://127.0.0.1:" in log
    assert "Traceback" not in log
