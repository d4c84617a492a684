"""Leader election through the cluster state: one active instance of a singleton.

Several processes may run a candidate for the same role (e.g. the planner in
every ``tandem serve`` of a cluster, for high availability); at most one holds
the role's lease at a time and acts::

    {ns}:leader:{role}     string     the leader's candidate id, PX ttl

A candidate takes the lease with ``SET NX PX`` and renews it with a script that
extends it only while it still holds the candidate's id, so a stalled leader
whose lease lapsed can never extend a successor's. The lease expires by the
Redis clock; the leader also stops acting on its own once ``ttl_s`` has passed
since the start of its last successful renewal (by its monotonic clock), which
is never later than the lease's expiry in Redis. A candidate that stops
releases the lease at once, so a successor does not wait for the TTL.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis

from tandem.control.state import ClusterState, ttl_ms

logger = logging.getLogger(__name__)

# KEYS: lease. ARGV: candidate id, ttl_ms. Extends the lease only if we hold it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: candidate id. Deletes the lease only if we hold it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaderElection:
    """One candidate for the leadership of ``role`` (call :meth:`poll` periodically).

    Not thread-safe: drive it from one thread or event loop.

    Args:
        state: the cluster state connection.
        role: what is elected (``planner``); the lease key is ``{ns}:leader:{role}``.
        ttl_s: the lease's lifetime, in seconds; :meth:`poll` must run well within it.
        candidate_id: this candidate's id (default: a random one).

    Raises:
        ValueError: ``ttl_s`` is not positive, or ``role`` is empty.
    """

    def __init__(self, state: ClusterState, role: str, ttl_s: float = 10.0,
                 candidate_id: str | None = None) -> None:
        if not role:
            raise ValueError("role must be non-empty")
        ttl_ms(ttl_s)       # validates
        self.state = state
        self.key = state.key("leader", role)
        self.ttl_s = ttl_s
        self.candidate_id = candidate_id or f"{role}-{uuid.uuid4().hex[:12]}"
        self._renew = state.redis.register_script(_RENEW)
        self._release = state.redis.register_script(_RELEASE)
        self._held_since: float | None = None     # monotonic start of the last good renewal

    @property
    def is_leader(self) -> bool:
        """This candidate holds the lease now, by its own clock (no Redis round trip)."""
        return self._held_since is not None and time.monotonic() - self._held_since < self.ttl_s

    def poll(self) -> bool:
        """Take or renew the lease; returns :attr:`is_leader` afterwards.

        A Redis error is logged and counts as no renewal: the leader steps down
        by itself once ``ttl_s`` has passed since its last good renewal.
        """
        t0 = time.monotonic()
        try:
            if self._held_since is not None and self._renew(keys=[self.key],
                                                            args=[self.candidate_id,
                                                                  ttl_ms(self.ttl_s)]):
                self._held_since = t0
            elif self.state.redis.set(self.key, self.candidate_id, nx=True,
                                      px=ttl_ms(self.ttl_s)):
                if self._held_since is None:
                    logger.info("%s: took the lead (%s)", self.candidate_id, self.key)
                self._held_since = t0
            elif self._held_since is not None:
                logger.warning("%s: lost the lead to %s", self.candidate_id, self.leader())
                self._held_since = None
        except redis.exceptions.RedisError as e:
            logger.warning("%s: leader election failed: %r", self.candidate_id, e)
        return self.is_leader

    def leader(self) -> str | None:
        """The current leader's candidate id, or ``None`` when nobody holds the lease.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        return self.state.redis.get(self.key)

    def resign(self) -> None:
        """Give the lease up now (if held), so another candidate can take it. Idempotent;
        a Redis error is logged (the lease then lapses within ``ttl_s``)."""
        held, self._held_since = self._held_since, None
        if held is None:
            return
        try:
            self._release(keys=[self.key], args=[self.candidate_id])
        except redis.exceptions.RedisError as e:
            logger.warning("%s: could not release %s: %r", self.candidate_id, self.key, e)
