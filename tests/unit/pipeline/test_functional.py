"""The functional API (F): every op eagerly, error short-circuiting, and ops recorded and run inside pipelines."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

import app.pipeline.functional as F
from app.pipeline import LLMInference, Module, Value, ValueKind, run, trace
from app.pipeline.resources.types import LLMRequest, LLMResponse
from tests.support.fakes import ScriptedResources


def text(s: str, ref: str | None = None) -> Value:
    return Value(ValueKind.TEXT, s, ref)


def err(message: str, ref: str | None = None) -> Value:
    return Value(ValueKind.ERROR, ValueError(message), ref, {"node_id": ref})


def assert_error(v: Value, exc_type: type[BaseException] = Exception) -> None:
    assert isinstance(v, Value)
    assert v.kind is ValueKind.ERROR, v
    assert isinstance(v.payload, exc_type), v.payload


class TestText:
    def test_render(self) -> None:
        out = F.render("Hello {name}, you are {age}", {"name": "Ada", "age": Value(ValueKind.INT, 36)})
        assert out == Value(ValueKind.TEXT, "Hello Ada, you are 36")

    def test_render_accepts_value_template_and_structured_vars(self) -> None:
        out = F.render(text("{a}-{b}"), Value(ValueKind.STRUCTURED, {"a": 1, "b": "x"}))
        assert out.payload == "1-x"

    def test_render_literal_braces(self) -> None:
        assert F.render("{{not a var}} {x}", {"x": "y"}).payload == "{not a var} y"

    def test_render_structured_variable_as_json(self) -> None:
        out = F.render("data: {d}", {"d": Value(ValueKind.STRUCTURED, {"b": 1, "a": [1, 2]})})
        assert json.loads(out.payload.removeprefix("data: ")) == {"a": [1, 2], "b": 1}

    def test_render_missing_variable_is_error(self) -> None:
        out = F.render("{missing}", {})
        assert_error(out, KeyError)
        assert "render" in out.meta["op"]

    def test_try_render(self) -> None:
        assert F.try_render("a{x}b{y}", {"x": 1}).payload == "a1b"
        assert F.try_render("a{x}b{y}", {"x": 1}, default="?").payload == "a1b?"

    def test_concat(self) -> None:
        assert F.concat("a", text("b"), "c").payload == "abc"
        assert F.concat("a", "b", sep=", ") == Value(ValueKind.TEXT, "a, b")
        assert F.concat().payload == ""
        assert F.concat("n=", Value(ValueKind.INT, 3)).payload == "n=3"

    def test_format_with_specs(self) -> None:
        out = F.format("{x:.2f} and {n:03d}", {"x": Value(ValueKind.FLOAT, 3.14159), "n": 7})
        assert out == Value(ValueKind.TEXT, "3.14 and 007")

    def test_format_errors(self) -> None:
        assert_error(F.format("{missing}", {}), KeyError)
        assert_error(F.format("{x:d}", {"x": "not a number"}))

    def test_strip_lower_upper(self) -> None:
        assert F.strip("  hi  ") == Value(ValueKind.TEXT, "hi")  # noqa: B005 - F.strip(text), not str.strip(chars)
        assert F.strip("xxhixx", "x").payload == "hi"
        assert F.strip("xxhixx", chars="x").payload == "hi"  # noqa: B005
        assert F.strip(text("--a--"), text("-")).payload == "a"
        assert F.lower(text("MiXeD")) == Value(ValueKind.TEXT, "mixed")
        assert F.upper("MiXeD").payload == "MIXED"

    def test_text_ops_return_fresh_values(self) -> None:
        src = text("Hi", "n1")
        out = F.lower(src)
        assert out.ref is None and src.payload == "Hi"


class TestStructured:
    def test_parse_structured(self) -> None:
        out = F.parse_structured('{"a": [1, 2], "b": null}')
        assert out == Value(ValueKind.STRUCTURED, {"a": [1, 2], "b": None})

    def test_parse_structured_fenced(self) -> None:
        assert F.parse_structured('```json\n{"a": 1}\n```').payload == {"a": 1}

    def test_parse_structured_invalid_json(self) -> None:
        out = F.parse_structured("not json")
        assert_error(out, json.JSONDecodeError)
        assert "parse_structured" in out.meta["op"]

    def test_parse_structured_pydantic_schema(self) -> None:
        class Person(BaseModel):
            name: str
            age: int

        ok = F.parse_structured('{"name": "Ada", "age": 36}', Person)
        assert ok.kind is ValueKind.STRUCTURED and ok.payload == {"name": "Ada", "age": 36}
        assert_error(F.parse_structured('{"name": "Ada"}', Person))

    def test_parse_structured_type_schema(self) -> None:
        assert F.parse_structured("[1, 2]", list).payload == [1, 2]
        assert_error(F.parse_structured('{"a": 1}', schema=list))

    def test_select_key_path_and_list_path(self) -> None:
        data = Value(ValueKind.STRUCTURED, {"a": {"b": [{"c": 1}, {"c": 2}]}, "t": "x"})
        assert F.select(data, "t") == Value(ValueKind.TEXT, "x")
        assert F.select(data, "a.b.1.c") == Value(ValueKind.INT, 2)
        assert F.select(data, ["a", "b", 0, "c"]).payload == 1
        assert F.select(data, "a").kind is ValueKind.STRUCTURED
        assert F.select({"raw": 1}, "raw").payload == 1

    def test_select_missing(self) -> None:
        data = Value(ValueKind.STRUCTURED, {"a": {"b": 1}})
        missing = F.select(data, "a.zzz")
        assert_error(missing, KeyError)
        assert "select" in missing.meta["op"]
        assert F.select(data, "a.zzz", default=0) == Value(ValueKind.INT, 0)
        assert F.select(data, "a.zzz", "dflt").payload == "dflt"
        assert F.select(Value(ValueKind.STRUCTURED, [1]), 5, default=None).payload is None

    def test_select_numeric_string_keys(self) -> None:
        data = Value(ValueKind.STRUCTURED, {"a": {"0": "zero"}})
        assert F.select(data, "a.0").payload == "zero"

    def test_merge(self) -> None:
        out = F.merge({"a": 1, "b": 1}, Value(ValueKind.STRUCTURED, {"b": 2}), {"c": 3})
        assert out == Value(ValueKind.STRUCTURED, {"a": 1, "b": 2, "c": 3})
        assert_error(F.merge({"a": 1}, Value(ValueKind.STRUCTURED, [1])), TypeError)

    @pytest.mark.parametrize(
        ("value", "kind", "expected"),
        [
            (text(" 42 "), ValueKind.INT, Value(ValueKind.INT, 42)),
            (text("2.5"), ValueKind.FLOAT, Value(ValueKind.FLOAT, 2.5)),
            (Value(ValueKind.INT, 3), ValueKind.FLOAT, Value(ValueKind.FLOAT, 3.0)),
            (Value(ValueKind.FLOAT, 4.0), ValueKind.INT, Value(ValueKind.INT, 4)),
            (Value(ValueKind.FLOAT, 4.7, meta={"allow_lossy": True}), ValueKind.INT, Value(ValueKind.INT, 4)),
            ("7", ValueKind.INT, Value(ValueKind.INT, 7)),
            (5, ValueKind.FLOAT, Value(ValueKind.FLOAT, 5.0)),
        ],
    )
    def test_coerce_allowed(self, value: Any, kind: ValueKind, expected: Value) -> None:
        assert F.coerce(value, kind) == expected

    def test_coerce_structured_to_text_is_stable_json(self) -> None:
        a = F.coerce(Value(ValueKind.STRUCTURED, {"b": 1, "a": [2, {"z": 1, "y": 2}]}), ValueKind.TEXT)
        b = F.coerce(Value(ValueKind.STRUCTURED, {"a": [2, {"y": 2, "z": 1}], "b": 1}), ValueKind.TEXT)
        assert a.kind is ValueKind.TEXT and a.payload == b.payload
        assert json.loads(a.payload) == {"a": [2, {"y": 2, "z": 1}], "b": 1}

    def test_coerce_same_kind_is_identity(self) -> None:
        v = Value(ValueKind.INT, 1, "n1")
        assert F.coerce(v, ValueKind.INT) == v

    @pytest.mark.parametrize(
        ("value", "kind"),
        [
            (text("abc"), ValueKind.INT),
            (text("1.5"), ValueKind.INT),
            (Value(ValueKind.FLOAT, 4.5), ValueKind.INT),
            (text("{}"), ValueKind.STRUCTURED),
            (Value(ValueKind.BINARY, b"x"), ValueKind.TEXT),
            (Value(ValueKind.INT, 1), ValueKind.TEXT),
            (Value(ValueKind.OTHER, None), ValueKind.INT),
        ],
    )
    def test_coerce_refused(self, value: Value, kind: ValueKind) -> None:
        out = F.coerce(value, kind)
        assert_error(out)
        assert "coerce" in out.meta["op"]


class TestNumeric:
    def test_add_sub_mul_promotion(self) -> None:
        assert F.add(1, 2) == Value(ValueKind.INT, 3)
        assert F.add(Value(ValueKind.INT, 1), Value(ValueKind.FLOAT, 0.5)) == Value(ValueKind.FLOAT, 1.5)
        assert F.sub(5, Value(ValueKind.INT, 7)) == Value(ValueKind.INT, -2)
        assert F.mul(2, 2.5) == Value(ValueKind.FLOAT, 5.0)
        assert F.mul(Value(ValueKind.INT, 3), 4) == Value(ValueKind.INT, 12)

    def test_div_is_always_float(self) -> None:
        assert F.div(6, 3) == Value(ValueKind.FLOAT, 2.0)
        assert F.div(Value(ValueKind.INT, 1), 4) == Value(ValueKind.FLOAT, 0.25)

    def test_div_by_zero_is_error(self) -> None:
        for zero in (0, 0.0, Value(ValueKind.INT, 0)):
            out = F.div(1, zero)
            assert_error(out, ZeroDivisionError)
            assert "div" in out.meta["op"]

    def test_non_numbers_are_errors(self) -> None:
        assert_error(F.add("1", 2), TypeError)
        assert_error(F.add(True, 2), TypeError)
        assert_error(F.mul(Value(ValueKind.TEXT, "3"), 2), TypeError)
        assert_error(F.sum([1, "x"]), TypeError)

    def test_error_names_op_and_input_refs(self) -> None:
        out = F.add(Value(ValueKind.INT, 1, "n1"), Value(ValueKind.TEXT, "x", "n2"))
        assert_error(out, TypeError)
        assert "add" in out.meta["op"]
        assert out.meta["input_refs"] == ["n1", "n2"]

    def test_sum_min_max(self) -> None:
        assert F.sum([1, 2, 3]).payload == 6
        assert F.sum([1, 2.5]) == Value(ValueKind.FLOAT, 3.5)
        assert F.sum(Value(ValueKind.STRUCTURED, [1, 2])).payload == 3
        assert F.sum(1, 2, 3).payload == 6
        assert F.min([3, 1, 2]).payload == 1
        assert F.max([Value(ValueKind.INT, 3), 9, 2]).payload == 9
        assert F.min([1.5, 2]).kind is ValueKind.FLOAT

    def test_sum_min_max_keep_int_for_ints(self) -> None:
        assert F.sum([1, 2]) == Value(ValueKind.INT, 3)
        assert F.min([4, 2]) == Value(ValueKind.INT, 2)
        assert F.max([4, 2]) == Value(ValueKind.INT, 4)
        assert F.sum([]) == Value(ValueKind.INT, 0)

    def test_min_max_of_empty_are_errors(self) -> None:
        assert_error(F.min([]))
        assert_error(F.max([]))

    def test_mean(self) -> None:
        assert F.mean([1, 2]) == Value(ValueKind.FLOAT, 1.5)
        assert F.mean([2, 2]) == Value(ValueKind.FLOAT, 2.0)
        assert F.mean(Value(ValueKind.STRUCTURED, [1, 2, 3])).payload == 2.0

    def test_mean_of_empty_is_error(self) -> None:
        out = F.mean([])
        assert_error(out)
        assert "mean" in out.meta["op"]
        assert_error(F.mean(Value(ValueKind.STRUCTURED, [])))


class TestErrorsShortCircuit:
    def test_error_input_is_returned_without_running(self) -> None:
        e = err("upstream", "n1")
        out = F.upper(e)
        assert out.kind is ValueKind.ERROR
        assert out.payload is e.payload and out.ref == "n1"
        assert out.meta["node_id"] == "n1"
        assert "causes" not in out.meta

    def test_primary_is_leftmost_positional_then_sorted_kwargs(self) -> None:
        e1, e2, e3 = err("first", "n1"), err("second", "n2"), err("third", "n3")
        out = F.concat(text("ok"), e2, e1)
        assert out.payload is e2.payload
        assert len(out.meta["causes"]) == 1
        assert out.meta["causes"][0]["ref"] == "n1"
        assert "first" in out.meta["causes"][0]["message"]

        out = F.render(e3, {"a": e1, "b": e2})
        assert out.payload is e3.payload
        assert [c["ref"] for c in out.meta["causes"]] == ["n1", "n2"]

    def test_kwargs_by_sorted_key(self) -> None:
        e1, e2 = err("z", "nz"), err("a", "na")
        out = F.with_meta(text("x"), z=e1, a=e2)
        # with_meta's kwargs are meta, but ERROR Values among them still short-circuit deterministically
        assert out.payload is e2.payload
        assert [c["ref"] for c in out.meta["causes"]] == ["nz"]

    def test_numeric_and_structured_ops_short_circuit(self) -> None:
        e = err("boom", "n1")
        for out in (F.add(1, e), F.div(e, 0), F.sum([1, e]), F.mean([e]), F.select(e, "a"), F.merge({}, e),
                    F.coerce(e, ValueKind.INT), F.parse_structured(e), F.extract_text(e), F.zip_values([1], e)):
            assert out.kind is ValueKind.ERROR and out.payload is e.payload

    def test_ops_never_raise(self) -> None:
        assert_error(F.select(object(), "a"))
        assert_error(F.merge(1))
        assert_error(F.coerce(text("1"), "no such kind"))
        assert_error(F.map_values(lambda x: 1 / 0, [1]), ZeroDivisionError)


class TestResponse:
    def test_extract_text(self) -> None:
        assert F.extract_text(Value(ValueKind.RESPONSE, "answer", meta={"model": "m"})) == text("answer")
        assert F.extract_text(Value(ValueKind.RESPONSE, LLMResponse(content="from object"))).payload == "from object"
        assert F.extract_text(Value(ValueKind.STRUCTURED, {"content": "from dict"})).payload == "from dict"

    def test_extract_meta(self) -> None:
        v = Value(ValueKind.RESPONSE, "a", meta={"input_tokens": 3, "model": "m"})
        assert F.extract_meta(v) == Value(ValueKind.STRUCTURED, {"input_tokens": 3, "model": "m"})
        assert F.extract_meta(v, "model") == text("m")
        assert F.extract_meta(v, "missing", 0).payload == 0

    def test_extract_meta_from_response_object(self) -> None:
        v = Value(ValueKind.RESPONSE, LLMResponse(content="c", input_tokens=4, output_tokens=2, model="m"))
        meta = F.extract_meta(v).payload
        assert meta["input_tokens"] == 4 and meta["output_tokens"] == 2 and meta["model"] == "m"

    def test_with_meta(self) -> None:
        v = Value(ValueKind.TEXT, "x", "n1", {"a": 1})
        out = F.with_meta(v, b=2, a=3)
        assert out == Value(ValueKind.TEXT, "x", "n1", {"a": 3, "b": 2})
        assert v.meta == {"a": 1}
        assert F.with_meta("raw", k=1) == Value(ValueKind.TEXT, "raw", None, {"k": 1})


class FakeClient:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.requests: list[LLMRequest] = []

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class StatusError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


class TestChatComplete:
    async def test_success(self) -> None:
        client = FakeClient(LLMResponse(content="hi!", input_tokens=2, output_tokens=1, model="m"))
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        out = await F.chat_complete(client, messages=msgs, model="m", temperature=0.1, max_tokens=9)
        assert out.kind is ValueKind.RESPONSE and out.payload == "hi!"
        assert out.meta["input_tokens"] == 2 and out.meta["model"] == "m"
        request = client.requests[0]
        assert request.messages() == msgs
        assert request.temperature == 0.1 and request.max_tokens == 9

    async def test_http_status_is_kept(self) -> None:
        from app.pipeline.resources.errors import ResourceError

        out = await F.chat_complete(FakeClient(ResourceError("slow down", status=429)), messages=[])
        assert_error(out)
        assert out.meta["http_status"] == 429
        out = await F.chat_complete(FakeClient(StatusError(503)), messages=[{"role": "user", "content": "x"}])
        assert_error(out)
        assert out.meta["http_status"] == 503

    async def test_never_raises(self) -> None:
        out = await F.chat_complete(FakeClient(LLMResponse(content="x")), messages=[], bogus_option=1)
        assert_error(out)

    async def test_messages_value_and_error(self) -> None:
        client = FakeClient(LLMResponse(content="ok"))
        msgs = Value(ValueKind.STRUCTURED, [{"role": "user", "content": "u"}])
        assert (await F.chat_complete(client, messages=msgs)).payload == "ok"
        e = err("upstream", "n1")
        out = await F.chat_complete(client, messages=e)
        assert out.kind is ValueKind.ERROR and out.payload is e.payload
        assert len(client.requests) == 1


class TestControl:
    def test_unwrap_or(self) -> None:
        ok = Value(ValueKind.TEXT, "fine", "n1")
        assert F.unwrap_or(ok, "fallback") == ok
        e = err("boom", "n9")
        out = F.unwrap_or(e, "fallback")
        assert out.kind is ValueKind.TEXT and out.payload == "fallback"
        assert out.meta["recovered_from"] == "n9"

    def test_unwrap_or_without_ref_still_records_recovery(self) -> None:
        out = F.unwrap_or(Value(ValueKind.ERROR, ValueError("boom")), 0)
        assert out == Value(ValueKind.INT, 0, None, {"recovered_from": out.meta["recovered_from"]})
        assert out.meta["recovered_from"]

    def test_is_error(self) -> None:
        assert F.is_error(err("x")).payload is True
        assert F.is_error(text("x")).payload is False
        assert F.is_error("raw").payload is False


class TestCollections:
    def test_map_values(self) -> None:
        out = F.map_values(lambda x: x * 2, [1, 2, Value(ValueKind.INT, 3)])
        assert out == Value(ValueKind.STRUCTURED, [2, 4, 6])
        out = F.map_values(lambda s: F.upper(s), Value(ValueKind.STRUCTURED, ["a", "b"]))
        assert out.payload == ["A", "B"]

    def test_zip_values(self) -> None:
        out = F.zip_values([1, 2], Value(ValueKind.STRUCTURED, ["a", "b"]))
        assert out.kind is ValueKind.STRUCTURED
        assert [list(row) for row in out.payload] == [[1, "a"], [2, "b"]]

    def test_zip_values_length_mismatch(self) -> None:
        out = F.zip_values([1, 2], [1])
        assert_error(out, ValueError)
        assert "zip_values" in out.meta["op"]

    def test_stack_structured(self) -> None:
        out = F.stack_structured([Value(ValueKind.STRUCTURED, {"a": 1}), {"b": 2}])
        assert out == Value(ValueKind.STRUCTURED, [{"a": 1}, {"b": 2}])
        assert F.stack_structured(Value(ValueKind.STRUCTURED, [{"a": 1}])).payload == [{"a": 1}]


# -- ops inside pipelines ------------------------------------------------------------------------------------
class Pipeline(Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = LLMInference("a")
        self.b = LLMInference("b")

    def forward(self, question: Value) -> Any:
        ra, rb = self.a(question), self.b(question)
        return {
            "joined": F.concat(ra, rb, sep=" | "),
            "upper": F.upper(ra),
            "rendered": F.render("A={x} B={y}", {"x": ra, "y": rb}),
        }


class TestOpsInTraces:
    def test_ops_are_recorded_as_nodes(self) -> None:
        graph = trace(Pipeline(), "q")
        ops = {n.id: n for n in graph.nodes.values() if n.kind == "op"}
        assert sorted(n.module_name for n in ops.values()) == ["F.concat", "F.render", "F.upper"]
        concat = next(n for n in ops.values() if n.module_name == "F.concat")
        assert concat.dependencies == ["LLMInference_1", "LLMInference_2"]
        assert concat.id == f"F.concat_{concat.id.rsplit('_', 1)[1]}"
        assert set(graph.output_ids) == set(ops)

    def test_op_on_literals_inside_trace_runs_eagerly(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("a")

            def forward(self, q: Value) -> Value:
                prefix = F.upper("prefix: ")
                assert prefix.payload == "PREFIX: "  # literal inputs: the op ran right away
                return self.llm(F.concat(prefix, q))

        graph = trace(M(), "q")
        assert [n.module_name for n in graph.nodes.values() if n.kind == "op"] == ["F.concat"]

    async def test_ops_run_at_execution_time_on_real_payloads(self, resources: ScriptedResources) -> None:
        out = await run(Pipeline(), "q", resources=resources)
        assert out == {"joined": "a(q) | b(q)", "upper": "A(Q)", "rendered": "A=a(q) B=b(q)"}

    async def test_numeric_ops_in_pipeline(self) -> None:
        class Score(Module):
            def __init__(self) -> None:
                super().__init__()
                self.judge = LLMInference("judge")

            def forward(self, q: Value) -> Any:
                raw = self.judge(q)
                score = F.coerce(F.strip(raw), ValueKind.INT)
                return {"double": F.mul(score, 2), "ratio": F.div(score, 4), "ratio0": F.div(score, 0)}

        res = ScriptedResources(lambda alias, request: " 3 ")
        from app.pipeline.execution.executor import ExecutionError  # noqa: F401 - the error type a run raises

        with pytest.raises(ZeroDivisionError):
            await run(Score(), "q", resources=res)

        class Safe(Score):
            def forward(self, q: Value) -> Any:
                out = super().forward(q)
                out["ratio0"] = F.unwrap_or(out["ratio0"], -1.0)
                return out

        assert await run(Safe(), "q", resources=res) == {"double": 6, "ratio": 0.75, "ratio0": -1.0}

    async def test_error_flows_through_ops_as_data(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("a")

            def forward(self, q: Value) -> Any:
                parsed = F.parse_structured(self.llm(q))
                return {
                    "flag": F.is_error(parsed),
                    "name": F.unwrap_or(F.select(parsed, "name"), "unknown"),
                    "upper": F.unwrap_or(F.upper(F.select(parsed, "name")), "UNKNOWN"),
                }

        res = ScriptedResources(lambda alias, request: "not json")
        assert await run(M(), "q", resources=res) == {"flag": True, "name": "unknown", "upper": "UNKNOWN"}
        res = ScriptedResources(lambda alias, request: '{"name": "ada"}')
        assert await run(M(), "q", resources=res) == {"flag": False, "name": "ada", "upper": "ADA"}

    async def test_getitem_and_get_run_through_select(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("a")

            def forward(self, q: Value) -> Any:
                parsed = F.parse_structured(self.llm(q))
                return {"x": parsed["a"]["b"], "y": parsed.get("missing", "d")}

        res = ScriptedResources(lambda alias, request: '{"a": {"b": 5}}')
        assert await run(M(), "q", resources=res) == {"x": 5, "y": "d"}


def _traced_input() -> Value:
    return Value(ValueKind.OTHER, None, "input:input_0")


OP_CALLS: list[tuple[str, Any]] = [
    ("render", lambda v: F.render("{x}", {"x": v})),
    ("try_render", lambda v: F.try_render("{x}", {"x": v})),
    ("concat", lambda v: F.concat(v, "!")),
    ("format", lambda v: F.format("{x}", {"x": v})),
    ("strip", lambda v: F.strip(v)),
    ("lower", lambda v: F.lower(v)),
    ("upper", lambda v: F.upper(v)),
    ("parse_structured", lambda v: F.parse_structured(v)),
    ("select", lambda v: F.select(v, "a")),
    ("merge", lambda v: F.merge(v, {"b": 1})),
    ("coerce", lambda v: F.coerce(v, ValueKind.INT)),
    ("add", lambda v: F.add(v, 1)),
    ("sub", lambda v: F.sub(v, 1)),
    ("mul", lambda v: F.mul(v, 2)),
    ("div", lambda v: F.div(v, 2)),
    ("sum", lambda v: F.sum([v, 1])),
    ("min", lambda v: F.min([v, 1])),
    ("max", lambda v: F.max([v, 1])),
    ("mean", lambda v: F.mean([v, 1])),
    ("extract_text", lambda v: F.extract_text(v)),
    ("extract_meta", lambda v: F.extract_meta(v)),
    ("with_meta", lambda v: F.with_meta(v, tag="t")),
    ("unwrap_or", lambda v: F.unwrap_or(v, "d")),
    ("is_error", lambda v: F.is_error(v)),
    ("zip_values", lambda v: F.zip_values(v, [1])),
    ("stack_structured", lambda v: F.stack_structured([v])),
]


class TestEveryOpIsRecorded:
    @pytest.mark.parametrize(("name", "call"), OP_CALLS, ids=[name for name, _ in OP_CALLS])
    def test_op_records_a_named_node(self, name: str, call: Any) -> None:
        class M(Module):
            is_leaf = False

            def forward(self, x: Value) -> Value:
                out = call(x)
                assert out.ref == f"F.{name}_1" and out.payload is None
                return out

        graph = trace(M(), "x")
        node = graph.nodes[f"F.{name}_1"]
        assert node.kind == "op" and node.module_name == f"F.{name}"
        assert node.dependencies == ["input:input_0"]
        assert json.loads(graph.to_json())  # serialisable

    async def test_unwrap_or_in_a_pipeline_names_the_failed_node(self, resources: ScriptedResources) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.llm = LLMInference("a")

            def forward(self, x: Value) -> Any:
                return F.extract_meta(F.unwrap_or(F.parse_structured(self.llm(x)), {}))

        meta = await run(M(), "x", resources=resources)
        assert meta["recovered_from"] == "F.parse_structured_2"
