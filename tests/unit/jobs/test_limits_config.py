"""Validation and naming of the global limits (no Redis needed)."""

from __future__ import annotations

import pytest

from app.jobs.limits import LimitKeys, RateConfig, endpoint_id
from app.jobs.limits.slots import ConcurrencySlots
from app.pipeline import EndpointConfig


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"rpm": 0}, "rpm must be > 0"),
        ({"rpm": 60, "min_rpm": 0}, "min_rpm must be > 0"),
        ({"rpm": 60, "max_tokens": 0.5}, "max_tokens must be >= 1"),
        ({"rpm": 60, "backoff_factor": 1.0}, "backoff_factor must be between 0 and 1"),
        ({"rpm": 60, "recovery_factor": 1.0}, "recovery_factor must be > 1"),
        ({"rpm": 60, "idle_ttl_s": 0}, "idle_ttl_s must be > 0"),
    ],
)
def test_bad_knobs_are_refused_with_their_name(knobs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RateConfig(**knobs)


def test_defaults_mirror_the_in_process_rate_limiter() -> None:
    config = RateConfig(rpm=120)
    assert (config.max_tokens, config.min_rpm, config.recovery_factor, config.backoff_factor) == (
        1,
        1,
        1.1,
        0.5,
    )


def test_keys_live_under_the_prefix_and_endpoint() -> None:
    keys = LimitKeys("inf", "openai:gpt@https://api")
    assert keys.rate == "inf:limit:openai:gpt@https://api:rate"
    assert keys.slots == "inf:limit:openai:gpt@https://api:slots"
    assert keys.released.endswith(":released")
    assert keys.all() == [keys.rate, keys.slots]


def test_endpoint_id_names_provider_model_and_server() -> None:
    assert endpoint_id(EndpointConfig("openai", "gpt-4o", base_url="https://api.openai.com/v1/")) == (
        "openai:gpt-4o@https://api.openai.com/v1"
    )
    assert endpoint_id(EndpointConfig("native", "smollm2")) == "native:smollm2@local"


def test_slot_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_slots must be >= 1"):
        ConcurrencySlots(None, "ep", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease_ttl_s"):
        ConcurrencySlots(None, "ep", 1, lease_ttl_s=0.01)  # type: ignore[arg-type]
