"""Tenants: who owns what a request creates.

Every resource (job, file, batch, training, evaluation, schedule, feedback request, a pipeline's parameter
versions and its active version) belongs to one tenant, and another tenant's key gets 404 for it. Keys come from
the setting ``api_keys``: an entry ``tenant:key`` names its tenant (several keys may share one), a bare ``key`` is
a tenant of its own. A client sends the key (``Authorization: Bearer key``; the whole ``tenant:key`` is accepted
too). A server without keys has one tenant, ``anonymous``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

ANONYMOUS = "anonymous"
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,47}$")


@dataclass(frozen=True)
class KeyEntry:
    secret: str  # what the client sends
    full: str  # the setting's entry as written (also accepted)
    tenant: str


def parse_key(entry: str) -> KeyEntry:
    """One ``api_keys`` entry: ``tenant:key`` when the part before the first colon is a tenant name (letters,
    digits, ``_.@-``, at most 48) and a key follows; otherwise a bare key, its own tenant."""
    entry = entry.strip()
    name, sep, secret = entry.partition(":")
    if sep and secret and _TENANT_NAME.match(name):
        return KeyEntry(secret=secret, full=entry, tenant=name)
    return KeyEntry(secret=entry, full=entry, tenant=bare_key_tenant(entry))


def bare_key_tenant(key: str) -> str:
    """The tenant of a key that names none: a hash of the key (the key itself is never stored)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]


class KeyRing:
    """The configured keys; :meth:`tenant_of` is the tenant of a presented token, or None for a wrong one."""

    def __init__(self, entries: list[str]) -> None:
        self.entries = [parse_key(entry) for entry in entries if entry.strip()]

    @property
    def open(self) -> bool:
        return not self.entries

    def tenant_of(self, token: str) -> str | None:
        if self.open:
            return ANONYMOUS
        found = None
        given = token.encode()
        for entry in self.entries:  # compare with every entry: the time taken does not say which matched
            if hmac.compare_digest(given, entry.secret.encode()) or hmac.compare_digest(given, entry.full.encode()):
                found = found or entry.tenant
        return found
