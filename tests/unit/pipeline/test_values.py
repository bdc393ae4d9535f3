"""Values: kinds, valueify/unwrap, refs, error helpers, and Value["k"] / .get going through F.select."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import app.pipeline.functional as F
from app.pipeline import (
    Module,
    Parameter,
    Value,
    ValueKind,
    ValueRef,
    collect_refs,
    first_error_value,
    has_error_value,
    replace_values_with_refs,
    trace,
    unwrap,
    valueify,
)


class TestValueKind:
    def test_members_and_str_enum(self) -> None:
        names = {k.name for k in ValueKind}
        assert names == {
            "TEXT", "FSTRING", "RESPONSE", "STRUCTURED", "INT", "FLOAT", "ERROR", "TOOL_RESULT", "BINARY", "OTHER",
        }
        assert isinstance(ValueKind.TEXT, str)
        assert ValueKind("text") is ValueKind.TEXT
        assert ValueKind.ERROR == "error"


class TestValue:
    def test_constructor_defaults(self) -> None:
        v = Value(ValueKind.TEXT, "hi")
        assert (v.kind, v.payload, v.ref, v.meta) == (ValueKind.TEXT, "hi", None, {})

    def test_meta_default_is_not_shared(self) -> None:
        a, b = Value(ValueKind.TEXT, "a"), Value(ValueKind.TEXT, "b")
        a.meta["alias"] = "fast"
        assert b.meta == {}

    def test_keyword_construction_and_equality(self) -> None:
        v = Value(kind=ValueKind.INT, payload=3, ref="n1", meta={"alias": "x"})
        assert v == Value(ValueKind.INT, 3, "n1", {"alias": "x"})
        assert v != Value(ValueKind.INT, 4, "n1", {"alias": "x"})

    def test_str_is_payload_outside_tracing(self) -> None:
        assert str(Value(ValueKind.TEXT, "hello")) == "hello"
        assert str(Value(ValueKind.INT, 3)) == "3"
        assert f"{Value(ValueKind.TEXT, 'x')}!" == "x!"

    def test_format_spec_outside_tracing_uses_payload(self) -> None:
        assert f"{Value(ValueKind.FLOAT, 3.14159):.2f}" == "3.14"
        assert format(Value(ValueKind.INT, 7), "03d") == "007"

    def test_bool_outside_tracing_is_payload_truth(self) -> None:
        assert bool(Value(ValueKind.TEXT, "x"))
        assert not bool(Value(ValueKind.TEXT, ""))
        assert not bool(Value(ValueKind.INT, 0))

    def test_is_error_property(self) -> None:
        assert Value(ValueKind.ERROR, ValueError("x")).is_error
        assert not Value(ValueKind.TEXT, "x").is_error

    def test_unknown_attribute_gives_helpful_error(self) -> None:
        v = Value(ValueKind.TEXT, "abc")
        with pytest.raises(AttributeError, match="F"):
            v.upper()  # type: ignore[operator]

    def test_dunder_probe_is_plain_attribute_error(self) -> None:
        v = Value(ValueKind.STRUCTURED, {"a": [1, 2]}, "n", {"m": 1})
        assert not hasattr(v, "__missing_dunder__")
        clone = copy.deepcopy(v)
        assert clone == v and clone.payload is not v.payload

    def test_getitem_goes_through_select(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls = []
        original = F.select

        def spy(*args, **kwargs):
            calls.append((args, kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(F, "select", spy)
        v = Value(ValueKind.STRUCTURED, {"k": "v"})
        assert v["k"] == Value(ValueKind.TEXT, "v")
        v.get("missing", "d")
        assert len(calls) == 2
        assert calls[0][0][0] is v and calls[0][0][1] == "k"

    def test_getitem_dict_list_and_path(self) -> None:
        v = Value(ValueKind.STRUCTURED, {"a": {"b": [10, 20]}, "n": 1.5})
        assert v["a"].kind is ValueKind.STRUCTURED
        assert v["a"]["b"][1].payload == 20
        assert v["a.b"].payload == [10, 20]
        assert v["n"].kind is ValueKind.FLOAT

    def test_getitem_missing_key_is_error_value(self) -> None:
        out = Value(ValueKind.STRUCTURED, {"a": 1})["zzz"]
        assert out.kind is ValueKind.ERROR
        assert isinstance(out.payload, KeyError)

    def test_get_with_default(self) -> None:
        v = Value(ValueKind.STRUCTURED, {"a": 1})
        assert v.get("a").payload == 1
        assert v.get("zzz", "fallback") == Value(ValueKind.TEXT, "fallback")
        missing = v.get("zzz")
        assert missing.kind is not ValueKind.ERROR and missing.payload is None

    def test_getitem_on_error_propagates(self) -> None:
        err = Value(ValueKind.ERROR, RuntimeError("boom"), "n1")
        out = err["k"]
        assert out.kind is ValueKind.ERROR and out.payload is err.payload

    def test_getitem_in_a_trace_records_select(self) -> None:
        class Pick(Module):
            is_leaf = False  # traced through, so the select is recorded as its own node

            def forward(self, x: Value) -> Value:
                return x["answer"]

        graph = trace(Pick(), Value(ValueKind.STRUCTURED, {"answer": 1}))
        ops = [n for n in graph.nodes.values() if n.kind == "op"]
        assert [n.module_name for n in ops] == ["F.select"]
        assert ops[0].dependencies == ["input:input_0"]


class TestValueRef:
    def test_frozen_and_hashable(self) -> None:
        r = ValueRef("n1")
        assert r.ref == "n1"
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.ref = "other"  # type: ignore[misc]
        assert r == ValueRef("n1") and hash(r) == hash(ValueRef("n1"))
        assert {r, ValueRef("n1"), ValueRef("n2")} == {ValueRef("n1"), ValueRef("n2")}


class TestValueify:
    @pytest.mark.parametrize(
        ("raw", "kind"),
        [
            ("s", ValueKind.TEXT),
            ("", ValueKind.TEXT),
            (True, ValueKind.OTHER),
            (False, ValueKind.OTHER),
            (3, ValueKind.INT),
            (0, ValueKind.INT),
            (2.5, ValueKind.FLOAT),
            (b"\x00\x01", ValueKind.BINARY),
            (ValueError("bad"), ValueKind.ERROR),
            (None, ValueKind.OTHER),
            (object(), ValueKind.OTHER),
        ],
    )
    def test_scalar_kinds(self, raw: object, kind: ValueKind) -> None:
        v = valueify(raw)
        assert isinstance(v, Value)
        assert v.kind is kind
        assert v.payload is raw
        assert v.ref is None

    def test_bool_is_not_int(self) -> None:
        assert valueify(True).kind is ValueKind.OTHER
        assert valueify(1).kind is ValueKind.INT

    def test_containers_are_recursive(self) -> None:
        out = valueify({"a": 1, "b": ["x", 2.0, (True, b"z")]})
        assert isinstance(out, dict)
        assert out["a"] == Value(ValueKind.INT, 1)
        assert isinstance(out["b"], list)
        assert out["b"][0] == Value(ValueKind.TEXT, "x")
        assert out["b"][1] == Value(ValueKind.FLOAT, 2.0)
        assert isinstance(out["b"][2], tuple)
        assert out["b"][2] == (Value(ValueKind.OTHER, True), Value(ValueKind.BINARY, b"z"))

    def test_kind_override_wraps_container_whole(self) -> None:
        v = valueify({"a": 1}, kind=ValueKind.STRUCTURED)
        assert v == Value(ValueKind.STRUCTURED, {"a": 1})
        assert valueify([1, 2], ValueKind.STRUCTURED).payload == [1, 2]
        assert valueify("{x}", kind=ValueKind.FSTRING).kind is ValueKind.FSTRING

    def test_value_passes_through(self) -> None:
        v = Value(ValueKind.TEXT, "x", "n1", {"m": 1})
        assert valueify(v) is v
        assert valueify(v, kind=ValueKind.TEXT) is v

    def test_value_kind_override_keeps_ref_and_copies_meta(self) -> None:
        v = Value(ValueKind.TEXT, "x", "n1", {"m": 1})
        out = valueify(v, kind=ValueKind.FSTRING)
        assert out.kind is ValueKind.FSTRING and out.ref == "n1" and out.meta == {"m": 1}
        out.meta["m"] = 2
        assert v.meta == {"m": 1}

    def test_parameter_is_lifted(self) -> None:
        p = Parameter("be brief", description="tone")
        v = valueify(p)
        assert isinstance(v, Value)
        assert v.kind is ValueKind.TEXT and v.payload == "be brief"
        assert v.ref is not None and v.ref.startswith("param:")

    def test_parameter_inside_container(self) -> None:
        p = Parameter(3, requires_grad=False)
        out = valueify([p])
        assert out[0].payload == 3 and out[0].kind is ValueKind.INT and out[0].ref.startswith("param:")


class TestUnwrap:
    def test_unwrap_values_and_containers(self) -> None:
        data = {"a": Value(ValueKind.INT, 1), "b": [Value(ValueKind.TEXT, "x"), (Value(ValueKind.FLOAT, 1.5), 7)]}
        assert unwrap(data) == {"a": 1, "b": ["x", (1.5, 7)]}
        assert isinstance(unwrap(data)["b"][1], tuple)

    def test_unwrap_raw_passes_through(self) -> None:
        obj = object()
        assert unwrap(obj) is obj
        assert unwrap("s") == "s"

    def test_unwrap_inverts_valueify(self) -> None:
        raw = {"a": [1, "b", 2.5, None, {"c": (True, b"x")}]}
        assert unwrap(valueify(raw)) == raw

    def test_unwrap_nested_values_in_payload(self) -> None:
        inner = Value(ValueKind.STRUCTURED, [Value(ValueKind.INT, 1), Value(ValueKind.INT, 2)])
        assert unwrap(inner) == [1, 2]


class TestRefs:
    def test_collect_refs_order_and_dedup(self) -> None:
        a = Value(ValueKind.TEXT, "a", "n1")
        b = Value(ValueKind.TEXT, "b", "n2")
        c = Value(ValueKind.TEXT, "c", "n3")
        no_ref = Value(ValueKind.TEXT, "x")
        refs = collect_refs(a, [b, {"k": a, "j": no_ref}], z=c, y=(b, ValueRef("n4")))
        assert refs == ["n1", "n2", "n4", "n3"]  # positional first, then kwargs by sorted key (y before z)

    def test_collect_refs_empty(self) -> None:
        assert collect_refs() == []
        assert collect_refs("raw", 1, [None]) == []

    def test_replace_values_with_refs(self) -> None:
        a = Value(ValueKind.TEXT, "a", "n1")
        literal = Value(ValueKind.TEXT, "lit")
        out = replace_values_with_refs({"x": [a, literal, (a, 3)], "y": "raw"})
        assert out == {"x": [ValueRef("n1"), literal, (ValueRef("n1"), 3)], "y": "raw"}
        assert isinstance(out["x"][2], tuple)
        assert replace_values_with_refs(a) == ValueRef("n1")
        assert replace_values_with_refs(literal) is literal

    def test_replace_does_not_mutate_input(self) -> None:
        a = Value(ValueKind.TEXT, "a", "n1")
        data = [a]
        replace_values_with_refs(data)
        assert data == [a]


class TestErrorHelpers:
    def test_has_error_value(self) -> None:
        ok = Value(ValueKind.TEXT, "x")
        err = Value(ValueKind.ERROR, ValueError("e"))
        assert not has_error_value(ok, [ok], {"a": ok})
        assert has_error_value(ok, [ok, {"deep": (err,)}])
        assert has_error_value(k=err)
        assert not has_error_value()

    def test_first_error_positional_then_sorted_kwargs(self) -> None:
        e1 = Value(ValueKind.ERROR, ValueError("1"), "n1")
        e2 = Value(ValueKind.ERROR, ValueError("2"), "n2")
        e3 = Value(ValueKind.ERROR, ValueError("3"), "n3")
        ok = Value(ValueKind.INT, 1)
        assert first_error_value(ok, [ok, e2], e1) is e2
        assert first_error_value(ok, z=e1, a=e3) is e3
        assert first_error_value(ok, e1, a=e3) is e1
        assert first_error_value(ok, {"k": [ok]}) is None

    def test_errors_are_data(self) -> None:
        exc = RuntimeError("x")
        v = valueify(exc)
        assert v.kind is ValueKind.ERROR and v.payload is exc
        assert str(v).endswith("x")


class TestIteration:
    def test_iterating_a_value_iterates_its_payload(self) -> None:
        assert list(Value(ValueKind.STRUCTURED, [1, 2])) == [1, 2]
        assert list(Value(ValueKind.STRUCTURED, {"a": 1})) == ["a"]
        assert list(Value(ValueKind.TEXT, "ab")) == ["a", "b"]
        assert "a" in Value(ValueKind.STRUCTURED, ["a"])

    def test_iterating_a_non_iterable_payload_is_a_type_error(self) -> None:
        with pytest.raises(TypeError):
            list(Value(ValueKind.INT, 3))

    def test_iterating_an_error_yields_nothing(self) -> None:
        assert list(Value(ValueKind.ERROR, ValueError("x"))) == []
