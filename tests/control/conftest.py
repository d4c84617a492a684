"""Fixtures for the cluster state tests: one throwaway redis-server per test module.

Tests that restart or kill Redis start their own :class:`EmbeddedRedis`
(:func:`private_redis`), so the module's server stays up for the others.
"""

from __future__ import annotations

import shutil

import pytest

from tandem.control.redis_server import EmbeddedRedis
from tandem.control.state import ClusterState

_NO_REDIS = "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)"


@pytest.fixture(scope="module")
def redis_server():
    """An :class:`EmbeddedRedis` shared by the module's tests."""
    if shutil.which("redis-server") is None:
        pytest.skip(_NO_REDIS)
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def state(redis_server):
    """A :class:`ClusterState` on an emptied module server."""
    s = ClusterState(redis_server.url)
    s.redis.flushall()
    yield s
    s.close()


@pytest.fixture
def private_redis():
    """``private_redis()`` starts a server of the test's own (stopped at teardown)."""
    if shutil.which("redis-server") is None:
        pytest.skip(_NO_REDIS)
    servers: list[EmbeddedRedis] = []

    def start() -> EmbeddedRedis:
        servers.append(EmbeddedRedis().start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()
