"""The cluster state in Redis: the key schema, worker records and their leases.

Every key lives under a namespace prefix (``tandem`` by default), so several
clusters can share one Redis. Per worker id::

    {ns}:gen:{worker_id}      counter    INCR per registration: the generation
    {ns}:worker:{worker_id}   hash       worker_id, role, actor_name, info (JSON), generation
    {ns}:lease:{worker_id}    string     the generation holding the lease, PX ttl
    {ns}:workers              set        every registered worker id
    {ns}:draining             hash       worker_id -> the generation being drained

and once per cluster ``{ns}:epoch``, a random token the first reader creates: a
changed or vanished token tells the routers that Redis lost its data.

A worker is *alive* while its lease key exists. The generation fences stale
incarnations: a worker restarted under the same id registers a larger
generation, and the old process's renewals answer ``"fenced"`` from then on.
Expiry uses the Redis clock (``PX`` / ``PEXPIRE``), never a local one, so
routers and workers on different hosts agree on it.

Redis may lose everything (a restart without persistence, a flush). Workers
repair it: a renewal that finds neither its lease nor a newer generation
re-creates the counter, record and lease (``"reasserted"``), so the state
converges back within one renewal interval and generations never go backwards.
A worker started in place of one whose counter Redis lost passes the generation
it replaces (``min_generation``), so a successor still outranks its predecessor.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

LEASE_TTL_S = 10.0
"""A worker's lease lifetime in seconds: it counts as dead this long after its last renewal."""
RENEW_INTERVAL_S = 3.0
"""How often a worker renews its lease, in seconds (several renewals per TTL)."""

# KEYS: counter, record, lease, index. ARGV: worker_id, role, actor_name, info, ttl_ms,
# min_generation.
_REGISTER = """
local gen = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[6])
if gen < floor then
  gen = floor
  redis.call('SET', KEYS[1], gen)
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'worker_id', ARGV[1], 'role', ARGV[2], 'actor_name', ARGV[3],
           'info', ARGV[4], 'generation', gen)
redis.call('SET', KEYS[3], gen, 'PX', ARGV[5])
redis.call('SADD', KEYS[4], ARGV[1])
return gen
"""

# KEYS: counter, record, lease, index. ARGV: worker_id, generation, ttl_ms, role, actor_name, info.
# A counter above the generation means a newer incarnation registered (or the worker
# was dropped): fenced, whatever the lease says. A lease holding our generation is
# renewed (and a record lost on its own restored). No lease and no newer counter:
# Redis lost it or the lease lapsed with nobody replacing us, so we may reassert.
_RENEW = """
local gen = tonumber(ARGV[2])
local counter = tonumber(redis.call('GET', KEYS[1]) or '0')
if counter > gen then return 'fenced' end
local lease = redis.call('GET', KEYS[3])
if lease and tonumber(lease) ~= gen then return 'fenced' end
local status = 'renewed'
if lease then
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  if redis.call('EXISTS', KEYS[2]) == 1 then return status end
else
  status = 'reasserted'
  redis.call('SET', KEYS[1], gen)
  redis.call('SET', KEYS[3], gen, 'PX', ARGV[3])
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'worker_id', ARGV[1], 'role', ARGV[4], 'actor_name', ARGV[5],
           'info', ARGV[6], 'generation', gen)
redis.call('SADD', KEYS[4], ARGV[1])
return status
"""

# KEYS: counter, record, lease, index. ARGV: worker_id, generation.
# The counter moves past the dropped generation, so that the dropped process, if it
# still renews, is fenced instead of reasserting itself back into the cluster.
_DROP = """
local gen = tonumber(ARGV[2])
local counter = tonumber(redis.call('GET', KEYS[1]) or '0')
if counter ~= gen then return 0 end
redis.call('INCR', KEYS[1])
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""

# KEYS: lease. ARGV: generation.
_SUSPECT = """
local lease = redis.call('GET', KEYS[1])
if lease and tonumber(lease) == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


class ClusterStateUnavailable(redis.exceptions.ConnectionError):
    """The cluster state (Redis) cannot be reached. The message names it and its
    address (never its credentials), so that an operator sees which part failed.

    A ``redis.exceptions.ConnectionError``: code that handles an unreachable Redis
    handles this one too.
    """

    PREFIX = "cluster state (Redis) unreachable"
    """How every message of this error begins (also matched in errors that crossed Ray
    as text)."""

    def __init__(self, address: str, what: str = "", cause: BaseException | str | None = None):
        detail = f": {what}" if what else ""
        because = f" ({cause})" if cause else ""
        super().__init__(f"{self.PREFIX} at {address}{detail}{because}")
        self.address = address

    def __reduce__(self):
        # Pickled whole (across processes): rebuilt from its message, not re-formatted.
        return (_rebuild_unavailable, (str(self), self.address))


def _rebuild_unavailable(message: str, address: str) -> ClusterStateUnavailable:
    exc = ClusterStateUnavailable.__new__(ClusterStateUnavailable)
    redis.exceptions.ConnectionError.__init__(exc, message)
    exc.address = address
    return exc


def redacted_address(url: str) -> str:
    """``HOST:PORT/DB`` of a ``redis://`` URL, without user or password (for messages).

    Raises:
        ValueError: a malformed URL.
    """
    u = urllib.parse.urlsplit(url)
    host = u.hostname or "localhost"
    port = u.port or 6379
    return f"{host}:{port}{u.path or '/0'}"


def ttl_ms(ttl_s: float) -> int:
    """A TTL in seconds as Redis milliseconds (at least 1).

    Raises:
        ValueError: ``ttl_s`` is not positive.
    """
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


@dataclass(frozen=True)
class WorkerRecord:
    """A registered worker as the cluster state holds it.

    Attributes:
        worker_id: e.g. ``decode-0``; role: ``prefill``, ``decode`` or ``colocated``.
        generation: the incarnation that wrote the record (>= 1).
        actor_name: the name its actor is found under (a named Ray actor).
        info: the worker's model and cache facts, as it registered them.
        alive: its lease key exists.
    """

    worker_id: str
    role: str
    generation: int
    actor_name: str
    info: dict
    alive: bool


class ClusterState:
    """A connection to the cluster state (a redis-py client) and the key schema.

    The client decodes replies to ``str``. A command retries once on a dropped
    connection (a pooled connection goes stale when Redis restarts), never on a
    timeout, and raises ``redis.exceptions.ConnectionError`` / ``TimeoutError``
    when Redis stays unreachable; callers decide what that means.

    Args:
        url: ``redis://HOST:PORT/DB``.
        namespace: the prefix of every key.
        socket_timeout_s: connect and read timeout of each command, in seconds.

    Raises:
        ValueError: an empty ``namespace`` or a malformed ``url``.

    Attributes:
        redis: the redis-py client (thread-safe; a pool of connections).
        namespace: the key prefix.
        socket_timeout_s: as given.
        address: ``HOST:PORT/DB`` of Redis, without credentials (for messages).
    """

    def __init__(self, url: str, namespace: str = "tandem", socket_timeout_s: float = 2.0) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty")
        self.namespace = namespace
        self.socket_timeout_s = socket_timeout_s
        self.address = redacted_address(url)
        self.redis: redis.Redis = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)))
        self._register = self.redis.register_script(_REGISTER)
        self._renew = self.redis.register_script(_RENEW)
        self._drop = self.redis.register_script(_DROP)
        self._suspect = self.redis.register_script(_SUSPECT)

    def key(self, *parts: str) -> str:
        """``{namespace}:{part}:{part}...``."""
        return f"{self.namespace}:{':'.join(parts)}"

    def _worker_keys(self, worker_id: str) -> list[str]:
        return [self.key("gen", worker_id), self.key("worker", worker_id),
                self.key("lease", worker_id), self.key("workers")]

    def ping(self) -> bool:
        """Redis answers PING; ``False`` (never an exception) when it is unreachable."""
        try:
            return bool(self.redis.ping())
        except redis.exceptions.RedisError:
            return False

    def check(self, what: str = "") -> None:
        """Raise unless Redis answers PING.

        Args:
            what: what needed it, for the message (e.g. ``"worker decode-0 cannot register"``).

        Raises:
            ClusterStateUnavailable: Redis did not answer within ``socket_timeout_s``
                (the message names the address and the cause).
        """
        try:
            self.redis.ping()
        except redis.exceptions.RedisError as exc:
            raise ClusterStateUnavailable(self.address, what, exc) from exc

    # -- workers ---------------------------------------------------------------------------
    def register_worker(self, worker_id: str, role: str, actor_name: str, info: dict,
                        ttl_s: float = LEASE_TTL_S, min_generation: int = 0) -> int:
        """Register a new incarnation of ``worker_id``, atomically (one script).

        Takes the next generation, replaces the record, and sets the lease for
        ``ttl_s`` seconds. A process still running under an older generation is
        fenced from now on.

        Args:
            info: JSON-able model and cache facts.
            min_generation: the least generation to take: one more than the
                incarnation this one replaces, should Redis have lost the counter
                since (a restart without persistence).

        Returns:
            The generation: >= max(1, ``min_generation``), strictly increasing per
            worker id.

        Raises:
            ValueError: ``ttl_s`` is not positive.
            TypeError: ``info`` is not JSON-able.
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        return int(self._register(keys=self._worker_keys(worker_id),
                                  args=[worker_id, role, actor_name, json.dumps(info), ttl_ms(ttl_s),
                                        int(min_generation)]))

    def renew_lease(self, worker_id: str, generation: int, ttl_s: float, record: dict) -> str:
        """Extend the lease of incarnation ``generation`` by ``ttl_s`` seconds (one script).

        Args:
            record: ``{"role", "actor_name", "info"}``, written back if Redis lost the record.

        Returns:
            ``"renewed"``: the lease holds ``generation``; its expiry moved.
            ``"fenced"``: a newer generation registered, the worker was dropped,
            or the lease holds another generation; nothing changed.
            ``"reasserted"``: the lease was missing and no newer generation exists
            (Redis lost its data, or the lease lapsed with nobody replacing the
            worker); counter, record and lease were re-created with ``generation``.

        Raises:
            ValueError: ``ttl_s`` is not positive.
            KeyError: ``record`` lacks a field.
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        return self._renew(keys=self._worker_keys(worker_id),
                           args=[worker_id, generation, ttl_ms(ttl_s), record["role"],
                                 record["actor_name"], json.dumps(record["info"])])

    def drop_worker(self, worker_id: str, generation: int) -> bool:
        """Remove a worker (scale-down, clean shutdown) if ``generation`` is still its latest.

        The counter moves past ``generation``, so the dropped incarnation, should
        it renew again, is fenced; the next registration still gets a larger
        generation.

        Returns:
            ``True`` if removed; ``False`` when another generation registered since.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        return bool(self._drop(keys=self._worker_keys(worker_id), args=[worker_id, generation]))

    def workers(self) -> list[WorkerRecord]:
        """Every registered worker with its lease liveness, ordered by ``worker_id``.

        A dead worker stays listed (``alive=False``) until it re-registers,
        reasserts, or is dropped.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        ids = sorted(self.redis.smembers(self.key("workers")))
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=True)
        for wid in ids:
            pipe.hgetall(self.key("worker", wid))
            pipe.exists(self.key("lease", wid))
        replies = pipe.execute()
        out = []
        for wid, rec, alive in zip(ids, replies[0::2], replies[1::2]):
            if not rec:
                continue      # listed but its record is gone (a partial flush)
            out.append(WorkerRecord(worker_id=wid, role=rec["role"], generation=int(rec["generation"]),
                                    actor_name=rec["actor_name"], info=json.loads(rec["info"]),
                                    alive=bool(alive)))
        return out

    def epoch(self) -> str:
        """The cluster state's epoch token, created (at random) if missing.

        It lives as long as the Redis data does: a reader that sees it change
        knows Redis was flushed or restarted empty since its last look, even if
        some workers have already reasserted their records by then.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        key = self.key("epoch")
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(key, uuid.uuid4().hex, nx=True)
        pipe.get(key)
        return pipe.execute()[1]

    def generation(self, worker_id: str) -> int | None:
        """The worker's generation counter; ``None`` if it never registered (or Redis lost it).

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        value = self.redis.get(self.key("gen", worker_id))
        return None if value is None else int(value)

    def mark_suspect(self, worker_id: str, generation: int) -> bool:
        """Delete the worker's lease if it still holds ``generation`` (a router saw it die).

        Its liveness flips at once, without waiting for the TTL. A worker that is
        in fact alive reasserts at its next renewal.

        Returns:
            ``True`` if the lease was deleted.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        return bool(self._suspect(keys=[self.key("lease", worker_id)], args=[generation]))

    # -- draining (scale-down) ---------------------------------------------------------------
    def set_draining(self, worker_id: str, generation: int) -> None:
        """Mark incarnation ``generation`` of ``worker_id`` as draining: routers send it
        no new requests (a later incarnation under the same id is not affected).

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        self.redis.hset(self.key("draining"), worker_id, int(generation))

    def clear_draining(self, worker_id: str) -> None:
        """Forget that ``worker_id`` was draining (it is gone, or back in service).

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        self.redis.hdel(self.key("draining"), worker_id)

    def draining(self) -> dict[str, int]:
        """Worker id -> the generation being drained.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis is unreachable.
        """
        return {wid: int(gen) for wid, gen in self.redis.hgetall(self.key("draining")).items()}

    def close(self) -> None:
        """Close the client's connections. Idempotent."""
        self.redis.close()
