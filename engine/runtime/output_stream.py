"""Step outputs pushed from a worker to its router over one TCP connection.

A router used to fetch its step outputs with one Ray actor call per step
(``poll``): per step a task submitted, a thread hop on the worker, Ray's
serialization and its gRPC round trip, about 0.06 of a core at a steady batch of
4 on the 2-core reference machine, every cycle of it taken from the engine's
OpenMP team. Here a worker thread polls the subscriber's outbox on the router's
behalf and writes each batch of step outputs as one frame as soon as a step
publishes it; the router reads frames on its event loop (one wake-up per step).
vLLM's engine core pushes its outputs to the API server the same way (a ZMQ
socket), not by request.

Setup rides on the (authenticated) worker call: :meth:`OutputStreamServer.open`
returns the address and a fresh random token for one subscriber; the router
connects, sends the token, and the worker answers with an HMAC-SHA256 of it, so
each side knows the other had the token (nothing else reaches the worker from
the connection before the token, and the router reads nothing before that proof;
the frames that follow are pickles, trusted as the worker call that issued the
token is). The token works once.

The worker's answer is the proof followed by an 8-byte little-endian count: the
frames with outputs it had sent (handed to the kernel) to this subscriber on its
earlier streams. Then frames, worker to router only: an 8-byte little-endian length and
a pickle (protocol 5) of the list that
:meth:`EngineLoop.poll <tandem.engine.runtime.engine_loop.EngineLoop.poll>`
returned (step outputs, and the answers to requests sent on the stream); an
empty list every :data:`HEARTBEAT_S` seconds while nothing is published (the
router's sign that the worker is alive; not counted).

Failures: the worker closes the connection when its engine loop failed or when
it shuts down; the router then opens a new stream at once, and that call fails
for a worker that died or whose engine failed (the worker is then lost to it).
A batch whose send fails goes back to the front of the outbox (the router's
next stream or poll reads it). A connection that breaks while the worker lives
(a reset, a router that closed its end) may still take outputs with it: a batch
handed to the kernel that the router never read. A router that reconnects
compares the worker's count with the frames it read (the worker first ends the
old stream and waits for its thread, so the count is final); if they differ, outputs are lost
and the router treats the worker as lost (its requests resume elsewhere from
their journaled tokens, as for a dead worker), never streaming with a gap.

Requests on the stream: a worker built with ``on_request`` also reads frames from
the router once the handshake is done, the same framing the other way (an 8-byte
length and a pickle of a :class:`~tandem.engine.runtime.outputs.WorkerRequest`, at
most :data:`MAX_REQUEST_FRAME_BYTES`), and runs each request it reads: a decode
(or colocated) worker adds it, a prefill worker prefills it. The answer, an
:class:`~tandem.engine.runtime.outputs.AddResult` (added, or prefilled with its
first token, or the error the call would have raised), comes back in the router's
outbox, ahead of the request's first delta. A request takes a fraction of a
millisecond this way; as a Ray actor call (``add_request``) it took 2-3 ms to
reach the engine, and the call's work on the worker's threads then ran beside the
prompt's prefill on the same cores. When the connection breaks before a request's
answer came, the router cannot tell whether the worker read it: it makes the call
(``add_request``, ``prefill``), marked ``sent_on_stream``, and the worker matches
that call with the frame if one came (the request runs once;
:class:`~tandem.engine.runtime.early_adds.EarlyAdds`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import pickle
import secrets
import socket
import threading
from typing import Callable

from tandem.engine.runtime.outputs import AddResult, StepOutput, WorkerRequest

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""Seconds without a step after which the worker sends an empty frame."""

TOKEN_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a connection has to present its token (worker) or the proof (router)."""
CONNECT_TIMEOUT_S = 2.0
"""Seconds the router waits for the worker to accept its connection."""

MAX_REQUEST_FRAME_BYTES = 64 << 20
"""The largest request frame a worker reads (bytes); a longer one ends the connection."""

_LABEL = b"tandem-output-stream"
_LEN = 8


def _proof(token: bytes) -> bytes:
    return hmac.new(token, _LABEL, hashlib.sha256).digest()


class OutputStreamError(ConnectionError):
    """The output stream could not be set up or ended (the handshake failed, the
    worker closed it, a frame was cut short)."""


class OutputStreamServer:
    """The worker's end: a listener whose connections each push one subscriber's
    step outputs.

    Args:
        poll: ``poll(timeout_s, subscriber) -> list[StepOutput]`` (the engine loop's:
            waits up to ``timeout_s`` seconds for the first output; raises once the
            loop failed).
        host: the address to listen on (the worker's node address).
        unread: ``unread(subscriber, steps)`` puts back what a send failed to deliver
            (the engine loop's), so the subscriber's next stream or poll has it.
        on_request: ``on_request(subscriber, request)``, called on a connection's
            reader thread with each request its router sends on the stream (see the
            module docstring); None: nothing is read from routers.
    """

    def __init__(self, poll: Callable[[float, str], list[StepOutput | AddResult]], host: str,
                 unread: Callable[[str, list[StepOutput | AddResult]], None],
                 on_request: Callable[[str, WorkerRequest], None] | None = None):
        self._poll, self._unread, self._on_request = poll, unread, on_request
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._tokens: dict[bytes, str] = {}    # unused token -> subscriber
        # subscriber -> (its stream's connection, set when that stream's thread ended)
        self._active: dict[str, tuple[socket.socket, threading.Event]] = {}
        self._frames: dict[str, int] = {}      # subscriber -> frames with outputs taken
        self._closed = False
        threading.Thread(target=self._accept, name="output-stream", daemon=True).start()

    def open(self, subscriber: str) -> dict:
        """A one-time rendezvous for ``subscriber``'s stream: ``{"host", "port",
        "token", "requests"}`` (the token as hex; ``requests``: whether this worker
        reads requests from the stream)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._tokens[token] = subscriber
        return {"host": self.host, "port": self.port, "token": token.hex(),
                "requests": self._on_request is not None}

    @property
    def num_streams(self) -> int:
        """Connections pushing outputs now (one per router that reads this worker)."""
        with self._lock:
            return len(self._active)

    def close(self) -> None:
        """Stop listening and end every stream (their routers see the connection close)."""
        with self._lock:
            self._closed = True
            conns = [conn for conn, _ in self._active.values()]
        for s in [self._sock, *conns]:
            _shut(s)
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                        # closed
            threading.Thread(target=self._serve, args=(conn,), name="output-stream-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        done = threading.Event()
        subscriber = None
        with conn:
            try:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
                token = _recv_exactly(conn, TOKEN_BYTES)
                with self._lock:
                    subscriber = self._tokens.pop(token, None)
                    if subscriber is None or self._closed:
                        return                # an unknown (or used) token: say nothing
                    previous = self._active.get(subscriber)
                if previous is not None:
                    # The router reconnects: its old stream is dead to it. End that one
                    # and let its thread finish, so the count below is final.
                    _shut(previous[0])
                    if not previous[1].wait(HANDSHAKE_TIMEOUT_S):
                        return
                with self._lock:
                    if self._closed:
                        return
                    self._active[subscriber] = (conn, done)
                    taken = self._frames.get(subscriber, 0)
                conn.settimeout(None)         # a slow router blocks its own stream only
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_proof(token) + taken.to_bytes(_LEN, "little"))
                if self._on_request is not None:
                    threading.Thread(target=self._read_requests, args=(conn, subscriber),
                                     name="output-stream-requests", daemon=True).start()
                self._push(conn, subscriber)
            except OSError:
                pass                          # the router went away or we shut down
            except Exception as exc:          # the loop failed: the router's reopen says why
                logger.warning("output stream ends: %s", exc)
            finally:
                with self._lock:
                    if subscriber is not None and self._active.get(subscriber, (None,))[0] is conn:
                        del self._active[subscriber]
                done.set()

    def _push(self, conn: socket.socket, subscriber: str) -> None:
        while not self._closed:
            steps = self._poll(HEARTBEAT_S, subscriber)
            payload = pickle.dumps(steps, protocol=5)
            try:
                conn.sendall(len(payload).to_bytes(_LEN, "little") + payload)
            except OSError:
                self._unread(subscriber, steps)       # not sent: the next reader has them
                raise
            if steps:
                # Counted once handed to the kernel: a frame the router then never read
                # is one it finds missing when it reconnects.
                with self._lock:
                    self._frames[subscriber] = self._frames.get(subscriber, 0) + 1


    def _read_requests(self, conn: socket.socket, subscriber: str) -> None:
        """Hand each request frame of ``conn`` to ``on_request`` until the connection
        ends; a frame over the size limit, or one that is not a request, ends it."""
        try:
            while True:
                size = int.from_bytes(_recv_exactly(conn, _LEN), "little")
                if size > MAX_REQUEST_FRAME_BYTES:
                    raise ValueError(f"a request frame of {size} bytes")
                request = pickle.loads(_recv_exactly(conn, size))
                if not isinstance(request, WorkerRequest):
                    raise ValueError(f"a frame with a {type(request).__name__}")
                try:
                    self._on_request(subscriber, request)
                except Exception as exc:     # the request's call decides; never the stream
                    logger.warning("request %s from the stream: %s", request.request_id, exc)
        except OSError:
            pass                             # closed: the push thread ends the stream
        except Exception as exc:
            logger.warning("output stream of %s ends: %s", subscriber, exc)
            _shut(conn)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return bytes(buf)


class OutputStream:
    """The router's end of one worker's output stream (use :meth:`connect`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self.takes_requests = False
        """Whether the worker reads requests from this stream (:meth:`send`)."""
        self.frames_before = 0
        """Frames with outputs the worker had sent to this subscriber on all its
        earlier streams when this one started (a reconnecting router compares it with
        what it read: a difference is outputs lost with a broken connection)."""

    @classmethod
    async def connect(cls, rendezvous: dict) -> "OutputStream":
        """Connect to what :meth:`OutputStreamServer.open` returned and check the
        worker's proof.

        Raises:
            OutputStreamError: the connection or the handshake failed.
        """
        token = bytes.fromhex(rendezvous["token"])
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(rendezvous["host"], rendezvous["port"]),
                CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            raise OutputStreamError(f"cannot connect to the worker's output stream: "
                                    f"{exc!r}") from exc
        stream = cls(reader, writer)
        stream.takes_requests = bool(rendezvous.get("requests"))
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            writer.write(token)
            proof = _proof(token)
            answer = await asyncio.wait_for(reader.readexactly(len(proof) + _LEN),
                                            HANDSHAKE_TIMEOUT_S)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            stream.close()
            raise OutputStreamError(f"output stream handshake failed: {exc!r}") from exc
        if not hmac.compare_digest(answer[:len(proof)], proof):
            stream.close()
            raise OutputStreamError("output stream handshake failed: wrong proof")
        stream.frames_before = int.from_bytes(answer[len(proof):], "little")
        return stream

    async def read(self, timeout_s: float) -> list[StepOutput | AddResult] | None:
        """The next frame's step outputs and answers (an empty list is a heartbeat); None if
        nothing came within ``timeout_s`` seconds (the stream stays usable).

        Raises:
            OutputStreamError: the worker closed the stream or cut a frame short.
        """
        try:
            head = await asyncio.wait_for(self._reader.readexactly(_LEN), timeout_s)
        except asyncio.TimeoutError:
            return None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise OutputStreamError(f"the worker closed its output stream: {exc!r}") from exc
        try:
            payload = await self._reader.readexactly(int.from_bytes(head, "little"))
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise OutputStreamError(f"output stream frame cut short: {exc!r}") from exc
        return pickle.loads(payload)

    def send(self, request: WorkerRequest) -> bool:
        """Write ``request`` to the worker (without waiting: the connection's buffer
        takes it); whether it was written (False once the connection is closing).
        Its answer comes in a later frame from a worker built with ``on_request``;
        nothing from one without."""
        if self._writer.is_closing():
            return False
        payload = pickle.dumps(request, protocol=5)
        self._writer.write(len(payload).to_bytes(_LEN, "little") + payload)
        return True

    def close(self) -> None:
        self._writer.close()
