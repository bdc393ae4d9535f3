"""Dependencies: the serving object of this app, and the Bearer API-key check for /v1/*."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from app.serving import OpenAIServing
from app.serving.errors import unauthorized


def get_serving(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.serving
    return serving


async def require_api_key(request: Request) -> None:
    """401 unless ``Authorization: Bearer <key>`` names one of ``settings.api_keys`` (none configured = open)."""
    keys: list[str] = request.app.state.settings.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized(
            "You didn't provide an API key. Send it in the Authorization header: 'Authorization: Bearer YOUR_KEY'."
        )
    token = token.strip()
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
        raise unauthorized(
            "Incorrect API key provided. Use one of the keys configured in INF_ENGINE_API_KEYS."
        )


def get_owner(request: Request) -> str:
    """Who owns what this request creates: a hash of its API key (never the key itself), or "anonymous" on a
    server without keys. Jobs and files are visible only to their owner."""
    if not request.app.state.settings.api_keys:
        return "anonymous"
    _, _, token = request.headers.get("authorization", "").partition(" ")
    return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:24]
