"""Parameter: descriptions, naming in the module tree, lifting into Values, feedback and updates."""

from __future__ import annotations

import pytest

from app.pipeline import Module, Parameter, ParameterDict, ParameterList, Value, ValueKind, valueify


class Leaf(Module):
    def __init__(self, text: str = "be brief") -> None:
        super().__init__()
        self.prompt = Parameter(text, description="the tone instruction")

    def forward(self, x: str) -> str:
        return f"{self.prompt}: {x}"


class Tree(Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Leaf("enc")
        self.decoder = Leaf("dec")
        self.top = Parameter("root", description="root prompt")

    def forward(self, x: str) -> str:
        return self.decoder(self.encoder(x))


class TestConstruction:
    def test_learnable_without_description_is_value_error(self) -> None:
        with pytest.raises(ValueError, match="description"):
            Parameter("x")
        with pytest.raises(ValueError):
            Parameter("x", description=None, requires_grad=True)

    def test_blank_description_is_rejected(self) -> None:
        with pytest.raises(ValueError):
            Parameter("x", description="   ")

    def test_frozen_without_description_is_fine(self) -> None:
        p = Parameter({"model": "m"}, requires_grad=False)
        assert p.requires_grad is False and p.description is None and p.value == {"model": "m"}

    def test_keyword_construction(self) -> None:
        p = Parameter(value="v", description="d", requires_grad=True)
        assert (p.value, p.description, p.requires_grad) == ("v", "d", True)

    def test_str_is_the_value(self) -> None:
        assert str(Parameter("hello", description="d")) == "hello"
        assert str(Parameter(3, requires_grad=False)) == "3"
        assert "hello" in repr(Parameter("hello", description="d"))


class TestNaming:
    def test_unattached_parameter(self) -> None:
        p = Parameter("v", description="d")
        assert p._name is None and p._parent is None
        assert p.ref.startswith("param:")

    def test_attached_names_are_dotted(self) -> None:
        t = Tree()
        assert t.top._name == "top" and t.top._parent is t
        assert t.encoder.prompt._name == "prompt" and t.encoder.prompt._parent is t.encoder
        assert t.top.ref == "param:top"
        assert t.encoder.prompt.ref == "param:encoder.prompt"
        assert t.decoder.prompt.ref == "param:decoder.prompt"

    def test_name_follows_later_attachment(self) -> None:
        leaf = Leaf()
        assert leaf.prompt.ref == "param:prompt"

        class Holder(Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = leaf

        Holder()
        assert leaf.prompt.ref == "param:inner.prompt"

    def test_parameters_in_containers(self) -> None:
        class M(Module):
            def __init__(self) -> None:
                super().__init__()
                self.plist = ParameterList([Parameter("a", description="a"), Parameter("b", description="b")])
                self.pdict = ParameterDict({"k": Parameter("c", description="c")})

        m = M()
        assert m.plist[0].ref == "param:plist.0"
        assert m.pdict["k"].ref == "param:pdict.k"


class TestAsValue:
    def test_valueify_meta(self) -> None:
        t = Tree()
        v = valueify(t.encoder.prompt)
        assert isinstance(v, Value)
        assert v.kind is ValueKind.TEXT
        assert v.payload == "enc"
        assert v.ref == "param:encoder.prompt"
        assert v.meta == {
            "param_name": "encoder.prompt",
            "param_id": t.encoder.prompt._id,
            "module_state_version": 0,
            "requires_grad": True,
        }

    def test_valueify_kinds_follow_the_value(self) -> None:
        assert valueify(Parameter({"a": 1}, requires_grad=False)).kind is ValueKind.STRUCTURED
        assert valueify(Parameter([1], requires_grad=False)).kind is ValueKind.STRUCTURED
        assert valueify(Parameter(2, requires_grad=False)).kind is ValueKind.INT
        assert valueify(Parameter(2.0, requires_grad=False)).kind is ValueKind.FLOAT
        assert valueify(Parameter("s", requires_grad=False), kind=ValueKind.FSTRING).kind is ValueKind.FSTRING

    def test_unattached_meta(self) -> None:
        p = Parameter("v", requires_grad=False)
        v = valueify(p)
        assert v.meta["param_name"] is None
        assert v.meta["module_state_version"] == 0
        assert v.meta["requires_grad"] is False
        assert v.ref == f"param:{p._id}"

    def test_ids_are_unique(self) -> None:
        assert Parameter("a", description="d")._id != Parameter("a", description="d")._id

    def test_state_version_in_meta_tracks_updates(self) -> None:
        t = Tree()
        t.encoder.prompt.apply_update("enc v2")
        v = valueify(t.encoder.prompt)
        assert v.payload == "enc v2"
        assert v.meta["module_state_version"] == 1


class TestFeedback:
    def test_accumulate_get_zero(self) -> None:
        p = Parameter("v", description="d")
        p.accumulate_feedback("shorter")
        p.accumulate_feedback("friendlier")
        assert p.get_accumulated_feedback() == ["shorter", "friendlier"]
        got = p.get_accumulated_feedback()
        got.append("mutating a copy")
        assert p.get_accumulated_feedback() == ["shorter", "friendlier"]
        p.zero_feedback()
        assert p.get_accumulated_feedback() == []

    def test_frozen_parameter_ignores_feedback(self) -> None:
        p = Parameter("v", requires_grad=False)
        p.accumulate_feedback("ignored")
        assert p.get_accumulated_feedback() == []

    def test_apply_update_bumps_owner_and_clears_feedback(self) -> None:
        t = Tree()
        p = t.encoder.prompt
        p.accumulate_feedback("more detail")
        before_owner = t.encoder._module_state_version
        before_other = t.decoder._module_state_version
        p.apply_update("new value")
        assert p.value == "new value" and str(p) == "new value"
        assert p.get_accumulated_feedback() == []
        assert t.encoder._module_state_version == before_owner + 1
        assert t.decoder._module_state_version == before_other
        p.apply_update("newer")
        assert t.encoder._module_state_version == before_owner + 2

    def test_apply_update_unattached(self) -> None:
        p = Parameter("v", description="d")
        p.accumulate_feedback("x")
        p.apply_update("w")
        assert p.value == "w" and p.get_accumulated_feedback() == []

    def test_state_dict_reflects_updates(self) -> None:
        t = Tree()
        t.decoder.prompt.apply_update("dec v2")
        assert t.state_dict()["decoder.prompt"] == "dec v2"
