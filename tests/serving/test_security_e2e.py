"""`tandem serve` with API keys and TLS: a real colocated cluster (one worker), the
key and the CA as a client passes them, and the ``tandem generate`` client.

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
    cfg = dataclasses.replace(serve_config("colocated", num_blocks=64), api_keys=APIKeyStore(KEYS),
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
