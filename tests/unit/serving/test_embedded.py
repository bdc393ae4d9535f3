"""The pipeline's in-process engine client on a tiny random-weight Llama: answers, batching, errors, sharing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.pipeline import LLMInference, Module, ResourceManager, run
from app.pipeline.resources import (
    ConfigurationError,
    EndpointConfig,
    LLMRequest,
    ResourceError,
    create_client,
    register_client_factory,
)
from app.serving.embedded import (
    EmbeddedEngine,
    EmbeddedEngineClient,
    embedded_resources,
    get_embedded_engine,
    register_embedded_engine,
)
from tests.support.server_helpers import build_tiny_llama

# Tests start fast and keep the KV cache small; one torch thread (tiny models gain nothing from more).
ENGINE_OPTIONS = {"warmup": False, "kv_cache_memory_bytes": 16 << 20, "seed": 0}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("embedded") / "tiny-llama"))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(tiny_model: str) -> EmbeddedEngine:
    return get_embedded_engine(tiny_model, **ENGINE_OPTIONS)


@pytest.fixture
def registered() -> Iterator[None]:
    previous = register_client_factory("native", None)
    register_embedded_engine(**ENGINE_OPTIONS)
    yield
    register_client_factory("native", previous)


def request(**kwargs: object) -> LLMRequest:
    return LLMRequest(prompt=MESSAGES[1]["content"], system_prompt=MESSAGES[0]["content"], **kwargs)  # type: ignore[arg-type]


async def test_answers_with_usage_counts_and_the_chat_template(tiny_model: str, engine: EmbeddedEngine) -> None:
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    try:
        response = await client.complete(request(temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True}))
        backend = await engine.backend()
        tokenizer = backend.codec
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n")  # the model's template was applied
        assert response.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert response.output_tokens == 6 and response.finish_reason == "length"
        assert response.content and response.model == "tiny-llama"
        assert response.time_to_first_token_ms is not None and response.completion_time_ms is not None
        assert response.time_to_first_token_ms <= response.completion_time_ms
        # Greedy: the engine's own offline API gives the same text for the same conversation.
        again = await client.complete(request(temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True}))
        assert again.content == response.content
    finally:
        await client.aclose()


async def test_stop_strings_end_the_answer(tiny_model: str, engine: EmbeddedEngine) -> None:
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    try:
        full = await client.complete(request(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True}))
        stop = full.content.strip()[3:6]
        assert len(stop) == 3, full.content
        cut = await client.complete(
            request(temperature=0.0, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
        )
        assert cut.finish_reason == "stop"
        assert cut.content == full.content[: full.content.index(stop)]
        assert cut.output_tokens < full.output_tokens
    finally:
        await client.aclose()


async def test_concurrent_calls_are_batched_by_the_engine(tiny_model: str, engine: EmbeddedEngine) -> None:
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    n, tokens = 8, 32
    prompts = [f"review number {i}: the fox" for i in range(n)]

    def req(text: str) -> LLMRequest:
        return LLMRequest(text, temperature=0.0, max_tokens=tokens, extra_body={"ignore_eos": True})

    try:
        await client.complete(req("warm up"))
        one_by_one = [await client.complete(req(p)) for p in prompts]
        async_engine = engine.async_engine
        steps_before = async_engine.num_steps
        together = await asyncio.gather(*(client.complete(req(p)) for p in prompts))
        steps = async_engine.num_steps - steps_before
    finally:
        await client.aclose()
    # Greedy answers do not depend on what else is in the batch.
    assert [r.content for r in together] == [r.content for r in one_by_one]
    assert all(r.output_tokens == tokens for r in together)
    # One step decodes every request: about `tokens` steps in all, not n * tokens (counted, not timed).
    assert steps <= tokens + n, steps


async def test_one_engine_per_model_shared_by_every_alias(
    tiny_model: str, registered: None, engine: EmbeddedEngine
) -> None:
    config = embedded_resources(["fast", "judge"], tiny_model)
    assert {alias: eps[0].provider for alias, eps in config.items()} == {"fast": "native", "judge": "native"}
    manager = ResourceManager(config)
    try:
        kwargs = {"temperature": 0.0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}
        a, b = await asyncio.gather(manager.complete("fast", request(**kwargs)), manager.complete("judge", request(**kwargs)))
        assert a.content == b.content
        clients = [manager._client(ep) for eps in manager._endpoints.values() for ep in eps]
        assert all(isinstance(c, EmbeddedEngineClient) and c.engine is engine for c in clients)
        # Same model under another spelling of its path: still the same engine.
        assert get_embedded_engine(str(Path(tiny_model) / ".." / "tiny-llama")) is engine
        metrics = manager.metrics("fast")
        assert metrics.successes == 1 and metrics.input_tokens == a.input_tokens and metrics.output_tokens == 4
    finally:
        await manager.aclose()
    assert not engine.async_engine.is_running  # the last client closed: the loop-side engine stopped


async def test_a_pipeline_runs_on_the_embedded_engine_with_costs(tiny_model: str, registered: None) -> None:
    class TwoCalls(Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = LLMInference("assistant", temperature=0.0, max_tokens=5)
            self.second = LLMInference("assistant", system_prompt="rephrase", temperature=0.0, max_tokens=5)

        def forward(self, text: str) -> object:
            return self.second(self.first(text))

    config = embedded_resources(["assistant"], tiny_model)
    endpoint = config["assistant"][0].model_copy(update={"input_cost_per_1m": 1.0, "output_cost_per_1m": 2.0})
    manager = ResourceManager({"assistant": endpoint})
    try:
        answer = await run(TwoCalls(), "the quick brown fox", resources=manager)
        assert isinstance(answer, str)
        metrics = manager.metrics("assistant")
        assert metrics.successes == 2 and metrics.input_tokens > 0 and metrics.output_tokens > 0
        expected = (metrics.input_tokens * 1.0 + metrics.output_tokens * 2.0) / 1e6
        assert manager.estimate_cost("assistant") == pytest.approx(expected)
    finally:
        await manager.aclose()


async def test_invalid_requests_are_resource_errors_naming_the_field(
    tiny_model: str, engine: EmbeddedEngine
) -> None:
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    try:
        with pytest.raises(ResourceError, match="temperature") as bad:
            await client.complete(request(temperature=-1.0))
        assert bad.value.status == 400
        with pytest.raises(ResourceError, match="top_p") as bad:
            await client.complete(request(extra_body={"top_p": 5.0}))
        assert bad.value.status == 400
        with pytest.raises(ResourceError, match="maximum context length") as bad:
            await client.complete(LLMRequest("fox " * 600, max_tokens=4))
        assert bad.value.status == 400
    finally:
        await client.aclose()


async def test_a_cancelled_call_frees_its_sequence(tiny_model: str, engine: EmbeddedEngine) -> None:
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    try:
        task = asyncio.create_task(
            client.complete(request(temperature=0.0, max_tokens=400, extra_body={"ignore_eos": True}))
        )
        async_engine = None
        for _ in range(500):
            await asyncio.sleep(0.01)
            async_engine = engine.async_engine
            if async_engine is not None and async_engine.is_running and async_engine.num_steps > 2:
                break
        assert async_engine is not None and async_engine.engine.get_num_unfinished_requests() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if async_engine.engine.get_num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.01)
        assert async_engine.engine.get_num_unfinished_requests() == 0
        assert async_engine.get_stats().kv_cache_usage_perc == 0.0
    finally:
        await client.aclose()


def test_the_engine_serves_one_asyncio_run_after_another(tiny_model: str, engine: EmbeddedEngine) -> None:
    client = EmbeddedEngineClient(EndpointConfig("native", tiny_model), engine=engine)
    kwargs = {"temperature": 0.0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    # No aclose between the runs: the second loop must still get a working engine over the same weights.
    first = asyncio.run(client.complete(request(**kwargs)))
    second = asyncio.run(client.complete(request(**kwargs)))
    asyncio.run(client.aclose())
    assert first.content == second.content and second.output_tokens == 4


def test_models_that_are_not_there_are_configuration_errors(tmp_path: Path, registered: None) -> None:
    with pytest.raises(ConfigurationError, match="never downloads"):
        embedded_resources(["assistant"], str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="never downloads"):
        create_client(EndpointConfig("native", "meta-llama/Llama-3-8B"))
    # The default model's name (and None) mean the packaged SmolLM2: nothing is loaded until a call.
    config = embedded_resources(["a"])
    assert config["a"][0].model == "SmolLM2-135M-Instruct"
    default_client = create_client(config["a"][0])
    assert isinstance(default_client, EmbeddedEngineClient)
    asyncio.run(default_client.aclose())
    # A base_url still means HTTP to a server, even for provider native.
    http = create_client(EndpointConfig("native", "m", base_url="http://127.0.0.1:9/v1"))
    assert not isinstance(http, EmbeddedEngineClient)


def test_without_registration_a_native_endpoint_says_how_to_run_in_process() -> None:
    previous = register_client_factory("native", None)
    try:
        with pytest.raises(ConfigurationError, match="register_embedded_engine"):
            create_client(EndpointConfig("native", "SmolLM2-135M-Instruct"))
    finally:
        register_client_factory("native", previous)
