"""API key store, Bearer parsing, TLS settings, the security flags and how the launcher
hands them to the front ends; no cluster."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from tandem.router import auth
from tandem.router.auth import APIKeyStore, parse_bearer, read_key_file
from tandem.router.tls import TLSConfig

KEYS = ["tk-alpha-0123456789", "tk-beta-abcdefghij", "tk-gamma-ZYXWVUTSRQ"]


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def test_each_key_verifies_to_its_stable_id():
    store = APIKeyStore(KEYS)
    assert store.enabled and len(store) == 3
    assert [store.verify(k) for k in KEYS] == [key_id(k) for k in KEYS]
    assert store.key_ids == tuple(key_id(k) for k in KEYS)
    # Stable across stores (restarts): per-key limits and metrics can use it.
    assert APIKeyStore(reversed(KEYS)).verify(KEYS[0]) == key_id(KEYS[0])


@pytest.mark.parametrize("presented", ["", "tk-alpha", "tk-alpha-01234567890",
                                       "TK-ALPHA-0123456789", " tk-alpha-0123456789",
                                       "tk-alpha-\udc80", "ключ"])
def test_anything_but_a_stored_key_is_refused(presented):
    assert APIKeyStore(KEYS).verify(presented) is None


def test_an_empty_store_means_auth_off_and_accepts_nothing():
    store = APIKeyStore()
    assert not store.enabled and len(store) == 0
    assert store.verify("anything") is None


def test_duplicates_count_once():
    assert len(APIKeyStore([KEYS[0], KEYS[0], KEYS[1]])) == 2


def test_the_store_keeps_no_plaintext():
    store = APIKeyStore(KEYS)

    def values(obj, depth=0):
        yield obj
        if depth > 4:
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from values(k, depth + 1)
                yield from values(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                yield from values(v, depth + 1)
        elif hasattr(obj, "__dict__"):
            yield from values(vars(obj), depth + 1)
    dumped = pickle.dumps(store)
    for key in KEYS:
        for v in values(store):
            if isinstance(v, (str, bytes)):
                assert key not in (v if isinstance(v, str) else v.decode("latin-1"))
        assert key.encode() not in dumped
        assert key not in repr(store)
    assert all(isinstance(d, bytes) and len(d) == 32 for d, _ in store._entries)


def test_verify_compares_every_digest_whatever_matches(monkeypatch):
    store = APIKeyStore(KEYS)
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented in (KEYS[0], KEYS[2], "wrong"):
        calls.clear()
        store.verify(presented)
        assert len(calls) == len(KEYS), presented


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "ключ", "nl\n"])
def test_malformed_keys_are_refused_without_echo(bad):
    with pytest.raises(ValueError) as exc:
        APIKeyStore([bad])
    assert not bad.strip() or bad.strip() not in str(exc.value)


def test_key_file_skips_comments_and_blank_lines(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# production keys\n\n  {KEYS[0]}  \n#{KEYS[2]}\n{KEYS[1]}\n")
    assert read_key_file(str(f)) == KEYS[:2]


def test_key_file_errors_name_the_line_not_the_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"{KEYS[0]}\nsecret with spaces\n")
    with pytest.raises(ValueError, match="line 2") as exc:
        read_key_file(str(f))
    assert "secret" not in str(exc.value)
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        read_key_file(str(tmp_path / "missing"))


def test_sources_combine_flags_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text(KEYS[1] + "\n")
    store = APIKeyStore.from_sources([KEYS[0]], str(f), {auth.API_KEYS_ENV: f" {KEYS[2]}, ,"})
    assert store.key_ids == tuple(key_id(k) for k in KEYS)
    monkeypatch.setenv(auth.API_KEYS_ENV, f"{KEYS[0]},{KEYS[1]}")
    assert len(APIKeyStore.from_sources()) == 2          # os.environ by default
    assert not APIKeyStore.from_sources(environ={}).enabled
    monkeypatch.setenv(auth.API_KEYS_ENV, "ok-key,bad key")
    with pytest.raises(ValueError, match=rf"{auth.API_KEYS_ENV}\[1\]"):
        APIKeyStore.from_sources()


@pytest.mark.parametrize("header, key", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER abc", "abc"),
    ("  Bearer   abc  ", "abc"), ("Bearer\tabc", "abc"),
    (None, None), ("", None), ("Bearer", None), ("Bearer ", None), ("abc", None),
    ("Basic YWxhZGRpbjpvcGVuc2VzYW1l", None), ("Bearer a b", None), ("Token abc", None),
    ("Bearerabc", None),
])
def test_parse_bearer(header, key):
    assert parse_bearer(header) == key


def test_tls_config_from_flags():
    assert TLSConfig.from_args(None, None) is None
    tls = TLSConfig.from_args("s.pem", "s.key", "ca.pem", "required")
    assert tls.require_client_cert and tls.ssl_cert_reqs == 2    # ssl.CERT_REQUIRED
    assert not TLSConfig.from_args("s.pem", "s.key").require_client_cert
    with pytest.raises(ValueError, match="both or neither"):
        TLSConfig.from_args("s.pem", None)
    with pytest.raises(ValueError, match="needs ssl_ca_certs"):
        TLSConfig.from_args("s.pem", "s.key", None, "required")
    with pytest.raises(ValueError, match="client certificates need TLS"):
        TLSConfig.from_args(None, None, "ca.pem", "required")
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        TLSConfig("s.pem", "s.key", "ca.pem", "optional")
    with pytest.raises(ValueError, match="ssl_certfile: cannot read"):
        TLSConfig("/nonexistent/s.pem", "s.key").read_pem()


def test_serve_and_router_flags_build_the_config(tmp_path, monkeypatch):
    import dataclasses

    from tandem.router import cli

    f = tmp_path / "keys"
    f.write_text(KEYS[1] + "\n")
    monkeypatch.setenv(auth.API_KEYS_ENV, KEYS[2])
    tls_flags = ["--ssl-certfile", "s.pem", "--ssl-keyfile", "s.key", "--ssl-ca-certs", "ca.pem",
                 "--ssl-cert-reqs", "required"]
    for argv in (["serve", "--mode", "colocated"], ["router", "--redis-url", "redis://x"]):
        args = cli.build_parser().parse_args(
            argv + ["--api-key", KEYS[0], "--api-key-file", str(f), "--auth-health", *tls_flags])
        sec = cli._security_config(args)
        assert sec["api_keys"].key_ids == tuple(key_id(k) for k in KEYS)
        assert sec["auth_health"] is True
        assert sec["tls"] == TLSConfig("s.pem", "s.key", "ca.pem", "required")
    args = cli.build_parser().parse_args(["serve", "--api-key", KEYS[0]])
    cfg = dataclasses.replace(cli._serve_config(args), **cli._security_config(args))
    assert cfg.api_keys.verify(KEYS[0]) == key_id(KEYS[0]) and cfg.tls is None
    assert KEYS[0] not in repr(cfg)


def test_auth_health_needs_keys():
    from tandem.router.launcher import ServeConfig

    with pytest.raises(ValueError, match="auth_health"):
        ServeConfig(auth_health=True)
    with pytest.raises(ValueError, match="auth_health"):
        ServeConfig(auth_health=True, api_keys=APIKeyStore())
    ServeConfig(auth_health=True, api_keys=APIKeyStore(KEYS))


def test_rate_limit_flags_build_the_limits(monkeypatch):
    from tandem.control.rate_limits import RateLimits
    from tandem.router import cli

    seen = []
    monkeypatch.setattr(cli, "_cmd_serve", lambda args: seen.append(args) or 0)
    assert cli.main(["serve", "--rate-limit", "2.5", "--rate-burst", "5",
                     "--max-concurrent-requests", "3"]) == 0
    assert cli._security_config(seen[0])["rate_limits"] == RateLimits(2.5, 5.0, 3)
    assert cli.main(["serve"]) == 0
    assert not cli._security_config(seen[1])["rate_limits"].enabled


@pytest.mark.parametrize("auth_health", [False, True])
def test_the_http_front_end_takes_the_same_keys(tokenizer, auth_health):
    import types

    from fastapi.testclient import TestClient

    from tandem.router.launcher import RouterServer, ServeConfig

    router = RouterServer(ServeConfig(api_keys=APIKeyStore(KEYS), auth_health=auth_health,
                                      http_port=0))
    router.cluster = types.SimpleNamespace(healthy=True, can_serve=False)
    info = {"model_name": "test", "max_model_len": 2048, "block_size": 16, "dtype": "float32",
            "vocab_size": tokenizer.vocab_size}
    http = router._http_front_end(types.SimpleNamespace(cluster=router.cluster), tokenizer, info)
    with TestClient(http.app) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        for key in KEYS:
            assert client.get("/v1/models",
                              headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.get("/health").status_code == (401 if auth_health else 200)
        assert client.get("/health", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code \
            == 200


def test_the_banner_says_how_the_port_is_secured():
    from tandem.router.launcher import RouterServer, ServeConfig

    def summary(**kw) -> str:
        return RouterServer(ServeConfig(**kw)).security_summary
    assert summary() == "plaintext, no API key"
    assert summary(api_keys=APIKeyStore(KEYS[:1])) == "plaintext, 1 API key"
    assert summary(api_keys=APIKeyStore(KEYS), tls=TLSConfig("s.pem", "s.key")) == "TLS, 3 API keys"
    assert summary(tls=TLSConfig("s.pem", "s.key", "ca.pem", "required")) == \
        "TLS, client certificates required, no API key"


def test_key_store_and_tls_settings_import_no_server_library():
    """The HTTP front end uses them too: they must not pull in gRPC (nor an HTTP server)."""
    from tests.test_architecture import _graph

    graph = _graph()
    for mod in ("tandem.router.auth", "tandem.router.tls"):
        third_party = {t.split(".")[0] for t in graph[mod] if not t.startswith("tandem.")}
        assert third_party <= {"hashlib", "hmac", "os", "collections", "ssl", "dataclasses",
                               "__future__"}, (mod, third_party)
