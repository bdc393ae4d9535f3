"""Checking real answers against the app's own OpenAPI document, strictly: besides the types, required keys and
nullability, an object may hold no key its model does not name (the published document leaves extra keys open;
the check closes them, so a model that forgot a key fails here)."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(child) for child in node]
    if not isinstance(node, dict):
        return node
    closed = {key: _closed(child) for key, child in node.items()}
    if isinstance(closed.get("properties"), dict) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _pointer(*parts: str) -> str:
    return "#/" + "/".join(part.replace("~", "~0").replace("/", "~1") for part in parts)


class ResponseChecker:
    """``check(method, path, status, body)`` validates ``body`` against the schema the document gives for that
    operation's ``status`` answer (``path`` as the document writes it, e.g. ``/v1/jobs/{job_id}``)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = _closed(document)
        self.registry: Registry[Any] = Registry().with_resource(
            "urn:openapi", Resource.from_contents(self.document, default_specification=DRAFT202012))
        self.checked: set[tuple[str, str]] = set()

    def schema_name(self, method: str, path: str, status: int) -> str | None:
        """The component the operation's answer names, or None when it names none."""
        content = self.document["paths"][path][method.lower()]["responses"][str(status)].get("content", {})
        ref = content.get("application/json", {}).get("schema", {}).get("$ref", "")
        return ref.rsplit("/", 1)[-1] or None

    def check(self, method: str, path: str, status: int, body: Any) -> None:
        assert self.schema_name(method, path, status), f"{method} {path} {status} names no response model"
        pointer = _pointer("paths", path, method.lower(), "responses", str(status), "content", "application/json",
                           "schema")
        validator = Draft202012Validator({"$ref": f"urn:openapi{pointer}"}, registry=self.registry)
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        assert not errors, f"{method} {path} {status}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:5])
        self.checked.add((method.upper(), path))
