"""What a client reads when a request fails: a message with no traceback and no
server file path, whatever the exception behind it.

In process, no Ray, no model: worker errors as :func:`call_worker` wraps them.
"""

from __future__ import annotations

import asyncio
import re
import traceback
from types import SimpleNamespace

import pytest

from tandem.engine.sampling.sampling_params import InvalidParameterError
from tandem.router.worker_client import MAX_SUMMARY_CHARS, WorkerError, call_worker

LEAKS = re.compile(r'Traceback|File "|\.py\b|(?:^|[\s\'"(=])/[\w.-]+/')


def assert_clean(message: str) -> None:
    """No traceback, no file path, short: a message fit for a client."""
    assert not LEAKS.search(message), message
    assert len(message) <= 300, message


def _raised(exc: BaseException) -> tuple[BaseException, str]:
    """``exc`` raised and caught, with its formatted traceback (file paths included)."""
    try:
        raise exc
    except BaseException as e:
        return e, traceback.format_exc()


# -- worker errors as call_worker wraps them ------------------------------------------------

class _RemoteMethod:
    """A Ray actor method whose call fails with ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def remote(self, *args):
        async def fail():
            raise self.error
        return fail()


def _ray_task_error(cause: BaseException):
    import ray.exceptions as rex

    cause, tb = _raised(cause)
    return rex.RayTaskError("DecodeWorker.add_request", tb, cause).as_instanceof_cause()


def test_leak_pattern_catches_what_a_ray_error_holds():
    text = str(_ray_task_error(ValueError("bad")))
    assert "Traceback" in text or 'File "' in text
    with pytest.raises(AssertionError):
        assert_clean(text)


@pytest.mark.parametrize("cause, summary", [
    (ValueError("invalid literal for int() with base 10: 'x'"),
     "ValueError: invalid literal for int() with base 10: 'x'"),
    (RuntimeError("first line\n  File \"/srv/tandem/engine/x.py\", line 3\nmore"),
     "RuntimeError: first line"),
])
def test_a_ray_task_error_keeps_the_cause_type_and_first_line(cause, summary):
    actor = SimpleNamespace(add_request=_RemoteMethod(_ray_task_error(cause)))
    with pytest.raises(WorkerError) as info:
        asyncio.run(call_worker("decode-0", actor, "add_request"))
    assert str(info.value) == f"decode-0.add_request: {summary}"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_ray_task_error_with_a_typed_cause_is_the_cause():
    actor = SimpleNamespace(add_request=_RemoteMethod(
        _ray_task_error(InvalidParameterError("max_tokens", "too many"))))
    with pytest.raises(InvalidParameterError) as info:
        asyncio.run(call_worker("decode-0", actor, "add_request"))
    assert str(info.value) == "max_tokens: too many"


def test_an_in_process_worker_error_is_summarised_too():
    class Worker:
        async def add_request(self):
            raise OSError("x" * 1000 + "\nTraceback (most recent call last):")

    with pytest.raises(WorkerError) as info:
        asyncio.run(call_worker("decode-0", Worker(), "add_request"))
    assert str(info.value) == f"decode-0.add_request: OSError: {'x' * MAX_SUMMARY_CHARS}"
