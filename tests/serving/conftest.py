"""A real cluster for the serving tests: Ray actors, gRPC over loopback, the real model."""

from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="package")
def ray_session():
    """One embedded Ray for the serving tests, shut down when they are done (other
    tests start clusters of their own in subprocesses)."""
    import ray

    from tandem.router.launcher import init_ray

    init_ray()
    yield
    ray.shutdown()


def serve_config(mode: str, num_blocks: int = 640, **kw):
    from tandem.engine.config import CacheConfig, EngineConfig
    from tandem.router.launcher import ServeConfig

    return ServeConfig(mode=mode, port=0, metrics_port=0, **kw, engine=EngineConfig(
        dtype="float32", cache=CacheConfig(num_blocks=num_blocks)))


class Client:
    """Synchronous gRPC client plus the server's workers, for assertions."""

    def __init__(self, server):
        import grpc

        from tandem.v1 import tandem_pb2_grpc as pb_grpc

        self.server = server
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.TandemStub(self.channel)

    def generate(self, req, timeout=120):
        return list(self.stub.Generate(req, timeout=timeout))

    def workers(self):
        c = self.server.server.cluster
        return c.prefill + c.decode

    def block_counts(self) -> dict:
        return {w.worker_id: self.server.run(w.actor.check_invariants.remote())
                for w in self.workers()}

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Wait until every worker has no running/waiting/reserved request and every
        block is free again (cached blocks count as free: they are evictable)."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.block_counts()
            idle = all(c["num_running"] == 0 and c["num_waiting"] == 0
                       and c.get("num_reserved", 0) == 0 and c["num_swapped"] == 0
                       and c["num_free_blocks"] == c["num_blocks"]
                       for c in counts.values())
            if idle or time.monotonic() > deadline:
                return counts
            time.sleep(0.1)

    def metrics_text(self) -> str:
        import urllib.request

        port = self.server.server.metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    def close(self):
        self.channel.close()


def start_server(config):
    from tandem.router.launcher import BackgroundServer

    return BackgroundServer(config)


def serving(config):
    """Fixture body: a started server's :class:`Client`, stopped afterwards."""
    server = start_server(config)
    client = Client(server)
    yield client
    client.close()
    server.stop()


def greedy(prompt: str, n: int):
    """A streaming greedy request for exactly ``n`` tokens."""
    from tandem.v1 import tandem_pb2 as pb

    return pb.GenerateRequest(prompt=prompt, stream=True, sampling=pb.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def disagg(ray_session):
    server = start_server(serve_config("disaggregated"))
    client = Client(server)
    yield client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def coloc(ray_session):
    server = start_server(serve_config("colocated"))
    client = Client(server)
    yield client
    client.close()
    server.stop()


def cancel_after(call, seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, call.cancel)
    t.start()
    return t
