"""Structured outputs on the default model (SmolLM2-135M-Instruct): a valid JSON object for a small schema."""

from __future__ import annotations

import json

import pytest

from app.engine import LLMEngine, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
}


@pytest.mark.slow
def test_smollm2_writes_json_for_a_schema() -> None:
    from app.engine.loading import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("xgrammar")
    engine = LLMEngine(num_threads=2)
    spec = StructuredOutputsParams(json=SCHEMA)
    messages = [{"role": "user", "content": "Describe Alice, a 30 year old engineer from Paris, as JSON."}]
    greedy = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=spec)
    sampled = SamplingParams(temperature=0.8, max_tokens=64, n=2, seed=0, structured_outputs=spec)
    for params in (greedy, sampled):
        [output] = engine.chat(messages, params)
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            value = json.loads(completion.text)
            assert set(value) == {"name", "age", "city"}
            assert isinstance(value["name"], str) and len(value["name"]) <= 20
            assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
            assert isinstance(value["city"], str) and len(value["city"]) <= 30
    [choice] = engine.generate(
        "Is Paris the capital of France? Answer:",
        SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=[" yes", " no"])
        ),
    )
    assert choice.outputs[0].text in (" yes", " no")
