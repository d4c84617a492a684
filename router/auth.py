"""API keys: the set of keys a front end accepts, and the ``Authorization`` header.

Shared by every front end (gRPC through :mod:`tandem.router.grpc_security`, HTTP
alike), so it imports neither. Keys come from the command line, a file and the
environment, and are kept only as SHA-256 digests: a process dump, a log line or
a ``repr`` of the store shows no key. A presented key is hashed and compared with
every stored digest in constant time (``hmac.compare_digest``), without stopping
at the first match, so the time a check takes says nothing about which key, or
how much of one, matched.

A key is known by its *key id*: the first 8 hex digits of its digest. Ids are
not secret (a digest prefix says nothing usable about a high-entropy key) and
stay the same across restarts, so per-key rate limits, metrics and log lines can
name a caller without naming its key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

API_KEYS_ENV = "TANDEM_API_KEYS"
"""Server side: comma-separated API keys, added to ``--api-key`` and ``--api-key-file``."""
API_KEY_ENV = "TANDEM_API_KEY"
"""Client side (``tandem generate --endpoint``, ``tandem chat``): the key to present."""
KEY_ID_HEX_DIGITS = 8


def key_digest(key: str) -> bytes:
    """SHA-256 of ``key`` (UTF-8; a lone surrogate is encoded as itself, so it can
    never collide with a printable key)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _check_key(key: str, where: str) -> None:
    """Raise ValueError unless ``key`` can be sent as ``Authorization: Bearer <key>``
    (printable ASCII, no whitespace). The message names ``where``, never the key."""
    if not key:
        raise ValueError(f"{where}: empty API key")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces "
                         f"(it travels in a request header)")


class APIKeyStore:
    """The API keys a server accepts, as SHA-256 digests.

    An empty store means authentication is off: front ends install no check
    (see :attr:`enabled`). Duplicate keys count once.

    Args:
        keys: the keys, in plain text (read once, not kept).

    Raises:
        ValueError: a key is empty or not printable ASCII without whitespace, or
            two different keys share a key id (their digests' first 8 hex digits;
            vanishingly unlikely, but ids must name one key).
    """

    def __init__(self, keys: Iterable[str] = ()):
        entries: dict[bytes, str] = {}
        for i, key in enumerate(keys):
            _check_key(key, f"api_keys[{i}]")
            digest = key_digest(key)
            entries[digest] = digest.hex()[:KEY_ID_HEX_DIGITS]
        if len(set(entries.values())) != len(entries):
            raise ValueError("api_keys: two keys share a key id; replace one of them")
        self._entries: tuple[tuple[bytes, str], ...] = tuple(entries.items())

    @classmethod
    def from_sources(cls, keys: Iterable[str] = (), file: str | None = None,
                     environ: Mapping[str, str] | None = None) -> "APIKeyStore":
        """The keys of the command line, a key file and the environment together.

        Args:
            keys: keys given directly (``--api-key``, repeatable).
            file: a key file (``--api-key-file``), see :func:`read_key_file`.
            environ: where to read :data:`API_KEYS_ENV` (comma-separated; blank
                entries ignored); None reads ``os.environ``, ``{}`` reads nothing.

        Raises:
            ValueError: the file cannot be read, or a key is malformed (the
                message names the source and line, never the key).
        """
        env = os.environ if environ is None else environ
        found = list(keys)
        for i, key in enumerate(found):
            _check_key(key, f"api_key[{i}]")
        if file is not None:
            found += read_key_file(file)
        for i, key in enumerate(k.strip() for k in env.get(API_KEYS_ENV, "").split(",")):
            if key:
                _check_key(key, f"{API_KEYS_ENV}[{i}]")
                found.append(key)
        return cls(found)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (no key: authentication is off)."""
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The ids of the stored keys, in the order they were given."""
        return tuple(kid for _, kid in self._entries)

    def verify(self, presented: str) -> str | None:
        """The key id of ``presented`` if it is one of the stored keys, else None
        (always None for an empty store).

        Every stored digest is compared, in constant time, whatever matched: the
        time taken depends on the number of keys only.
        """
        digest = key_digest(presented)
        found = None
        for stored, kid in self._entries:
            if hmac.compare_digest(stored, digest):
                found = kid
        return found

    def __repr__(self) -> str:
        return f"APIKeyStore(key_ids={list(self.key_ids)})"


def read_key_file(path: str) -> list[str]:
    """The keys in a key file: one per line; blank lines and lines starting with
    ``#`` are skipped, surrounding whitespace is stripped.

    Raises:
        ValueError: the file cannot be read, or a line holds a malformed key
            (``"<path> line <n>: ..."``, never the key itself).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file: cannot read {path!r}: {exc}") from exc
    keys = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if line and not line.startswith("#"):
            _check_key(line, f"api_key_file {path!r} line {n}")
            keys.append(line)
    return keys


def parse_bearer(header_value: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, or None.

    The scheme is case-insensitive and surrounding whitespace is ignored; anything
    else (no value, another scheme, no key, a key with inner whitespace) is None.
    """
    if not header_value:
        return None
    parts = header_value.strip().split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]
