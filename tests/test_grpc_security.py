"""API keys and TLS on real grpc.aio servers over loopback (no model, no cluster).

The Tandem servers come from ``start_grpc_server`` over an orchestrator that has
no decode worker: a ``Generate`` call that gets past authentication is answered
``UNAVAILABLE`` ("no decode worker is alive"), one that does not is answered
``UNAUTHENTICATED`` before the handler runs. A small echo service behind
:class:`APIKeyInterceptor` shows what a handler of each kind sees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import types

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.router.auth import APIKeyStore
from tandem.router.grpc_security import (APIKeyInterceptor, bearer_metadata, current_key_id,
                                         open_channel)
from tandem.router.tls import TLSConfig
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

KEYS = ["tk-alpha-0123456789", "tk-beta-abcdefghij", "tk-gamma-ZYXWVUTSRQ"]
STORE = APIKeyStore(KEYS)
TIMEOUT = 10


class LoopThread:
    """An event loop on its own thread, for grpc.aio servers that sync clients call."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _echo_unary(request, context):
    await asyncio.sleep(0.005)      # concurrent calls interleave here
    return (current_key_id() or "").encode()


async def _echo_stream(request, context):
    for _ in range(2):
        await asyncio.sleep(0.005)
        yield (current_key_id() or "").encode()


async def _echo_write(request, context):   # the reader/writer style (a coroutine)
    await context.write((current_key_id() or "").encode())


async def _echo_client_stream(request_iterator, context):
    async for _ in request_iterator:
        pass
    return (current_key_id() or "").encode()


async def _echo_bidi(request_iterator, context):
    async for _ in request_iterator:
        yield (current_key_id() or "").encode()


async def _start_echo_server():
    server = grpc.aio.server(interceptors=[APIKeyInterceptor(STORE)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.KeyEcho", {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_echo_stream),
        "Write": grpc.unary_stream_rpc_method_handler(_echo_write),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_echo_client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(_echo_bidi),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture(scope="module")
def servers(tokenizer, pki):
    """name -> address: ``open`` (no keys), ``keys``, ``auth_health`` (health needs a
    key too), ``tls`` (keys + TLS), ``mtls`` (TLS, client certificates required),
    ``echo`` (the echo service behind the interceptor)."""
    from tandem.router.server import TandemService, start_grpc_server

    no_workers = types.SimpleNamespace(cluster=types.SimpleNamespace(can_serve=False))
    info = {"model_name": "test", "max_model_len": 2048, "block_size": 16, "dtype": "float32",
            "vocab_size": tokenizer.vocab_size}
    configs = {
        "open": {},
        "keys": {"api_keys": STORE},
        "auth_health": {"api_keys": STORE, "auth_health": True},
        "tls": {"api_keys": STORE, "tls": TLSConfig(pki.server_cert, pki.server_key)},
        "mtls": {"tls": TLSConfig(pki.server_cert, pki.server_key, pki.ca, "required")},
    }
    loop = LoopThread()
    started, addresses = [], {}
    for name, kw in configs.items():
        service = TandemService(no_workers, tokenizer, info)
        server, port, _ = loop.run(start_grpc_server(service, "127.0.0.1", 0, **kw))
        started.append(server)
        addresses[name] = f"127.0.0.1:{port}"
    server, port = loop.run(_start_echo_server())
    started.append(server)
    addresses["echo"] = f"127.0.0.1:{port}"
    yield addresses
    for server in started:
        loop.run(server.stop(0))
    loop.close()


def generate_req() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello", stream=True,
                              sampling=pb.SamplingParams(max_tokens=2))


def call_status(fn) -> tuple[grpc.StatusCode, str]:
    try:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def tandem_calls(address: str, key: str | None, **channel_kw):
    """Status of GetModelInfo and Generate presenting ``key``."""
    md = bearer_metadata(key)
    with open_channel(address, **channel_kw) as ch:
        stub = pb_grpc.TandemStub(ch)
        return (call_status(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md,
                                                      timeout=TIMEOUT)),
                call_status(lambda: stub.Generate(generate_req(), metadata=md, timeout=TIMEOUT)))


def health_status(address: str, key: str | None = None, **channel_kw):
    with open_channel(address, **channel_kw) as ch:
        return call_status(lambda: health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), metadata=bearer_metadata(key), timeout=TIMEOUT))


PAST_AUTH = [(grpc.StatusCode.OK, ""), (grpc.StatusCode.UNAVAILABLE, "no decode worker is alive")]


def test_without_keys_no_key_is_needed(servers):
    assert list(tandem_calls(servers["open"], None)) == PAST_AUTH


def test_a_missing_key_is_unauthenticated(servers):
    for code, details in tandem_calls(servers["keys"], None):
        assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("missing API key")


def test_another_scheme_counts_as_missing(servers):
    with grpc.insecure_channel(servers["keys"]) as ch:
        code, details = call_status(lambda: pb_grpc.TandemStub(ch).GetModelInfo(
            pb.GetModelInfoRequest(), metadata=(("authorization", f"Basic {KEYS[0]}"),),
            timeout=TIMEOUT))
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("missing API key")


@pytest.mark.parametrize("wrong", ["tk-wrong-key", KEYS[0][:-1], KEYS[0].upper()])
def test_a_wrong_key_is_unauthenticated_and_not_echoed(servers, wrong):
    for code, details in tandem_calls(servers["keys"], wrong):
        assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")


def test_two_authorization_headers_are_refused(servers):
    md = (("authorization", f"Bearer {KEYS[0]}"), ("authorization", f"Bearer {KEYS[1]}"))
    with grpc.insecure_channel(servers["keys"]) as ch:
        code, _ = call_status(lambda: pb_grpc.TandemStub(ch).GetModelInfo(
            pb.GetModelInfoRequest(), metadata=md, timeout=TIMEOUT))
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", KEYS)
def test_each_key_is_accepted(servers, key):
    assert list(tandem_calls(servers["keys"], key)) == PAST_AUTH


def test_health_and_reflection_are_open_by_default(servers):
    assert health_status(servers["keys"]) == (grpc.StatusCode.OK, "")
    with grpc.insecure_channel(servers["keys"]) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                      timeout=TIMEOUT)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        services = list_services(ch)
    assert "tandem.v1.Tandem" in services


def list_services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT))
    return [s.name for s in reply.list_services_response.service]


def test_auth_health_makes_health_require_a_key(servers):
    code, details = health_status(servers["auth_health"])
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("missing API key")
    assert health_status(servers["auth_health"], "tk-wrong-key")[0] == \
        grpc.StatusCode.UNAUTHENTICATED
    assert health_status(servers["auth_health"], KEYS[1]) == (grpc.StatusCode.OK, "")
    with grpc.insecure_channel(servers["auth_health"]) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                      timeout=TIMEOUT)
        assert call_status(lambda: watch)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert "tandem.v1.Tandem" in list_services(ch)     # reflection stays open


def echo_calls(channel, key: str | None) -> dict[str, object]:
    """What each kind of handler saw as the key id (or the status code it got)."""
    md = bearer_metadata(key)
    calls = {
        "Unary": lambda: channel.unary_unary("/test.KeyEcho/Unary")(b"x", metadata=md,
                                                                     timeout=TIMEOUT),
        "Stream": lambda: list(channel.unary_stream("/test.KeyEcho/Stream")(
            b"x", metadata=md, timeout=TIMEOUT)),
        "Write": lambda: list(channel.unary_stream("/test.KeyEcho/Write")(
            b"x", metadata=md, timeout=TIMEOUT)),
        "ClientStream": lambda: channel.stream_unary("/test.KeyEcho/ClientStream")(
            iter([b"x", b"y"]), metadata=md, timeout=TIMEOUT),
        "Bidi": lambda: list(channel.stream_stream("/test.KeyEcho/Bidi")(
            iter([b"x", b"y"]), metadata=md, timeout=TIMEOUT)),
    }
    out = {}
    for name, fn in calls.items():
        try:
            out[name] = fn()
        except grpc.RpcError as exc:
            out[name] = exc.code()
    return out


def test_every_kind_of_handler_sees_the_key_id_or_never_runs(servers):
    with grpc.insecure_channel(servers["echo"]) as ch:
        for key in KEYS:
            kid = STORE.verify(key).encode()
            assert echo_calls(ch, key) == {"Unary": kid, "Stream": [kid, kid], "Write": [kid],
                                           "ClientStream": kid, "Bidi": [kid, kid]}
        for key in (None, "tk-wrong-key"):
            assert set(echo_calls(ch, key).values()) == {grpc.StatusCode.UNAUTHENTICATED}


def test_concurrent_calls_keep_their_own_key_id(servers):
    def one(i: int) -> tuple[bytes, bytes]:
        key = KEYS[i % len(KEYS)]
        got = ch.unary_unary("/test.KeyEcho/Unary")(b"x", metadata=bearer_metadata(key),
                                                    timeout=TIMEOUT)
        return got, STORE.verify(key).encode()
    with grpc.insecure_channel(servers["echo"]) as ch:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for got, want in pool.map(one, range(30)):
                assert got == want


def test_tls_handshake_with_the_ca_and_a_key(servers, pki):
    assert list(tandem_calls(servers["tls"], KEYS[0], ca_certs=pki.ca)) == PAST_AUTH
    code, _ = tandem_calls(servers["tls"], None, ca_certs=pki.ca)[0]
    assert code == grpc.StatusCode.UNAUTHENTICATED       # TLS does not replace the key


def test_tls_clients_that_cannot_verify_the_server_fail(servers, pki):
    # The default roots do not know the test CA; another CA did not sign the server.
    for channel_kw in ({"tls": True}, {"ca_certs": pki.other_ca}):
        assert health_status(servers["tls"], **channel_kw)[0] == grpc.StatusCode.UNAVAILABLE
    assert health_status(servers["tls"])[0] == grpc.StatusCode.UNAVAILABLE   # plaintext


def test_required_client_certificates(servers, pki):
    address = servers["mtls"]
    assert health_status(address, ca_certs=pki.ca)[0] == grpc.StatusCode.UNAVAILABLE
    assert health_status(address, ca_certs=pki.ca, certfile=pki.other_client_cert,
                         keyfile=pki.other_client_key)[0] == grpc.StatusCode.UNAVAILABLE
    assert list(tandem_calls(address, None, ca_certs=pki.ca, certfile=pki.client_cert,
                             keyfile=pki.client_key)) == PAST_AUTH


def test_the_cli_client_presents_its_key_over_tls(servers, pki, monkeypatch, capsys):
    from tandem.router import cli

    def generate(*flags: str) -> str:
        rc = cli.main(["generate", "--endpoint", servers["tls"], "--max-tokens", "2", *flags, "Hi"])
        assert rc == 1          # no decode worker: the call fails, but after authentication
        return capsys.readouterr().err
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert "UNAUTHENTICATED: missing API key" in generate("--ssl-ca", pki.ca)
    assert "UNAVAILABLE: no decode worker" in generate("--ssl-ca", pki.ca, "--api-key", KEYS[2])
    monkeypatch.setenv("TANDEM_API_KEY", KEYS[1])
    assert "UNAVAILABLE: no decode worker" in generate("--ssl-ca", pki.ca)


def test_an_interceptor_needs_keys():
    with pytest.raises(ValueError, match="empty"):
        APIKeyInterceptor(APIKeyStore())
    with pytest.raises(ValueError, match="open_methods"):
        APIKeyInterceptor(STORE, ["grpc.health.v1.Health/*"])


def test_oversized_messages_and_metadata_are_refused_and_the_server_keeps_serving(servers):
    from tandem.router.server import MAX_MESSAGE_BYTES, MAX_METADATA_BYTES

    big = pb.GenerateRequest(prompt="x" * (MAX_MESSAGE_BYTES + 1), stream=True)
    with open_channel(servers["open"]) as ch:
        stub = pb_grpc.TandemStub(ch)
        code, _ = call_status(lambda: stub.Generate(big, timeout=TIMEOUT))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        code, details = call_status(lambda: stub.Generate(
            generate_req(), metadata=[("x-pad", "y" * (4 * MAX_METADATA_BYTES))], timeout=TIMEOUT))
        # Past the hard limit (1.25 x the soft one): always refused, before any handler.
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size" in details
    assert list(tandem_calls(servers["open"], None)) == PAST_AUTH
