"""API keys and TLS on the gRPC front end.

:class:`APIKeyInterceptor` checks each call's ``authorization: Bearer <key>``
metadata against an :class:`~tandem.router.auth.APIKeyStore` and refuses a call
without a valid key with ``UNAUTHENTICATED`` before its handler runs; health and
reflection stay open unless configured otherwise (load balancers and
``grpcurl`` probe them without keys). The key id of an accepted call is in a
:class:`contextvars.ContextVar` that the call's handler reads with
:func:`current_key_id`: grpc.aio runs the interceptors and the handler of one
call in one context of their own, so concurrent calls never see each other's id.

:func:`server_credentials` and :func:`open_channel` are the two ends of TLS.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable

import grpc

from tandem.router.auth import APIKeyStore, parse_bearer
from tandem.router.tls import TLSConfig, read_pem_file

logger = logging.getLogger(__name__)

HEALTH_METHODS = ("/grpc.health.v1.Health/*",)
REFLECTION_METHODS = ("/grpc.reflection.v1alpha.ServerReflection/*",
                      "/grpc.reflection.v1.ServerReflection/*")
DEFAULT_OPEN_METHODS = HEALTH_METHODS + REFLECTION_METHODS
"""Methods callable without a key by default: ``/package.Service/Method``, or
``/package.Service/*`` for every method of a service."""

MISSING_KEY = "missing API key: send metadata 'authorization: Bearer <key>'"
INVALID_KEY = "invalid API key"

_key_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_api_key_id",
                                                                     default=None)


def current_key_id() -> str | None:
    """Inside a call's handler: the key id (see :mod:`tandem.router.auth`) of the key
    the call presented; None when authentication is off or the method is open."""
    return _key_id.get()


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid API key (``UNAUTHENTICATED``; the message never
    repeats the key) except to ``open_methods``.

    Args:
        store: the accepted keys; must not be empty (an empty store means no
            authentication: install no interceptor).
        open_methods: see :data:`DEFAULT_OPEN_METHODS`.

    Raises:
        ValueError: ``store`` is empty, or a pattern does not start with ``/``.
    """

    def __init__(self, store: APIKeyStore, open_methods: Iterable[str] = DEFAULT_OPEN_METHODS):
        if not store.enabled:
            raise ValueError("api_keys: the store is empty (authentication off); "
                             "install no interceptor")
        self.store = store
        self._open_exact: set[str] = set()
        self._open_prefixes: list[str] = []
        for m in open_methods:
            if not m.startswith("/"):
                raise ValueError(f"open_methods: expected '/package.Service/Method', got {m!r}")
            if m.endswith("/*"):
                self._open_prefixes.append(m[:-1])
            else:
                self._open_exact.add(m)

    def is_open(self, method: str) -> bool:
        return method in self._open_exact or any(method.startswith(p) for p in self._open_prefixes)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if self.is_open(method):
            return await continuation(handler_call_details)
        headers = [v for k, v in handler_call_details.invocation_metadata or ()
                   if k == "authorization"]
        # Two authorization headers are ambiguous: refuse rather than pick one.
        key = parse_bearer(headers[0]) if len(headers) == 1 else None
        key_id = self.store.verify(key) if key is not None else None
        handler = await continuation(handler_call_details)
        if handler is None or key_id is not None:
            _key_id.set(key_id)
            return handler
        return _refusal(handler, method, MISSING_KEY if key is None else INVALID_KEY)


def _refusal(handler: grpc.RpcMethodHandler, method: str, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED."""
    async def refuse(_request, context) -> None:
        logger.info("refused %s from %s: %s", method, context.peer(), message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def open_methods(auth_health: bool) -> tuple[str, ...]:
    """The open methods of a Tandem server: health (unless ``auth_health``) and reflection."""
    return REFLECTION_METHODS if auth_health else DEFAULT_OPEN_METHODS


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """TLS credentials for ``add_secure_port``; verifies client certificates
    against ``tls.ca_certs`` when ``tls.cert_reqs`` is ``required``.

    Raises:
        ValueError: a file cannot be read.
    """
    cert, key, ca = tls.read_pem()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=tls.require_client_cert)


def open_channel(endpoint: str, tls: bool = False, ca_certs: str | None = None,
                 certfile: str | None = None, keyfile: str | None = None) -> grpc.Channel:
    """A client channel to ``endpoint``: plaintext, or TLS when ``tls`` or ``ca_certs``.

    Args:
        ca_certs: PEM CA bundle the server's certificate is verified against
            (None: gRPC's default roots).
        certfile, keyfile: this client's certificate and key, for a server that
            requires client certificates.

    Raises:
        ValueError: a file cannot be read, or only one of certfile and keyfile.
    """
    if (certfile is None) != (keyfile is None):
        raise ValueError("ssl_certfile, ssl_keyfile: give both or neither")
    if not (tls or ca_certs or certfile):
        return grpc.insecure_channel(endpoint)

    def read(flag: str, path: str | None) -> bytes | None:
        return None if path is None else read_pem_file(flag, path)
    creds = grpc.ssl_channel_credentials(root_certificates=read("ssl_ca", ca_certs),
                                         private_key=read("ssl_keyfile", keyfile),
                                         certificate_chain=read("ssl_certfile", certfile))
    return grpc.secure_channel(endpoint, creds)


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting ``api_key`` (none when None)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
