"""Calls from the router to its workers (:class:`WorkerClient`, one typed method per
worker method), and the one place where errors that cross Ray become typed exceptions.

A worker method that raises one of the exceptions the router acts on
(:data:`TYPED_ERRORS`) reaches the caller as that exception itself; a worker
that is gone raises :class:`WorkerDiedError`; anything else a worker raises is
a :class:`WorkerError` whose message names the worker and the method, never
a traceback (a Ray task error's text holds the worker's one, with file paths:
only the cause's type and first line are kept). That message is for logs; the
front end answers clients without it. Nothing in the router matches on message
strings.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.runtime.outputs import RequestDelta, StepOutput, WorkerRequest, WorkerStats
from tandem.engine.runtime.worker_common import WorkerFencedError
from tandem.engine.scheduling.request import TokenLogprobs
from tandem.engine.sampling.sampling_params import InvalidParameterError
from tandem.kvtransfer.base import KVTransferError
from tandem.kvtransfer.layout import KVLayoutMismatchError


class WorkerError(RuntimeError):
    """A worker call failed for a reason the router does not act on specially.

    Attributes:
        worker_id: the worker; method: the method called.
    """

    def __init__(self, worker_id: str, method: str, message: str):
        super().__init__(f"{worker_id}.{method}: {message}")
        self.worker_id, self.method = worker_id, method


class WorkerDiedError(WorkerError):
    """The worker process (Ray actor) is gone or unreachable."""


# Exceptions a worker may raise that reach the router as themselves.
TYPED_ERRORS: tuple[type[BaseException], ...] = (
    KVLayoutMismatchError, KVTransferError, InvalidParameterError, KeyError, WorkerFencedError)


MAX_SUMMARY_CHARS = 300


def summary(exc: BaseException | None) -> str:
    """``"<type>: <first line of the message>"``, at most :data:`MAX_SUMMARY_CHARS`
    characters of message: what a :class:`WorkerError` keeps of a worker's exception."""
    if exc is None:
        return "failed"
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:MAX_SUMMARY_CHARS]}"


def as_raised(worker_id: str, method: str, exc: BaseException) -> BaseException:
    """What the router raises for ``exc``, raised by worker ``worker_id``'s
    ``method``: ``exc`` itself if it is one of :data:`TYPED_ERRORS`, else a
    :class:`WorkerError` with its type and first line."""
    if isinstance(exc, TYPED_ERRORS):
        return exc
    return WorkerError(worker_id, method, summary(exc))


def _ray_exceptions():
    import ray.exceptions as rex

    died = tuple(getattr(rex, n) for n in ("RayActorError", "ActorDiedError",
                                           "ActorUnavailableError") if hasattr(rex, n))
    return died, rex.RayTaskError


async def call_worker(worker_id: str, actor: Any, method: str, *args: Any) -> Any:
    """Await ``actor.<method>(*args)``: ``.remote()`` on a Ray actor handle, or a plain
    coroutine method on an in-process worker object.

    Raises:
        one of :data:`TYPED_ERRORS`: what the worker raised.
        WorkerDiedError: the actor died or is unreachable.
        WorkerError: anything else the worker raised (its type and message only).
    """
    bound = getattr(actor, method)
    if not hasattr(bound, "remote"):
        try:
            return await bound(*args)
        except TYPED_ERRORS:
            raise
        except Exception as exc:
            raise as_raised(worker_id, method, exc) from exc
    died, task_error = _ray_exceptions()
    try:
        return await bound.remote(*args)
    except died as exc:
        raise WorkerDiedError(worker_id, method, type(exc).__name__) from exc
    except task_error as exc:
        cause = exc.cause
        if isinstance(cause, TYPED_ERRORS):
            raise cause from None
        raise WorkerError(worker_id, method, summary(cause)) from None


class WorkerClient:
    """The router's typed view of one worker: each method awaits the worker method of
    the same name (:class:`~tandem.decode_worker.worker.DecodeWorker`,
    :class:`~tandem.prefill_worker.worker.PrefillWorker`) through
    :func:`call_worker`, so every one raises as that function says: one of
    :data:`TYPED_ERRORS`, :class:`WorkerDiedError` or :class:`WorkerError`.
    Role-specific methods exist on that role's workers only.

    Args:
        worker_id: the worker (named in errors).
        actor: its Ray actor handle, or an in-process worker object.
    """

    __slots__ = ("worker_id", "actor")

    def __init__(self, worker_id: str, actor: Any):
        self.worker_id, self.actor = worker_id, actor

    async def _call(self, method: str, *args: Any) -> Any:
        return await call_worker(self.worker_id, self.actor, method, *args)

    # -- every worker --------------------------------------------------------------------------
    async def info(self) -> dict:
        """Model and cache facts, KV layout, node address, pid, cores, generation."""
        return await self._call("info")

    async def fence(self, reason: str) -> None:
        await self._call("fence", reason)

    async def unfence(self) -> None:
        await self._call("unfence")

    async def poll(self, timeout_s: float, subscriber: str) -> list[StepOutput]:
        """Step outputs for ``subscriber`` (a router id), waiting up to ``timeout_s``."""
        return await self._call("poll", timeout_s, subscriber)

    async def open_output_stream(self, subscriber: str) -> dict:
        """A one-time rendezvous (``host``, ``port``, ``token``) for a connection on
        which the worker pushes ``subscriber``'s step outputs
        (:mod:`~tandem.engine.runtime.output_stream`)."""
        return await self._call("open_output_stream", subscriber)

    async def stats(self) -> WorkerStats:
        return await self._call("stats")

    async def abort(self, request_id: str, sample_index: int = 0) -> bool:
        """Stop sample ``sample_index`` of ``request_id`` wherever it is on the worker
        (sample 0 with the samples not yet forked from it); frees its blocks."""
        return await self._call("abort", request_id, sample_index)

    async def check_invariants(self) -> dict:
        return await self._call("check_invariants")

    async def shutdown(self) -> None:
        await self._call("shutdown")

    # -- decode (and colocated) workers ----------------------------------------------------------
    async def add_request(self, request: WorkerRequest) -> None:
        await self._call("add_request", request)

    async def start_decode(self, request_id: str, first_token_id: int | None,
                           first_logprobs: TokenLogprobs | None = None) -> RequestDelta | None:
        """The router's word on a remote prefill (see ``DecodeWorker.start_decode``):
        given None, the first token's delta if the prefill worker had handed it over
        on the KV channel."""
        return await self._call("start_decode", request_id, first_token_id, first_logprobs)

    async def extend_kv_load(self, request_id: str, timeout_s: float) -> bool:
        return await self._call("extend_kv_load", request_id, timeout_s)

    async def open_kv_channel(self, peer_id: str, peer_generation: int,
                              peer_layout: dict | None = None) -> dict:
        """The rendezvous prefill worker ``peer_id`` (incarnation ``peer_generation``,
        KV layout ``peer_layout``: which of its ranks holds which KV heads) joins to
        send its KV here."""
        return await self._call("open_kv_channel", peer_id, peer_generation, peer_layout)

    # -- prefill workers -----------------------------------------------------------------------
    async def prefill(self, request: WorkerRequest) -> RequestDelta:
        """Run the prompt, stream its KV, return the first token's delta."""
        return await self._call("prefill", request)

    async def connect_kv(self, peer_id: str, rendezvous: dict, decode_layout: dict,
                         generation: int) -> None:
        await self._call("connect_kv", peer_id, rendezvous, decode_layout, generation)

    async def close_kv_channel(self, peer_id: str) -> bool:
        return await self._call("close_kv_channel", peer_id)
