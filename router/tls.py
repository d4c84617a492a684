"""TLS settings of a front end: the server certificate and, optionally, the CA that
client certificates must be signed by.

Shared by every front end, so it imports no gRPC or HTTP server; the flag names
and meanings are uvicorn's (``--ssl-certfile``, ``--ssl-keyfile``,
``--ssl-ca-certs``, ``--ssl-cert-reqs``), so one set of flags configures both.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

CERT_REQS = ("none", "required")
"""``--ssl-cert-reqs`` values: ``none`` (no client certificate asked for) or
``required`` (a client must present one signed by ``--ssl-ca-certs``). gRPC's
Python server offers no "optional" mode, so neither front end does."""


@dataclass(frozen=True)
class TLSConfig:
    """Serve over TLS.

    Attributes:
        certfile: PEM certificate chain of the server.
        keyfile: PEM private key of that certificate.
        ca_certs: PEM CA bundle that client certificates are verified against
            (used only when ``cert_reqs`` is ``required``).
        cert_reqs: ``none`` or ``required`` (see :data:`CERT_REQS`).

    Raises:
        ValueError: ``cert_reqs`` is unknown, or ``required`` without ``ca_certs``.
    """

    certfile: str
    keyfile: str
    ca_certs: str | None = None
    cert_reqs: str = "none"

    def __post_init__(self) -> None:
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"ssl_cert_reqs: expected one of {', '.join(CERT_REQS)}, "
                             f"got {self.cert_reqs!r}")
        if self.cert_reqs == "required" and not self.ca_certs:
            raise ValueError("ssl_cert_reqs: 'required' needs ssl_ca_certs (the CA that "
                             "signs client certificates)")

    @classmethod
    def from_args(cls, certfile: str | None, keyfile: str | None, ca_certs: str | None = None,
                  cert_reqs: str = "none") -> "TLSConfig | None":
        """The config of the ``--ssl-*`` flags; None (plaintext) when no certificate
        is given.

        Raises:
            ValueError: only one of certfile and keyfile is given, client
                certificate flags without a server certificate, or as the
                constructor.
        """
        if certfile is None and keyfile is None:
            if ca_certs is not None or cert_reqs != "none":
                raise ValueError("ssl_ca_certs: client certificates need TLS; pass "
                                 "--ssl-certfile and --ssl-keyfile too")
            return None
        if certfile is None or keyfile is None:
            raise ValueError("ssl_certfile, ssl_keyfile: give both or neither")
        return cls(certfile, keyfile, ca_certs, cert_reqs)

    @property
    def require_client_cert(self) -> bool:
        return self.cert_reqs == "required"

    @property
    def ssl_cert_reqs(self) -> int:
        """As the ``ssl`` module (and uvicorn's ``ssl_cert_reqs``) spell it."""
        return ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE

    def read_pem(self) -> tuple[bytes, bytes, bytes | None]:
        """``(certificate chain, private key, client CA or None)`` as PEM bytes.

        Raises:
            ValueError: a file cannot be read (the message names the flag and path).
        """
        ca = read_pem_file("ssl_ca_certs", self.ca_certs) if self.ca_certs else None
        return (read_pem_file("ssl_certfile", self.certfile),
                read_pem_file("ssl_keyfile", self.keyfile), ca)


def read_pem_file(flag: str, path: str) -> bytes:
    """The bytes of ``path``.

    Raises:
        ValueError: it cannot be read (the message names ``flag`` and the path).
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc}") from exc
