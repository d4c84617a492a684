"""EmbeddedRedis: starts on a free port, restarts empty on the same port, dies cleanly."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from tandem.control.redis_server import EmbeddedRedis


def test_start_serves_and_stop_is_idempotent(private_redis):
    server = private_redis()
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = redis.Redis.from_url(server.url, decode_responses=True)
    assert client.ping()
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    client.close()
    server.stop()
    assert not server.running
    server.stop()


def test_the_server_is_out_of_reach_of_a_terminal_ctrl_c(private_redis):
    """Its own process group: a Ctrl-C (SIGINT to the terminal's foreground group)
    reaches ``tandem serve``, which stops the server in order, not the server itself
    (which the supervisor then restarted, empty, in the middle of the shutdown)."""
    import os

    server = private_redis()
    assert os.getpgid(server.pid) == server.pid != os.getpgid(0)
    server.stop()


def test_restart_keeps_the_port_and_empties_the_data(private_redis):
    server = private_redis()
    port = server.port
    client = redis.Redis.from_url(server.url)
    client.set("k", "v")
    server.restart()
    assert server.port == port
    assert client.get("k") is None
    client.close()


def test_kill_stops_it_at_once(private_redis):
    server = private_redis()
    server.kill()
    assert not server.running
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()
    server.kill()


def test_a_missing_executable_says_how_to_install_it():
    with pytest.raises(RuntimeError, match="apt-get install redis-server"):
        EmbeddedRedis(executable="no-such-redis-server-binary").start()


def test_a_failed_start_shows_the_servers_output(tmp_path):
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: bad config' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*FATAL: bad config"):
        EmbeddedRedis(executable=str(fake)).start(timeout_s=5)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_the_server_dies_with_its_parent(tmp_path):
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import os
        from tandem.control.redis_server import EmbeddedRedis
        server = EmbeddedRedis().start()
        open({str(pid_file)!r}, "w").write(str(server._proc.pid))
        os._exit(0)     # no atexit hooks: only the kernel's parent-death signal is left
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    pid = int(pid_file.read_text())
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:        # reaped by init, or a zombie until then
            if f.read().split(")")[1].split()[0] == "Z":
                return
        time.sleep(0.02)
    pytest.fail(f"redis-server {pid} outlived its parent")


def test_a_named_port_in_use_fails_with_the_reason(private_redis):
    taken = private_redis()
    with pytest.raises(RuntimeError, match="Address already in use"):
        EmbeddedRedis(port=taken.port).start()
    assert redis.Redis.from_url(taken.url).ping()          # the first server is untouched
