"""``tandem serve`` stops promptly under load: SIGINT with 8 long streams in flight,
and more SIGINTs while it stops (an impatient Ctrl-C) change nothing.

The real console script in a subprocess (default deployment: 1 prefill + 1 decode
worker, its own embedded Ray and redis-server, float32). The bound is what
``TandemServer.stop`` promises: requests in flight ended (at most 2 s for the front
ends to say so), the gRPC server's 2 s grace, then every worker asked to shut down at
once for at most 5 s before it is killed, then Redis; a generous margin is added for
a busy machine (Ray's own shutdown). Every stream is told: gRPC ``UNAVAILABLE``
"the server is shutting down", HTTP an error frame then ``data: [DONE]`` (not a cut
connection); and no process the server started may outlive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil

from tests.serving.conftest import greedy

TANDEM = Path(sys.executable).parent / "tandem"
EXIT_BOUND_S = 20.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()[:3]
    except psutil.NoSuchProcess:
        return []


class _HttpStream(threading.Thread):
    """A streaming ``/v1/completions`` request; keeps the SSE lines it received."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.lines, self.ended = port, [], threading.Event()

    def run(self) -> None:
        import http.client
        import json

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps(
                {"prompt": "Tell me a long story.", "max_tokens": 512, "temperature": 0,
                 "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            while (line := resp.readline()):
                if line.strip():
                    self.lines.append(line.decode().strip())
        except Exception as exc:          # a cut connection: recorded, asserted below
            self.lines.append(f"EXCEPTION {exc!r}")
        finally:
            conn.close()
            self.ended.set()


class _Stream(threading.Thread):
    def __init__(self, address: str, prompt: str):
        super().__init__(daemon=True)
        self.address, self.prompt = address, prompt
        self.tokens, self.code, self.details, self.ended = 0, None, None, threading.Event()

    def run(self) -> None:
        from tandem.v1 import tandem_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.address) as channel:
            try:
                for resp in pb_grpc.TandemStub(channel).Generate(greedy(self.prompt, 512),
                                                                 timeout=300):
                    self.tokens += len(resp.token_ids)
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code, self.details = exc.code(), exc.details()
            finally:
                self.ended.set()


def test_sigint_under_load_exits_within_the_bound():
    port, http_port = _free_port(), _free_port()
    proc = subprocess.Popen(
        [str(TANDEM), "serve", "--dtype", "float32", "--num-blocks", "512", "--port", str(port),
         "--http-port", str(http_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
        env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("tandem: serving"):
                break
            assert time.monotonic() < deadline, "".join(lines[-20:])
        else:
            raise AssertionError("tandem serve exited before serving:\n" + "".join(lines[-40:]))
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        drain.start()
        started = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert started, "the server started no process of its own"
        streams = [_Stream(f"127.0.0.1:{port}", f"Tell me a long story number {i}.")
                   for i in range(7)]
        web = _HttpStream(http_port)
        for s in [*streams, web]:
            s.start()
        t_wait = time.monotonic() + 120
        while not (all(s.tokens >= 4 for s in streams) and len(web.lines) >= 4):
            assert time.monotonic() < t_wait, ([s.tokens for s in streams], web.lines)
            time.sleep(0.05)
        assert not any(s.ended.is_set() for s in [*streams, web])      # all 8 in flight

        t_signal = time.monotonic()
        proc.send_signal(signal.SIGINT)
        exited = threading.Event()

        def impatient_user():       # Ctrl-C again and again while it shuts down
            while not exited.wait(0.5):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
        again = threading.Thread(target=impatient_user, daemon=True)
        again.start()
        try:
            rc = proc.wait(timeout=60)
        finally:
            exited.set()
            again.join()
        took = time.monotonic() - t_signal
        print(f"\ntandem serve exited {took:.1f} s after SIGINT with 8 streams in flight")
        drain.join(15)      # its last lines may still be in the pipe
        assert not drain.is_alive(), "the server's output did not end with it"
        # The later Ctrl-Cs neither cut the bounded stop short nor raise mid-cleanup.
        assert "Traceback" not in "".join(lines), "".join(lines)[-3000:]
        assert "KeyboardInterrupt" not in "".join(lines), "".join(lines)[-3000:]
        assert rc == 0, "".join(lines[-40:])
        assert took < EXIT_BOUND_S, took
        assert "tandem: shutting down" in "".join(lines)
        assert "tandem: still shutting down" in "".join(lines)
        for s in streams:           # every client is told, none left waiting or cut off
            assert s.ended.wait(10), s.prompt
            assert (s.code, s.details) == (grpc.StatusCode.UNAVAILABLE,
                                           "the server is shutting down; retry the request")
        assert web.ended.wait(10)
        assert web.lines[-1] == "data: [DONE]", web.lines[-3:]
        assert web.lines[-2].startswith('data: {"error"') and "shutting down" in web.lines[-2]
        # Nothing the server started outlives it (workers, raylet, redis-server).
        survivors = [pid for pid in started if _alive(pid)]
        t_gone = time.monotonic() + 15
        while survivors and time.monotonic() < t_gone:
            time.sleep(0.2)
            survivors = [pid for pid in survivors if _alive(pid)]
        assert not survivors, [_cmdline(pid) for pid in survivors]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
