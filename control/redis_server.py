"""A throwaway redis-server for one process: ``tandem serve`` without ``--redis-url``, and tests.

:class:`EmbeddedRedis` runs ``redis-server`` as a child process on a free
loopback port, with persistence off (``--save ""``, ``--appendonly no``): the
cluster state it holds lives as long as the process, which is what a single-host
cluster needs and what the fault tests want (:meth:`EmbeddedRedis.restart` comes
back empty, like a Redis that lost its memory).

The child dies with its parent: on Linux it asks the kernel for ``SIGKILL`` when
the parent exits (``PR_SET_PDEATHSIG``), and everywhere an ``atexit`` hook stops it.
"""

from __future__ import annotations

import atexit
import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis

_PR_SET_PDEATHSIG = 1
_STOP_WAIT_S = 5.0
_LOG_TAIL_CHARS = 2000


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. The signal is tied to the thread that
    # forked; start the server from a thread that lives as long as it should.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EmbeddedRedis:
    """A redis-server child process on a free loopback port, no persistence.

    Args:
        host: the address it binds (loopback by default).
        port: the port; ``None`` picks a free one now, and :meth:`start` picks
            another if that one is taken by the time the server binds it.
        executable: the redis-server binary, a name on ``PATH`` or a path.

    Attributes:
        port: the port it listens on (kept across :meth:`restart`).

    Use as a context manager (``with EmbeddedRedis() as r:``) to start and stop it.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None,
                 executable: str = "redis-server") -> None:
        self.host = host
        self._port_given = port is not None
        self.port: int = port if port is not None else _free_port(host)
        self.executable = executable
        self._proc: subprocess.Popen | None = None
        self._log: tempfile._TemporaryFileWrapper | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._atexit_registered = False

    @property
    def url(self) -> str:
        """``redis://HOST:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        """The child process exists and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers as itself. A no-op when it runs.

        "As itself": INFO reports the child's pid, so another server already on
        the port is never mistaken for it.

        Args:
            timeout_s: how long to wait for its first answer, in seconds.

        Returns:
            ``self``.

        Raises:
            RuntimeError: the executable is not found (the message says how to
                install it), or the server exited or did not answer within
                ``timeout_s`` (the message holds the tail of its output).
        """
        if self.running:
            return self
        path = shutil.which(self.executable)
        if path is None:
            raise RuntimeError(
                f"{self.executable!r} not found on PATH: install Redis (Debian/Ubuntu: "
                f"apt-get install redis-server; macOS: brew install redis) or pass --redis-url")
        # A picked port can be taken between picking and binding: pick again (a port
        # the caller named is never changed).
        for attempt in range(3):
            try:
                self._spawn(path, timeout_s)
                break
            except RuntimeError as e:
                if self._port_given or attempt == 2 or "Address already in use" not in str(e):
                    raise
                self.port = _free_port(self.host)
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        return self

    def _spawn(self, path: str, timeout_s: float) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-redis-")
        self._log = tempfile.NamedTemporaryFile(mode="w+b", dir=self._dir.name, suffix=".log")
        args = [path, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
                "--logfile", ""]
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            # Redis's protected mode refuses every non-loopback client of a server
            # without a password, even on this host: a server on the node's address
            # is there for the other nodes (it has no auth; see --redis-url).
            args += ["--protected-mode", "no"]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            cwd=self._dir.name, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0,
                             socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._proc.poll() is not None:
                    tail = self._log_tail()
                    self._cleanup()
                    raise RuntimeError(f"{path} exited with code {self._proc.returncode} on "
                                       f"port {self.port}:\n{tail}")
                try:
                    # Another server on the port would answer too: check it is ours.
                    if client.info("server")["process_id"] == self._proc.pid:
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    tail = self._log_tail()
                    self.stop()
                    raise RuntimeError(f"{path} did not answer PING on port {self.port} within "
                                       f"{timeout_s} s:\n{tail}")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-_LOG_TAIL_CHARS:]

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def stop(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it has not exited after 5 s. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._cleanup()

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would (no restart). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._cleanup()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Stop and start again on the same port, with an empty dataset.

        Raises:
            RuntimeError: as :meth:`start`.
        """
        self.stop()
        given, self._port_given = self._port_given, True    # clients expect the same port
        try:
            self.start(timeout_s)
        finally:
            self._port_given = given

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc is not None else None
        return f"EmbeddedRedis({self.url}, running={self.running}, pid={pid})"
