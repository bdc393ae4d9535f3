"""A JSON response rendered with orjson (FastAPI deprecated its own ORJSONResponse), and the Content-Disposition
header of downloads."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import orjson
from starlette.responses import Response


def dumps(content: Any) -> bytes:
    """JSON bytes by orjson, or by the standard library for what orjson refuses (an integer past 64 bits or a lone
    surrogate in data stored before the API refused them): a response must never fail on its own content."""
    try:
        return orjson.dumps(content)
    except TypeError:
        return json.dumps(content, default=str, separators=(",", ":")).encode()


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def content_disposition(filename: str, disposition: str = "attachment") -> str:
    """An RFC 6266 ``Content-Disposition`` value for any file name: ``filename=`` holds an ASCII fallback (other
    characters, quotes and backslashes become ``_``) and, when the name is not plain ASCII, ``filename*=`` the
    exact name, UTF-8 and percent-encoded (RFC 8187). Control characters are dropped from both."""
    name = "".join(c for c in filename if c.isprintable() or c == " ")
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in name) or "download"
    value = f'{disposition}; filename="{fallback}"'
    if name and fallback != name:
        value += f"; filename*=UTF-8''{quote(name.encode('utf-8', 'replace'), safe='')}"
    return value
