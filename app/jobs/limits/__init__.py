"""Per-endpoint limits shared by every worker, kept in Redis and changed only by atomic Lua scripts.

* :class:`GlobalRateLimiter`: requests per minute, adaptive on 429.
* :class:`ConcurrencySlots`: max concurrency as leased, renewable slots.
* :class:`EndpointLimiter`: both around one request, built from an ``EndpointConfig``.

No Celery here: workers and the embedded mode use the same limits.
"""

from app.jobs.limits.endpoint import EndpointLimiter, Permit, endpoint_id
from app.jobs.limits.rate import GlobalRateLimiter, RateConfig, RateState, WaitStats
from app.jobs.limits.scripts import LimitKeys
from app.jobs.limits.slots import ConcurrencySlots, SlotLease, SlotTimeoutError

__all__ = [
    "ConcurrencySlots",
    "EndpointLimiter",
    "GlobalRateLimiter",
    "LimitKeys",
    "Permit",
    "RateConfig",
    "RateState",
    "SlotLease",
    "SlotTimeoutError",
    "WaitStats",
    "endpoint_id",
]
