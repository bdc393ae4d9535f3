"""Per-tenant quotas: how many items one tenant may have queued, and how many of its node tasks may be in flight.

The defaults are the settings ``tenant_max_queued_items`` and ``tenant_max_inflight_nodes`` (0: unlimited);
``tenant_quotas`` overrides either for named tenants. The queued-items quota is enforced here, at submission
(:func:`admit_items`, inside the submitting transaction); the in-flight quota by the dispatcher, which asks
:func:`quota_for`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from app.db.repository.quotas import lock_tenant_quota, open_item_count
from app.jobs.errors import QuotaExceeded
from app.settings import Settings, env_name

QUEUED_ITEMS = "max_queued_items"
INFLIGHT_NODES = "max_inflight_nodes"


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's limits; 0 means unlimited."""

    max_queued_items: int = 0
    max_inflight_nodes: int = 0


@dataclass(frozen=True)
class QuotaTable:
    """The quotas of every tenant: the defaults and the per-tenant overrides (the settings' values)."""

    default: TenantQuota = TenantQuota()
    overrides: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> QuotaTable:
        default = TenantQuota(settings.tenant_max_queued_items, settings.tenant_max_inflight_nodes)
        return cls(default, {tenant: dict(quota) for tenant, quota in settings.tenant_quotas.items()})

    def for_tenant(self, tenant: str) -> TenantQuota:
        override = self.overrides.get(tenant, {})
        return TenantQuota(
            max_queued_items=override.get(QUEUED_ITEMS, self.default.max_queued_items),
            max_inflight_nodes=override.get(INFLIGHT_NODES, self.default.max_inflight_nodes),
        )

    def source(self, tenant: str, key: str) -> str:
        """Where the tenant's limit ``key`` is set, as an operator would look for it."""
        if key in self.overrides.get(tenant, {}):
            return f"{env_name('tenant_quotas')}, {tenant}.{key}"
        return env_name(f"tenant_{key}")


def quota_for(settings: Settings, tenant: str) -> TenantQuota:
    """The tenant's quota: its entry in ``tenant_quotas`` where it has one, else the ``tenant_max_*`` settings."""
    return QuotaTable.from_settings(settings).for_tenant(tenant)


def admit_items(session: Session, *, tenant: str, adding: int, quotas: QuotaTable) -> None:
    """Raise :class:`QuotaExceeded` unless the tenant's open items plus ``adding`` fit its queued-items quota.

    Call it in the transaction that then writes the job: on PostgreSQL it takes the tenant's lock first (held
    until that transaction ends), so concurrent submissions of one tenant are counted one after the other."""
    limit = quotas.for_tenant(tenant).max_queued_items
    if limit <= 0:
        return
    lock_tenant_quota(session, tenant=tenant)
    queued = open_item_count(session, tenant=tenant)
    if queued + adding <= limit:
        return
    where = quotas.source(tenant, QUEUED_ITEMS)
    if adding > limit:
        advice = f"split it into jobs of at most {limit:,} items"
    else:
        advice = "wait for some of its jobs to finish (or cancel some), or ask the operator to raise the limit"
    raise QuotaExceeded(
        f"tenant {tenant} has {queued:,} items queued or running; this job adds {adding:,}; the limit is "
        f"{limit:,} ({where}): {advice}",
        code="tenant_max_queued_items",
    )
