"""What a client reads when a request fails: a status, and a message with no
traceback and no server file path, whatever the exception behind it.

In process, no Ray, no model: worker errors as :func:`call_worker` wraps them,
and the gRPC service over a stand-in orchestrator that raises them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import traceback
from types import SimpleNamespace

import grpc
import pytest

from tandem.engine.sampling.sampling_params import InvalidParameterError
from tandem.router.orchestrator import RequestFailed, ServiceUnavailable
from tandem.router.server import TandemService, start_grpc_server
from tandem.router.worker_client import MAX_SUMMARY_CHARS, WorkerError, call_worker
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

VOCAB = 100
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


# -- the gRPC service over an orchestrator that fails -----------------------------------------

class _Tokenizer:
    vocab_size = VOCAB
    hf_tokenizer = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]


class _FailingOrchestrator:
    """Raises ``error`` where the real one would yield sample events."""

    def __init__(self):
        self.cluster = SimpleNamespace(can_serve=True)
        self.error: BaseException | None = None

    async def generate(self, v, abort_source="grpc_cancel"):
        raise self.error
        yield  # an async generator, as the real one


INFO = dict(model_name="m", max_model_len=64, block_size=16, dtype="float32", vocab_size=VOCAB)


def _call(error: BaseException, request: pb.GenerateRequest, patch=None):
    """Serve one ``Generate`` whose orchestrator raises ``error``; the client's RpcError."""
    async def run():
        orchestrator = _FailingOrchestrator()
        orchestrator.error = error
        service = TandemService(orchestrator, _Tokenizer(), INFO)
        if patch is not None:
            patch(service)
        server, port, _ = await start_grpc_server(service, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.TandemStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(request, timeout=30):
                        pass
                return info.value
        finally:
            await server.stop(None)
    return asyncio.run(run())


REQUEST = pb.GenerateRequest(request_id="client-7", token_ids=pb.TokenIds(ids=[1, 2, 3]))


@pytest.mark.parametrize("error, code, message", [
    (InvalidParameterError("max_tokens", "prompt (3 tokens) + max_tokens (16) exceeds 8"),
     grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.max_tokens: prompt (3 tokens) + max_tokens (16) exceeds 8"),
    (InvalidParameterError("prompt_token_ids", "ids out of range [0, 50): [60]"),
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids: ids out of range [0, 50): [60]"),
    # Fields the client never sent: the router's bug, not bad input.
    (InvalidParameterError("output_token_ids", "a resumed request needs n == 1"),
     grpc.StatusCode.INTERNAL, "internal error while serving request client-7"),
    (WorkerError("decode-0", "add_request",
                 'ValueError: see File "/srv/tandem/engine/runtime/llm_engine.py"'),
     grpc.StatusCode.UNAVAILABLE,
     "worker decode-0 failed while serving request client-7; try again"),
    (ServiceUnavailable("no decode worker is alive"), grpc.StatusCode.UNAVAILABLE,
     "no decode worker is alive"),
    (RequestFailed("KV layout mismatch: block_size prefill=16 decode=32"),
     grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch: block_size prefill=16 decode=32"),
    (KeyError("request_id: 'abc' is not waiting for remote KV"), grpc.StatusCode.INTERNAL,
     "internal error while serving request client-7"),
    (RuntimeError('Traceback (most recent call last):\n  File "/srv/tandem/x.py", line 1'),
     grpc.StatusCode.INTERNAL, "internal error while serving request client-7"),
])
def test_each_failure_has_a_status_and_a_clean_message(error, code, message):
    err = _call(error, REQUEST)
    assert (err.code(), err.details()) == (code, message)
    assert_clean(err.details())


def test_an_unexpected_error_is_logged_with_its_traceback(caplog):
    with caplog.at_level(logging.ERROR, logger="tandem.router.server"):
        err = _call(RuntimeError("boom"), REQUEST)
    assert err.code() == grpc.StatusCode.INTERNAL
    logged = [r for r in caplog.records if r.name == "tandem.router.server"]
    assert len(logged) == 1 and "client-7" in logged[0].getMessage()
    assert logged[0].exc_info[0] is RuntimeError


def test_a_validator_crash_gets_an_error_id_to_quote(caplog):
    def crash(request):
        raise AttributeError("'NoneType' object has no attribute 'x' (/srv/tandem/router/v.py)")

    def patch(service):
        service.validator.validate = crash

    with caplog.at_level(logging.ERROR, logger="tandem.router.server"):
        err = _call(RuntimeError("unused"), REQUEST, patch)
    assert err.code() == grpc.StatusCode.INTERNAL
    found = re.fullmatch(r"internal error while serving request (error-[0-9a-f]{32})",
                         err.details())
    assert found, err.details()
    assert any(found.group(1) in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_refusal_by_the_validator_is_unchanged():
    err = _call(RuntimeError("unused"), pb.GenerateRequest(token_ids=pb.TokenIds(ids=[VOCAB])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == (
        f"token_ids.ids[0]: token id {VOCAB} is not below the vocabulary size {VOCAB}")
