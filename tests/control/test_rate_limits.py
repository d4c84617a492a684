"""Per-key token buckets and concurrency caps in a real redis-server, shared by every
limiter (router) of the cluster."""

from __future__ import annotations

import time

import pytest

from tandem.control.rate_limits import RateLimiter, RateLimits


def test_the_bucket_allows_the_burst_then_refuses_until_a_token_refills(state):
    lim = RateLimiter(state, RateLimits(rate=5.0, burst=2))
    assert lim.admit("k1", "a").allowed and lim.admit("k1", "b").allowed
    refused = lim.admit("k1", "c")
    assert (refused.allowed, refused.reason) == (False, "rate")
    assert 0 < refused.retry_after_s <= 0.2 + 1e-6
    assert lim.admit("k2", "x").allowed            # another key has its own bucket
    time.sleep(refused.retry_after_s + 0.02)
    assert lim.admit("k1", "c").allowed
    assert not lim.admit("k1", "d").allowed


def test_two_routers_share_one_bucket(state):
    first, second = (RateLimiter(state, RateLimits(rate=0.5, burst=3)) for _ in range(2))
    admitted = [lim.admit("k", f"r{i}").allowed for i, lim in enumerate([first, second] * 3)]
    assert admitted == [True, True, True, False, False, False]


def test_the_concurrency_cap_counts_held_slots_and_spends_no_token_on_refusal(state):
    lim = RateLimiter(state, RateLimits(rate=0.01, burst=3, max_concurrency=2))
    assert lim.admit("k", "a").allowed and lim.admit("k", "b").allowed
    assert lim.in_flight("k") == 2
    assert lim.admit("k", "c") == lim.admit("k", "c")
    assert lim.admit("k", "c").reason == "concurrency"
    lim.release("k", "a")
    assert lim.admit("k", "c").allowed              # the third token: none was spent above
    assert lim.in_flight("k") == 2
    assert lim.admit("k", "d").reason == "concurrency"


def test_a_slot_expires_unless_refreshed(state):
    lim = RateLimiter(state, RateLimits(max_concurrency=1), slot_ttl_s=0.3)
    assert lim.admit("k", "a").allowed
    for _ in range(3):
        time.sleep(0.15)
        lim.refresh("k", ["a"])
        assert lim.admit("k", "b").reason == "concurrency"
    time.sleep(0.4)                                   # a's router died: the slot lapses
    assert lim.in_flight("k") == 0 and lim.admit("k", "b").allowed


def test_limits_are_validated():
    with pytest.raises(ValueError):
        RateLimits(rate=-1)
    assert not RateLimits().enabled and RateLimits(rate=2).bucket_size == 2
    assert RateLimits(rate=0.5).bucket_size == 1
