"""The optimization loop over HTTP: pipeline, rubric judge and optimizer all talk to fake OpenAI servers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from app.pipeline import EndpointConfig, LLMInference, Module, Parameter, ResourceConfig
from app.pipeline.optimization import LLMRubricLoss, SFAOptimizer, train
from app.testing.fake_llm_server import FakeLLMServer


class Pipeline(Module):
    def __init__(self) -> None:
        super().__init__()
        self.answer = LLMInference("task", system_prompt=Parameter("Answer.", description="answering instructions"))

    def forward(self, question):
        return self.answer(question)


@pytest.fixture
def servers() -> Iterator[tuple[FakeLLMServer, FakeLLMServer]]:
    # one echoes (the pipeline); the other answers with its model name, so each alias gets a canned reply
    with FakeLLMServer() as echo, FakeLLMServer(reply="{model}") as canned:
        yield echo, canned


def endpoint(server: FakeLLMServer, model: str) -> EndpointConfig:
    return EndpointConfig("openai", model, base_url=server.base_url, api_key="sk-test")


async def test_training_over_http(servers: tuple[FakeLLMServer, FakeLLMServer]) -> None:
    echo, canned = servers
    verdict = json.dumps({"score": 2, "justification": "echoes", "feedback": "answer instead of echoing"})
    resources = ResourceConfig({
        "task": endpoint(echo, "fake"),
        "judge": endpoint(canned, verdict),
        "optimizer/aggregator": endpoint(canned, "Stop echoing the question."),
        "optimizer/updater": endpoint(canned, "Answer the question directly."),
    })
    module = Pipeline().bind(resources)
    loss = LLMRubricLoss("helpfulness", {1: "useless", 2: "weak", 3: "good"}).bind(resources)
    optimizer = SFAOptimizer(module.parameters()).bind(resources)
    history = await train(module, [("q1", None), ("q2", None)], loss, optimizer, epochs=1, batch_size=2, seed=0)
    assert history.scores == [0.5]
    assert history.final_state == {"answer.system_prompt": "Answer the question directly."}
    (update,) = history.updates
    assert update.feedback == "Stop echoing the question." and update.scores == [0.5, 0.5]
    assert sorted(echo.stats()["prompts"]) == ["q1", "q2"]
    canned_prompts = canned.stats()["prompts"]
    assert sum(canned_prompts.values()) == 4  # two judgements, one aggregation, one update
    assert any("Upstream" not in p and "answering instructions" in p for p in canned_prompts)
