"""`tandem serve` with API keys and TLS: a real colocated cluster (one worker), the
key and the CA as a client passes them, the ``tandem generate`` client, and the
OpenAI HTTP API behind the same keys over HTTPS (the ``openai`` client).

The refusals of every kind are tested without a cluster in
tests/test_grpc_security.py; this module checks that ServeConfig reaches the
router's port and that a full ``Generate`` goes through it.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.router.auth import APIKeyStore
from tandem.router.grpc_security import bearer_metadata, open_channel
from tandem.router.tls import TLSConfig
from tandem.v1 import tandem_pb2_grpc as pb_grpc

from .conftest import greedy, serve_config, start_server

pytestmark = pytest.mark.slow

KEYS = ["tk-e2e-first-0123456789", "tk-e2e-second-abcdefghij"]


@pytest.fixture(scope="module")
def secured(ray_session, pki):
    cfg = dataclasses.replace(serve_config("colocated", num_blocks=64, http_port=0),
                              api_keys=APIKeyStore(KEYS),
                              tls=TLSConfig(pki.server_cert, pki.server_key))
    server = start_server(cfg)
    yield server
    server.stop()


def test_generate_with_a_key_over_tls(secured, pki):
    with open_channel(secured.address, ca_certs=pki.ca) as ch:
        stub = pb_grpc.TandemStub(ch)
        for key in KEYS:
            out = list(stub.Generate(greedy("The capital of France is", 3),
                                     metadata=bearer_metadata(key), timeout=120))
            assert sum(len(r.token_ids) for r in out) == 3
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(greedy("Hi", 3), timeout=30))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING     # open for probes


def test_plaintext_clients_are_refused(secured):
    with grpc.insecure_channel(secured.address) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            list(pb_grpc.TandemStub(ch).Generate(greedy("Hi", 3), metadata=bearer_metadata(KEYS[0]),
                                                 timeout=30))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tandem_generate_reaches_the_secured_server(secured, pki, capsys, monkeypatch):
    from tandem.router import cli

    monkeypatch.setenv("TANDEM_API_KEY", KEYS[1])
    rc = cli.main(["generate", "--endpoint", secured.address, "--ssl-ca", pki.ca,
                   "--max-tokens", "3", "The capital of France is"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "tokens, FINISH_REASON_" in out.out


# -- the OpenAI HTTP API on the same cluster -------------------------------------------------

@pytest.fixture(scope="module")
def https_url(secured) -> str:
    return f"https://127.0.0.1:{secured.server.http_port}"


@pytest.fixture(scope="module")
def ca(pki):
    """httpx's ``verify``: trust the test CA only."""
    import ssl

    return ssl.create_default_context(cafile=pki.ca)


def test_openai_client_over_https_with_each_key(https_url, ca):
    import httpx
    import openai

    for key in KEYS:
        api = openai.OpenAI(base_url=https_url + "/v1", api_key=key, max_retries=0,
                            http_client=httpx.Client(verify=ca, timeout=60))
        r = api.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer tk-wrong-key-0123456789"},
    {"Authorization": "Basic " + "dGs6eA=="},
    {"Authorization": f"Bearer {KEYS[0]}x"},
    {"Host": "localhost"},                                # a crafted Host changes nothing
    {"Host": "127.0.0.1", "X-Forwarded-For": "127.0.0.1"},
])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/tokenize",
                                  "/health/../v1/models", "//v1/models"])
def test_http_without_a_valid_key_is_401(https_url, ca, headers, path):
    import httpx

    r = httpx.post(https_url + path, json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi"},
                   headers=headers, verify=ca, timeout=30) if path != "/v1/models" else \
        httpx.get(https_url + path, headers=headers, verify=ca, timeout=30)
    assert r.status_code == 401, (path, headers, r.text)
    err = r.json()["error"]
    assert err["type"] == "AuthenticationError" and err["code"] == 401
    assert KEYS[0] not in r.text and r.headers["www-authenticate"] == "Bearer"


def test_http_health_and_metrics_stay_open_and_plain_http_is_refused(https_url, ca, secured):
    import httpx

    assert httpx.get(https_url + "/health", verify=ca).status_code == 200
    assert "tandem:" in httpx.get(https_url + "/metrics", verify=ca).text
    with pytest.raises(httpx.HTTPError):
        httpx.get(https_url + "/v1/models", timeout=10)          # no CA: the handshake fails
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{secured.server.http_port}/health", timeout=10)

