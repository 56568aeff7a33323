"""`jaxsync.PlanCache`: per-mix host plans, built once, never kept when the build fails."""

import pytest

import jaxsync


def test_on_miss_runs_before_a_build_and_only_on_a_miss():
    cache, events = jaxsync.PlanCache(maxsize=2), []

    def build(value):
        return lambda: events.append(("build", value)) or value

    assert cache.get("a", build(1), on_miss=lambda: events.append("check")) == 1
    assert cache.get("a", build(2), on_miss=lambda: events.append("check")) == 1  # a hit
    assert events == ["check", ("build", 1)]


def test_a_refusing_on_miss_builds_and_keeps_nothing():
    cache, built = jaxsync.PlanCache(), []

    def refuse():
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        cache.get("a", lambda: built.append(1) or 1, on_miss=refuse)
    assert built == [] and len(cache) == 0
    assert cache.get("a", lambda: 7) == 7  # control: the next clean call builds


def test_least_recently_used_mix_is_evicted():
    cache = jaxsync.PlanCache(maxsize=2)
    cache.get("a", lambda: 1)
    cache.get("b", lambda: 2)
    cache.get("a", lambda: 0)  # "a" is now the most recent
    cache.get("c", lambda: 3)
    assert cache.peek("b") is None and cache.peek("a") == 1 and cache.peek("c") == 3
