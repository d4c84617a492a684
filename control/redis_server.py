"""A throwaway redis-server for one process: ``tandem serve`` without ``--redis-url``, and tests.

:class:`EmbeddedRedis` runs ``redis-server`` as a child process on a free
loopback port, with persistence off (``--save ""``, ``--appendonly no``): the
cluster state it holds lives as long as the process, which is what a single-host
cluster needs and what the fault tests want (:meth:`EmbeddedRedis.restart` comes
back empty, like a Redis that lost its memory).

The child dies with its parent: on Linux it asks the kernel for ``SIGKILL`` when
the parent exits (``PR_SET_PDEATHSIG``), and everywhere an ``atexit`` hook stops it.

Supervised (:meth:`EmbeddedRedis.supervise`, what ``tandem serve`` does), a server
that dies on its own (a crash, ``kill -9``, the OOM killer) is started again on the
same address and port, empty; the workers and routers then re-assert the cluster
state as after a flush (see docs/control_plane.md).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import logging
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import redis

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOP_WAIT_S = 5.0
_LOG_TAIL_CHARS = 2000


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RedisRestart:
    """One restart of a supervised server that died on its own.

    Attributes:
        old_pid, new_pid: the process that died and the one started in its place.
        exit_code: how the old one ended (``-9``: killed by SIGKILL).
        down_s: seconds from noticing the death to the new server answering.
        attempts: starts it took (a failed start is retried with backoff).
    """

    old_pid: int
    new_pid: int
    exit_code: int | None
    down_s: float
    attempts: int


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. The signal is tied to the thread that
    # forked; start the server from a thread that lives as long as it should.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # A process group of its own: the terminal's Ctrl-C (SIGINT to the foreground
    # group) goes to `tandem serve`, which stops the server in order, and no longer
    # also kills it under its supervisor (which restarted it, empty, mid-shutdown).
    os.setpgrp()


class EmbeddedRedis:
    """A redis-server child process on a free loopback port, no persistence.

    Args:
        host: the address it binds (loopback by default).
        port: the port; ``None`` picks a free one now, and :meth:`start` picks
            another if that one is taken by the time the server binds it.
        executable: the redis-server binary, a name on ``PATH`` or a path.

    Attributes:
        port: the port it listens on (kept across :meth:`restart` and supervised
            restarts).
        restarts: every :class:`RedisRestart` the supervision made, in order.

    Use as a context manager (``with EmbeddedRedis() as r:``) to start and stop it.
    Thread-safe: the supervision thread and callers of :meth:`stop` / :meth:`restart`
    take turns on the child process.
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
        # Guards every change of the child process (start, stop, restart, the
        # supervision's restart). Reentrant: restart() calls stop() and start().
        self._lock = threading.RLock()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.restarts: list[RedisRestart] = []

    @property
    def url(self) -> str:
        """``redis://HOST:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        """The child process exists and has not exited."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The child's process id (None when none was started or it was stopped)."""
        proc = self._proc
        return proc.pid if proc is not None else None

    @property
    def supervised(self) -> bool:
        """:meth:`supervise` is watching the server."""
        return self._watcher is not None

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
        with self._lock:
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> EmbeddedRedis:
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
                    self._terminate()
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
        """Stop the server (and its supervision): SIGTERM, then SIGKILL if it has not
        exited after 5 s. Idempotent."""
        self._unsupervise()
        with self._lock:
            self._terminate()

    def _terminate(self) -> None:
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
        """Kill the server with SIGKILL, as a crash would, and end its supervision (no
        restart; to test the supervision, signal :attr:`pid` instead). Idempotent."""
        self._unsupervise()
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            self._cleanup()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Stop and start again on the same port, with an empty dataset. A supervised
        server stays supervised (this restart is not counted in :attr:`restarts`).

        Raises:
            RuntimeError: as :meth:`start`.
        """
        with self._lock:
            self._terminate()
            self._start_same_port(timeout_s)

    def _start_same_port(self, timeout_s: float) -> None:
        given, self._port_given = self._port_given, True    # clients expect the same port
        try:
            self._start(timeout_s)
        finally:
            self._port_given = given

    # -- supervision -----------------------------------------------------------------------
    def supervise(self, on_restart: Callable[[RedisRestart], None] | None = None,
                  interval_s: float = 0.1, max_backoff_s: float = 5.0) -> EmbeddedRedis:
        """Watch the server on a daemon thread and start it again whenever it dies on its
        own, on the same address and port, with an empty dataset.

        A server this object stops (:meth:`stop`, :meth:`kill`) is not restarted; one
        that exits for any other reason is, within ``interval_s`` of exiting. A failed
        start (the port taken meanwhile, say) is retried with backoff from
        ``interval_s`` doubling to ``max_backoff_s``. Each restart is appended to
        :attr:`restarts` and passed to ``on_restart`` (called on the watching thread:
        it must return quickly). A no-op when already supervised.

        The watching thread starts the new server: on Linux the child dies with the
        thread that started it (``PR_SET_PDEATHSIG``), and this thread lives until
        :meth:`stop`.

        Args:
            on_restart: called after each restart.
            interval_s: seconds between checks.
            max_backoff_s: the longest wait between failed starts, in seconds.

        Returns:
            ``self``.

        Raises:
            RuntimeError: the server is not running.
        """
        with self._lock:
            if self._watcher is not None:
                return self
            if not self.running:
                raise RuntimeError(f"{self!r}: start it before supervising it")
            self._watch_stop.clear()
            self._watcher = threading.Thread(
                target=self._watch, args=(on_restart, interval_s, max_backoff_s),
                name=f"redis-supervisor-{self.port}", daemon=True)
            self._watcher.start()
        return self

    def _unsupervise(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        self._watch_stop.set()
        if watcher is not threading.current_thread():
            watcher.join()

    def _watch(self, on_restart, interval_s: float, max_backoff_s: float) -> None:
        while not self._watch_stop.wait(interval_s):
            with self._lock:
                proc = self._proc
                # None: stopped on purpose (stop/kill), or a restart is under way.
                if proc is None or proc.poll() is None:
                    continue
                old_pid, code = proc.pid, proc.returncode
                tail = self._log_tail()
                self._proc = None
                self._cleanup()
            logger.error("redis-server (pid %d, port %d) exited with code %s; restarting it "
                         "on the same port. Its last output:\n%s", old_pid, self.port, code, tail)
            rec = self._restart_after_death(old_pid, code, interval_s, max_backoff_s)
            if rec is None:
                return                        # stopped while restarting
            self.restarts.append(rec)
            logger.warning("redis-server restarted on port %d (pid %d) after %.2f s, empty: "
                           "workers and routers re-assert the cluster state", self.port,
                           rec.new_pid, rec.down_s)
            if on_restart is not None:
                try:
                    on_restart(rec)
                except Exception:                    # the server is back either way
                    logger.exception("redis-server restart callback failed")

    def _restart_after_death(self, old_pid: int, code: int | None, interval_s: float,
                             max_backoff_s: float) -> RedisRestart | None:
        t0, attempts, backoff = time.monotonic(), 0, interval_s
        while not self._watch_stop.is_set():
            attempts += 1
            with self._lock:
                if self._watch_stop.is_set():
                    return None
                try:
                    self._start_same_port(10.0)
                    return RedisRestart(old_pid, self._proc.pid, code,
                                        time.monotonic() - t0, attempts)
                except RuntimeError as exc:
                    logger.error("restarting redis-server on port %d failed (attempt %d): %s; "
                                 "retrying in %.1f s", self.port, attempts, exc, backoff)
            self._watch_stop.wait(backoff)
            backoff = min(2 * backoff, max_backoff_s)
        return None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedRedis({self.url}, running={self.running}, pid={self.pid})"
