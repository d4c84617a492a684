"""Calls from the router to its workers, and the one place where errors that cross Ray
become typed exceptions.

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

from tandem.engine.runtime.worker_common import WorkerFencedError
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
            raise WorkerError(worker_id, method, summary(exc)) from exc
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
