"""Rate-limit admission of generation requests: one path for both front ends.

A front end calls :func:`admit` once a request has passed validation and before
the orchestrator sees it, and gives the slot back with :meth:`HeldSlot.release`
however the request ends. A refusal is a :exc:`RateLimitExceeded`, counted in
``tandem:requests_rate_limited`` here; the front end only says it in its
transport: gRPC ``RESOURCE_EXHAUSTED`` ``"<message> (retry after <s> s)"``, HTTP
429 with ``Retry-After: <s>``, the same whole seconds
(:func:`~tandem.control.rate_limits.retry_after_seconds`).

The limits are the :class:`~tandem.control.rate_limits.RateLimiter`'s, per API key
id (``anonymous`` without keys) and shared through Redis by every router and
front end. Should Redis be unreachable the request is admitted holding nothing
(:meth:`~tandem.control.rate_limits.RateLimiter.admit_or_pass` logs it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from tandem.control.rate_limits import RateLimiter, refusal_message, retry_after_seconds

logger = logging.getLogger(__name__)

ANONYMOUS = "anonymous"
"""The key id of requests made without an API key (no keys configured)."""


class RateLimitExceeded(Exception):
    """The request's API key is over its rate limit or concurrency cap.

    Attributes:
        reason: ``"rate"`` or ``"concurrency"``.
        retry_after_s: seconds until a retry may pass (0 for a concurrency refusal).
        retry_after_seconds: what a client is told to wait, in whole seconds (>= 1).

    ``str(error)`` is the message for the client
    (``"rate limit exceeded for this API key: too many requests per second"``).
    """

    def __init__(self, reason: str, retry_after_s: float, message: str):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.retry_after_seconds = retry_after_seconds(retry_after_s)


@dataclass(frozen=True)
class HeldSlot:
    """An admitted request's concurrency slot (and the rate token it spent)."""

    limiter: RateLimiter
    key_id: str
    request_id: str

    def release(self) -> asyncio.Future:
        """Give the slot back, off the event loop. Returns the future doing it: await
        it (shielded, in a ``finally``) to wait, or leave it to run. It never raises:
        a failure is logged, and the slot expires after the limiter's ``slot_ttl_s``."""
        async def run() -> None:
            try:
                await asyncio.to_thread(self.limiter.release, self.key_id, self.request_id)
            except Exception as exc:
                logger.warning("rate limiter: cannot release %s of %s: %s",
                               self.request_id, self.key_id, exc)

        return asyncio.ensure_future(run())


async def admit(limiter: RateLimiter | None, key_id: str | None, request_id: str,
                metrics=None) -> HeldSlot | None:
    """Take a rate-limit token and (if capped) a concurrency slot for ``request_id``.

    Args:
        limiter: the cluster's limiter; None: no limits, nothing is held.
        key_id: the caller's API key id; None means :data:`ANONYMOUS`.
        request_id: names the slot; unique among the key's requests in flight.
        metrics: optional :class:`~tandem.router.metrics.Metrics`; a refusal is
            counted in it.

    Returns:
        The slot to release when the request ends; None when nothing is held (no
        limiter, or Redis unreachable).

    Raises:
        RateLimitExceeded: a limit refuses the request.
    """
    if limiter is None:
        return None
    key_id = key_id or ANONYMOUS
    verdict = await limiter.admit_or_pass(key_id, request_id)
    if verdict is None:
        return None
    if not verdict.allowed:
        if metrics is not None:
            metrics.request_rate_limited(verdict.reason)
        raise RateLimitExceeded(verdict.reason, verdict.retry_after_s, refusal_message(verdict))
    return HeldSlot(limiter, key_id, request_id)
