"""The one fair-share policy both transports use (app.jobs.limits.fairness): priority first, then tenants, then jobs."""

from __future__ import annotations

from app.jobs.limits.fairness import Demand, allocate, endpoints_cap
from app.pipeline.resources.config import ResourceConfig


def test_lower_priority_value_takes_every_slot_first() -> None:
    demands = [Demand("a", "acme", 0), Demand("urgent", "beta", -1)]
    assert allocate(5, demands) == {"urgent": 5}


def test_a_level_with_too_little_work_leaves_the_rest_to_the_next_level() -> None:
    demands = [Demand("urgent", "beta", -1, available=2), Demand("a", "acme", 0)]
    assert allocate(5, demands) == {"urgent": 2, "a": 3}


def test_a_new_tenant_gets_slots_ahead_of_a_tenant_that_holds_many() -> None:
    # acme holds 30 in flight; beta arrives with nothing: beta gets every slot until it catches up
    demands = [Demand("big", "acme", 0, in_flight=30), Demand("small", "beta", 0, available=10)]
    assert allocate(8, demands) == {"small": 8}
    assert allocate(40, demands) == {"small": 10, "big": 30}


def test_equal_tenants_share_equally() -> None:
    demands = [Demand("a", "acme", 0), Demand("b", "beta", 0), Demand("c", "corp", 0)]
    assert allocate(9, demands) == {"a": 3, "b": 3, "c": 3}


def test_weights_give_a_tenant_a_larger_share() -> None:
    demands = [Demand("a", "acme", 0), Demand("b", "beta", 0)]
    grants = allocate(9, demands, weights={"acme": 2.0})
    assert grants == {"a": 6, "b": 3}


def test_within_a_tenant_jobs_share_and_the_older_breaks_ties() -> None:
    demands = [Demand("new", "acme", 0, age=2.0), Demand("old", "acme", 0, age=1.0), Demand("b", "beta", 0)]
    grants = allocate(4, demands)
    assert grants == {"b": 2, "old": 1, "new": 1}
    assert list(allocate(1, [Demand("new", "acme", 0, age=2.0), Demand("old", "acme", 0, age=1.0)])) == ["old"]


def test_a_tenant_quota_caps_it_and_the_rest_goes_to_others() -> None:
    demands = [Demand("a", "acme", 0), Demand("b", "beta", 0, available=3)]
    assert allocate(10, demands, tenant_room={"acme": 2}) == {"a": 2, "b": 3}
    assert allocate(10, [Demand("a", "acme", 0)], tenant_room={"acme": 0}) == {}
    assert not allocate(1, [Demand("a", "acme", 0)], tenant_room={"acme": 0})


def test_nothing_to_hand_out() -> None:
    assert allocate(0, [Demand("a", "acme", 0)]) == {}
    assert allocate(3, []) == {}
    assert allocate(3, [Demand("a", "acme", 0, available=0)]) == {}


def test_the_endpoints_cap_is_twice_their_concurrency_when_all_are_limited() -> None:
    limited = ResourceConfig({"a": {"provider": "openai", "model": "m", "base_url": "http://x/v1", "max_concurrent": 8},
                              "b": {"provider": "openai", "model": "n", "base_url": "http://x/v1", "max_concurrent": 4}})
    assert endpoints_cap(limited) == 24
    unlimited = ResourceConfig({"a": {"provider": "openai", "model": "m", "base_url": "http://x/v1"}})
    assert endpoints_cap(unlimited) is None
    assert endpoints_cap(None) is None
    engine_only = ResourceConfig({"a": {"provider": "native", "model": "default"}})
    assert endpoints_cap(engine_only) is None


def test_a_lone_job_gets_what_it_can_take_at_once() -> None:
    assert allocate(10, [Demand("j", "t", 0)]) == {"j": 10}
    assert allocate(10, [Demand("j", "t", 0, available=3)]) == {"j": 3}
    assert allocate(10, [Demand("j", "t", 0)], tenant_room={"t": 4}) == {"j": 4}
    assert allocate(10, [Demand("j", "t", 0)], tenant_room={"t": 0}) == {}
    assert allocate(0, [Demand("j", "t", 0)]) == {}
    # a job that can take nothing does not compete
    assert allocate(5, [Demand("j", "t", 0), Demand("k", "u", 0, available=0)]) == {"j": 5}
