"""Per-API-key request rate limits and concurrency caps, shared by every router.

Two limits per key, both kept in Redis so that every router (and every front end,
gRPC and HTTP) of the cluster counts against the same numbers:

* **rate**: a token bucket (``rate`` requests per second, at most ``burst``
  saved up). Each request takes one token; an empty bucket refuses it with the
  seconds until the next token. Refill uses the Redis clock (``TIME``), so
  routers on different hosts agree.
* **concurrency**: at most ``max_concurrency`` requests of the key in flight at
  once. An admitted request is a member of the key's sorted set with an expiry
  score, like a decode reservation (:mod:`tandem.control.reservations`): a router
  that dies without releasing leaks the slot for at most ``ttl_s`` seconds, and a
  long request keeps its slot with :meth:`RateLimiter.refresh`.

Keys::

    {ns}:ratelimit:{key_id}     hash         tokens, ts (microseconds)
    {ns}:concurrency:{key_id}   sorted set   member = request id, score = expiry (ms)

A limit of 0 (or None) disables it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from tandem.control.state import ClusterState, ttl_ms

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RateLimits:
    """The limits of one key (the same for every key).

    Attributes:
        rate: requests per second refilled into the bucket (0: no rate limit).
        burst: bucket size in requests (default: max(1, rate)).
        max_concurrency: requests in flight at once (0: no cap).
    """

    rate: float = 0.0
    burst: float = 0.0
    max_concurrency: int = 0

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst < 0 or self.max_concurrency < 0:
            raise ValueError("rate, burst and max_concurrency must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.rate > 0 or self.max_concurrency > 0

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst > 0 else max(1.0, self.rate)


@dataclass(frozen=True)
class Admission:
    """The answer to :meth:`RateLimiter.admit`.

    Attributes:
        allowed: the request may run (it then holds a concurrency slot, if capped).
        reason: ``"rate"`` or ``"concurrency"`` when refused, else None.
        retry_after_s: seconds after which a retry may pass (rate refusals), else 0.
    """

    allowed: bool
    reason: str | None = None
    retry_after_s: float = 0.0


# KEYS: bucket, concurrency set. ARGV: rate (per s), bucket size, max_concurrency,
# request id, slot ttl (ms). The concurrency check runs first, so a request refused for
# concurrency spends no token; the token is taken only when both pass.
_ADMIT = """
local now_s, now_us = unpack(redis.call('TIME'))
local now = tonumber(now_s) * 1000000 + tonumber(now_us)
local rate, size, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now_ms = math.floor(now / 1000)
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  if redis.call('ZSCORE', KEYS[2], ARGV[4]) == false and redis.call('ZCARD', KEYS[2]) >= cap then
    return {0, 'concurrency', '0'}
  end
end
if rate > 0 then
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = tonumber(state[1]) or size
  local ts = tonumber(state[2]) or now
  tokens = math.min(size, tokens + (now - ts) / 1000000 * rate)
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
    redis.call('PEXPIRE', KEYS[1], math.ceil(size / rate * 1000) + 1000)
    return {0, 'rate', tostring((1 - tokens) / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(size / rate * 1000) + 1000)
end
if cap > 0 then
  redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[5]), ARGV[4])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[5]) + 1000)
end
return {1, '', '0'}
"""

# KEYS: concurrency set. ARGV: slot ttl (ms), request ids...
_REFRESH = """
local now_s, now_us = unpack(redis.call('TIME'))
local expiry = tonumber(now_s) * 1000 + math.floor(tonumber(now_us) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) + 1000)
return 1
"""


class RateLimiter:
    """Admits requests per API key id under :class:`RateLimits`, atomically in Redis.

    Args:
        state: the cluster state connection.
        limits: the per-key limits.
        slot_ttl_s: a concurrency slot's lifetime without :meth:`refresh` (seconds).
    """

    def __init__(self, state: ClusterState, limits: RateLimits, slot_ttl_s: float = 120.0):
        self.state, self.limits, self.slot_ttl_s = state, limits, slot_ttl_s
        self._admit = state.redis.register_script(_ADMIT)
        self._refresh = state.redis.register_script(_REFRESH)

    def _keys(self, key_id: str) -> list[str]:
        return [self.state.key("ratelimit", key_id), self.state.key("concurrency", key_id)]

    def admit(self, key_id: str, request_id: str) -> Admission:
        """Take a token and (if capped) a concurrency slot for ``request_id``, or refuse.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        lim = self.limits
        allowed, reason, retry = self._admit(
            keys=self._keys(key_id),
            args=[lim.rate, lim.bucket_size, lim.max_concurrency, request_id, ttl_ms(self.slot_ttl_s)])
        if int(allowed):
            return Admission(True)
        return Admission(False, reason.decode() if isinstance(reason, bytes) else reason,
                         float(retry))

    def release(self, key_id: str, request_id: str) -> None:
        """Give back ``request_id``'s concurrency slot (a no-op if it holds none)."""
        if self.limits.max_concurrency > 0:
            self.state.redis.zrem(self.state.key("concurrency", key_id), request_id)

    def refresh(self, key_id: str, request_ids: list[str]) -> None:
        """Push the expiry of these held slots to ``slot_ttl_s`` from now."""
        if self.limits.max_concurrency > 0 and request_ids:
            self._refresh(keys=[self.state.key("concurrency", key_id)],
                          args=[ttl_ms(self.slot_ttl_s), *request_ids])

    def in_flight(self, key_id: str) -> int:
        """Slots the key holds now (expired ones not counted; the Redis clock)."""
        now_s, now_us = self.state.redis.time()
        return self.state.redis.zcount(self.state.key("concurrency", key_id),
                                       f"({now_s * 1000 + now_us // 1000}", "+inf")

    async def admit_or_pass(self, key_id: str, request_id: str) -> Admission | None:
        """:meth:`admit` off the event loop, for a front end. None when Redis is
        unreachable: the request is admitted holding nothing (logged), since the
        limits protect capacity and must not refuse everyone while Redis is down."""
        try:
            return await asyncio.to_thread(self.admit, key_id, request_id)
        except Exception as exc:
            logger.warning("rate limiter unavailable, admitting %s: %s", request_id, exc)
            return None


def refusal_message(verdict: Admission) -> str:
    """What a front end tells a client that ``verdict`` refused."""
    what = ("too many requests per second" if verdict.reason == "rate"
            else "too many concurrent requests")
    return f"rate limit exceeded for this API key: {what}"


def retry_after_seconds(retry_after_s: float) -> int:
    """The whole seconds a refused client is told to wait: an
    :attr:`Admission.retry_after_s` rounded up, at least 1 (a concurrency refusal
    has no refill time to quote). Both front ends quote it, so they agree: HTTP's
    ``Retry-After`` header holds whole seconds, and gRPC's message the same number."""
    return max(1, math.ceil(retry_after_s))
