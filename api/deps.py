"""Dependencies: the serving object of this app, and the Bearer API-key check for /v1/*."""

from __future__ import annotations

from fastapi import Request

from app.jobs.tenants import ANONYMOUS, KeyRing
from app.serving import OpenAIServing
from app.serving.errors import unauthorized


def get_serving(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.serving
    return serving


def key_ring(request: Request) -> KeyRing:
    ring: KeyRing | None = getattr(request.app.state, "key_ring", None)
    if ring is None:
        ring = request.app.state.key_ring = KeyRing(request.app.state.settings.api_keys)
    return ring


async def require_api_key(request: Request) -> None:
    """401 unless ``Authorization: Bearer <key>`` names one of ``settings.api_keys`` (none configured = open);
    the key's tenant is kept on the request for :func:`get_owner`."""
    ring = key_ring(request)
    if ring.open:
        request.state.tenant = ANONYMOUS
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized(
            "You didn't provide an API key. Send it in the Authorization header: 'Authorization: Bearer YOUR_KEY'."
        )
    tenant = ring.tenant_of(token.strip())
    if tenant is None:
        raise unauthorized(
            "Incorrect API key provided. Use one of the keys configured in INF_ENGINE_API_KEYS."
        )
    request.state.tenant = tenant


def get_owner(request: Request) -> str:
    """The tenant that owns what this request creates and the only one that may read it (app/jobs/tenants.py):
    the tenant a ``tenant:key`` entry names, a hash of a bare key (never the key itself), or "anonymous" on a
    server without keys."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # a route outside the keyed routers: authenticate here
        ring = key_ring(request)
        _, _, token = request.headers.get("authorization", "").partition(" ")
        tenant = ring.tenant_of(token.strip())
        if tenant is None:
            raise unauthorized("Incorrect API key provided. Use one of the keys configured in INF_ENGINE_API_KEYS.")
    return str(tenant)
