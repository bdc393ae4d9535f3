"""``/v1/embeddings`` lines of a Batch API file: their checks, the 50,000-input cap of a batch, the job item a line
becomes, the pipeline it runs as (with a scripted embedding endpoint) and the output line written from it."""

from __future__ import annotations

import base64
import json
import struct
from types import SimpleNamespace
from typing import Any

import pytest

from app.jobs.batches.pipeline import BATCH_ALIAS, BatchEmbeddingRequest
from app.jobs.batches.service import output_line
from app.jobs.files.batch_lines import (
    EMBEDDINGS,
    MAX_EMBEDDING_INPUTS_PER_BATCH,
    check_lines,
    embedding_input_count,
    item_of,
    parse_request_lines,
)
from app.jobs.registry import Registry
from app.pipeline import run
from tests.support.fakes import ScriptedResources, fake_vector


def _line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS,
            "body": {"model": "text-embedding-3-small", **body}}


def _file(*lines: Any) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode()


def test_embedding_lines_are_accepted_at_upload_and_fit_an_embeddings_batch() -> None:
    lines = parse_request_lines(_file(
        _line("a", input="one text"), _line("b", input=["two", "texts"]), _line("c", input=[1, 2, 3]),
        _line("d", input=[[1, 2], [3]], encoding_format="base64", dimensions=64, user="u")))
    assert [r.url for r in lines] == [EMBEDDINGS] * 4
    assert check_lines(lines, EMBEDDINGS) == []
    assert [embedding_input_count(r.body["input"]) for r in lines] == [1, 2, 1, 2]
    # a chat line does not fit an embeddings batch, nor an embeddings line a chat batch
    chat = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]}}
    mixed = parse_request_lines(_file(_line("a", input="t"), chat))
    assert [(p.code, p.line) for p in check_lines(mixed, EMBEDDINGS)] == [("mismatched_endpoint", 2)]
    assert [(p.code, p.line) for p in check_lines(mixed, "/v1/chat/completions")] == [("mismatched_endpoint", 1)]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({}, "body.input", "must be a string, a list of strings"),
    ({"input": ""}, "body.input", "empty string"),
    ({"input": []}, "body.input", "must be a string"),
    ({"input": ["a", ""]}, "body.input", "body.input[1] is empty"),
    ({"input": [[1], []]}, "body.input", "body.input[1] is empty"),
    ({"input": ["a", [1]]}, "body.input", "not a mix"),
    ({"input": [1, -2]}, "body.input", "must be a string"),
    ({"input": {"text": "a"}}, "body.input", "must be a string"),
    ({"input": ["x"] * 2049}, "body.input", "at most 2048"),
    ({"input": "a", "encoding_format": "int8"}, "body.encoding_format", "'float' or 'base64'"),
    ({"input": "a", "dimensions": 0}, "body.dimensions", "positive integer"),
    ({"input": "a", "dimensions": True}, "body.dimensions", "positive integer"),
])
def test_an_invalid_body_fails_the_batch_naming_its_line(body: dict[str, Any], param: str, message: str) -> None:
    lines = parse_request_lines(_file(_line("ok", input="fine"), _line("bad", **body)))
    (problem,) = check_lines(lines, EMBEDDINGS)
    assert (problem.code, problem.line, problem.param) == ("invalid_request", 2, param)
    assert message in problem.message and problem.message.startswith("line 2:")


def test_a_batch_holds_at_most_50000_inputs_across_its_lines() -> None:
    per_line = 2000
    count = MAX_EMBEDDING_INPUTS_PER_BATCH // per_line  # 25 lines of 2,000: exactly at the cap
    lines = parse_request_lines(_file(*[_line(str(i), input=["t"] * per_line) for i in range(count)]))
    assert check_lines(lines, EMBEDDINGS) == []
    over = parse_request_lines(_file(*[_line(str(i), input=["t"] * per_line) for i in range(count)],
                                     _line("last", input=["t", "u"])))
    (problem,) = check_lines(over, EMBEDDINGS)
    assert (problem.code, problem.line, problem.param) == ("too_many_inputs", count + 1, "body.input")
    assert "50002 embedding inputs" in problem.message and "at most 50,000" in problem.message


def test_a_line_becomes_an_item_of_the_embedding_pipeline() -> None:
    (line,) = parse_request_lines(_file(_line("d", input=["a", "b"], encoding_format="base64", dimensions=2,
                                               user="u")))
    assert item_of(line, EMBEDDINGS) == {"custom_id": "d", "input": {
        "input": ["a", "b"], "dimensions": 2, "encoding_format": "base64", "options": {"user": "u"}}}
    (plain,) = parse_request_lines(_file(_line("p", input="x")))
    assert item_of(plain, EMBEDDINGS)["input"] == {"input": "x", "dimensions": None, "encoding_format": "float",
                                                   "options": {}}
    path = "app.jobs.batches.pipeline:BatchEmbeddingRequest"
    assert Registry().pipeline_path(path) == path  # the platform's own pipeline: accepted by path, never listed


async def test_the_pipeline_and_the_output_line() -> None:
    resources = ScriptedResources()
    (line,) = parse_request_lines(_file(_line("d", input=["ab", "cde"], encoding_format="base64", user="u")))
    output = await run(BatchEmbeddingRequest(), **item_of(line, EMBEDDINGS)["input"], resources=resources)
    (alias, request), = resources.embed_requests
    assert alias == BATCH_ALIAS and request.input == ["ab", "cde"] and request.extra_body == {"user": "u"}
    assert output["embeddings"] == [fake_vector("ab"), fake_vector("cde")] and output["encoding_format"] == "base64"
    batch = SimpleNamespace(id="batch_1", endpoint=EMBEDDINGS)
    written = output_line(batch, SimpleNamespace(custom_id="d", output=output), 1)  # type: ignore[arg-type]
    assert written["custom_id"] == "d" and written["error"] is None
    assert written["response"]["status_code"] == 200
    body = written["response"]["body"]
    assert body["object"] == "list" and body["model"] == "fake-embed"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [row["index"] for row in body["data"]] == [0, 1]
    assert all(row["object"] == "embedding" for row in body["data"])
    decoded = list(struct.unpack("<4f", base64.b64decode(body["data"][1]["embedding"])))
    assert decoded == fake_vector("cde")
    # one text: one vector, as floats
    floats = await run(BatchEmbeddingRequest(), input="x", dimensions=2, encoding_format="float", options={},
                       resources=resources)
    single = output_line(batch, SimpleNamespace(custom_id="s", output=floats), 1)  # type: ignore[arg-type]
    assert single["response"]["body"]["data"] == [{"object": "embedding", "index": 0,
                                                   "embedding": fake_vector("x", 2)}]
