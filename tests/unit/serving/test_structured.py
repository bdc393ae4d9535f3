"""response_format / structured_outputs / guided_* → StructuredOutputsParams; unsupported fields; best_of."""

from __future__ import annotations

from typing import Any

import pytest

from app.engine.core.sampling_params import StructuredOutputsParams
from app.serving.errors import APIError
from app.serving.params import chat_sampling_params, completion_sampling_params
from app.serving.schemas import ChatCompletionRequest, CompletionRequest
from app.serving.structured import check_json_schema, request_structure, upstream_structure_fields

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


def rejected(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("kw", "expected", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutputsParams(json=SCHEMA), "response_format"),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         StructuredOutputsParams(json_object=True), "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA), "structured_outputs"),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredOutputsParams(json={"type": "string"}),
         "structured_outputs"),
        ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputsParams(regex="[ab]+"), "structured_outputs"),
        ({"structured_outputs": {"choice": ["y", "n"]}}, StructuredOutputsParams(choice=["y", "n"]),
         "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredOutputsParams(grammar='root ::= "x"'),
         "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True),
         "structured_outputs"),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA), "guided_json"),
        ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b"), "guided_regex"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(choice=["a"]),
         "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"'), "guided_grammar"),
    ],
)  # fmt: skip
def test_every_form_maps_to_structured_outputs(kw: dict[str, Any], expected: Any, param: str) -> None:
    for req, build in ((chat(**kw), chat_sampling_params), (completion(**kw), completion_sampling_params)):
        structure = request_structure(req)
        assert structure is not None and structure.params == expected and structure.param == param
        assert build(req).structured_outputs == expected  # type: ignore[operator]


def test_text_and_nothing_mean_no_constraint() -> None:
    assert request_structure(chat(response_format={"type": "text"})) is None
    assert chat_sampling_params(chat()).structured_outputs is None


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"required": "a"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"structural_tag": "[]"}}, "structured_outputs.structural_tag"),
        ({"guided_json": {"type": 3}}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_constraints_name_the_field(kw: dict[str, Any], param: str) -> None:
    assert rejected(request_structure, chat(**kw)).param == param


def test_schema_shape_errors_come_from_pydantic() -> None:
    from pydantic import ValidationError

    for bad in ({"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        with pytest.raises(ValidationError):
            chat(response_format=bad)


def test_check_json_schema_accepts_text_and_objects() -> None:
    assert check_json_schema('{"type": "array"}', "p") == {"type": "array"}
    assert check_json_schema(SCHEMA, "p") is SCHEMA
    assert rejected(check_json_schema, 5, "p").param == "p"


def test_fields_are_forwarded_as_sent() -> None:
    req = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
        guided_decoding_backend="outlines",
    )
    assert upstream_structure_fields(req) == {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
        "guided_decoding_backend": "outlines",
    }
    req = chat(structured_outputs={"regex": "a+", "disable_any_whitespace": True})
    assert upstream_structure_fields(req) == {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("store", True),
        ("reasoning_effort", "low"),
        ("verbosity", "low"),
        ("service_tier", "flex"),
        ("moderation", {"x": 1}),
    ],
)
def test_unsupported_chat_fields_are_a_400_naming_them(field: str, value: Any) -> None:
    assert rejected(chat_sampling_params, chat(**{field: value})).param == field


def test_harmless_values_of_those_fields_pass() -> None:
    req = chat(modalities=["text"], store=False, service_tier="auto", metadata={"k": "v"}, prompt_cache_key="k",
               safety_identifier="u1", some_future_field=1)  # fmt: skip
    assert chat_sampling_params(req).n == 1
    assert req.model_extra == {"some_future_field": 1}


def test_suffix_and_best_of() -> None:
    assert rejected(completion_sampling_params, completion(suffix="tail")).param == "suffix"
    assert completion_sampling_params(completion(suffix="")).best_of is None
    assert completion_sampling_params(completion(best_of=3, n=2)).best_of == 3
    assert rejected(completion_sampling_params, completion(best_of=1, n=2)).param == "best_of"
    assert rejected(completion_sampling_params, completion(best_of=3, stream=True)).param == "best_of"
    assert completion_sampling_params(completion(best_of=1, stream=True)).best_of == 1
