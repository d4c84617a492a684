"""What the driver can check is checked before any worker or Ray starts: the real
``tandem`` console script, in a subprocess, on a model path that holds no model
Tandem loads, a flag combination the engine refuses, or an unreachable Redis.
Each answers one ``error: ...`` line on stderr naming what is wrong, no traceback,
nothing on stdout; exit code 2 for a usage error (argparse's convention), 1 for
an unreachable cluster state."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

TANDEM = Path(sys.executable).parent / "tandem"
RAY_STARTED = "Started a local Ray instance"
BATCH_INVARIANT_FP16 = ("serve", "--batch-invariant", "--dtype", "float16")


def _run_now(*args: str, timeout_s: float = 60) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([str(TANDEM), *args], capture_output=True, text=True, timeout=timeout_s,
                       cwd="/", env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


# Commands started ahead of their test (see `_start_ahead`), by argument tuple.
_AHEAD: dict[tuple[str, ...], Future] = {}


def run(*args: str) -> tuple[int, str, str, float]:
    """The console script's exit code, stdout, stderr and run time for ``args``: the
    run that `_start_ahead` began for exactly these arguments, or a run now."""
    if not TANDEM.exists():
        pytest.skip(f"no console script at {TANDEM} (pip install -e .)")
    ahead = _AHEAD.pop(args, None)
    return ahead.result() if ahead is not None else _run_now(*args)


def _ahead_args(item) -> tuple[str, ...] | None:
    """The arguments a selected test of the slow kind (the driver imports the engine
    and reads the model's config before it refuses) will run the script with."""
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    name = getattr(item, "originalname", item.name)
    if name == "test_a_flag_combination_the_engine_refuses_is_a_usage_error":
        return BATCH_INVARIANT_FP16
    if name in ("test_a_serve_flag_combination_the_config_refuses_names_the_flags",
                "test_a_tensor_parallel_size_the_heads_cannot_split_names_its_flag"):
        return ("serve", *params["flags"])
    return None


@pytest.fixture(scope="module", autouse=True)
def _start_ahead(request):
    """Each run is a process of its own, and most of a slow one's time is CPU spent
    importing: the slow runs of this module's selected tests start here, two at a
    time (each with a core to itself on a 2-core host, as when it ran alone), and
    each test takes its own run's result (the same command, the same output, its
    own wall time). A test whose run was not started ahead runs it itself."""
    if not TANDEM.exists():
        yield
        return
    wanted = [a for item in request.session.items if item.module is request.module
              for a in [_ahead_args(item)] if a is not None]
    pool = ThreadPoolExecutor(max_workers=2)
    for args in dict.fromkeys(wanted):
        _AHEAD[args] = pool.submit(_run_now, *args)
    try:
        yield
    finally:
        _AHEAD.clear()
        pool.shutdown(wait=True, cancel_futures=True)


def assert_one_error_line(stderr: str, stdout: str, expected: str) -> None:
    lines = stderr.splitlines()
    assert lines == [expected], stderr
    assert "Traceback" not in stderr + stdout and RAY_STARTED not in stderr + stdout
    assert stdout == ""


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    (root / "no_config").mkdir()
    (root / "bad_config").mkdir()
    (root / "bad_config" / "config.json").write_text("{not json")
    (root / "fake.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    (root / "notes.txt").write_text("hello")
    return {name: str(root / name) for name in ("no_config", "bad_config", "fake.gguf",
                                                 "notes.txt")}


@pytest.mark.parametrize("command", [
    ["serve"], ["serve", "--mode", "colocated"], ["demo", "hello"], ["generate", "hello"],
    ["router", "--redis-url", "redis://127.0.0.1:1/0"], ["profile"]])
def test_a_missing_model_path_is_a_usage_error_before_anything_starts(command):
    code, out, err, took = run(*command, "--model", "/nonexistent/dir")
    assert code == 2, err
    assert_one_error_line(err, out, "error: --model: /nonexistent/dir: no such file or directory")
    assert took < 30                   # refused, not started (Ray alone takes seconds)


@pytest.mark.parametrize("name,why", [
    ("no_config", ": a directory without config.json (expected a Hugging Face checkpoint "
                  "directory or a .gguf file)"),
    ("fake.gguf", ": not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')"),
    ("notes.txt", ": not a .gguf file or a Hugging Face checkpoint directory"),
])
def test_a_path_without_a_loadable_model_is_named(paths, name, why):
    code, out, err, _ = run("serve", "--model", paths[name])
    assert code == 2, err
    assert_one_error_line(err, out, f"error: --model: {paths[name]}{why}")


def test_a_checkpoint_whose_config_is_not_json_is_named(paths):
    code, out, err, _ = run("generate", "hi", "--model", paths["bad_config"])
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith(f"error: --model: {paths['bad_config']}/config.json is not valid JSON (")
    assert_one_error_line(err, out, line)


def test_a_missing_draft_model_is_named():
    code, out, err, _ = run("serve", "--speculative-method", "draft_model",
                            "--speculative-draft-model", "/nonexistent/draft.gguf")
    assert code == 2, err
    assert_one_error_line(err, out, "error: --speculative-draft-model: /nonexistent/draft.gguf: "
                                    "no such file or directory")


def test_a_flag_combination_the_engine_refuses_is_a_usage_error():
    code, out, err, _ = run(*BATCH_INVARIANT_FP16)
    assert code == 2, err
    assert_one_error_line(err, out, "error: --batch-invariant: float32 or bfloat16, not 'float16'")


@pytest.mark.parametrize("flags,expected", [
    (["--lend-idle-cores", "--mode", "colocated"],
     "--lend-idle-cores: lends cores between prefill and decode workers; it needs "
     "--mode disaggregated"),
    (["--lend-idle-cores", "--cpu-affinity"],
     "--lend-idle-cores: the workers are not pinned while they lend cores; drop --cpu-affinity"),
    (["--lend-idle-cores", "--tensor-parallel-size", "2"],
     "--lend-idle-cores: needs --tensor-parallel-size 1 (got 2)"),
    (["--max-prefill-queue-tokens", "512", "--mode", "colocated"],
     "--max-prefill-queue-tokens: chooses between a prefill worker and the decode worker; it "
     "needs --mode disaggregated"),
    (["--max-prefill-queue-tokens", "0"], "--max-prefill-queue-tokens: must be at least 1, got 0"),
    (["--prefer-local-prefill", "--mode", "colocated"],
     "--prefer-local-prefill: chooses between a prefill worker and the decode worker; it "
     "needs --mode disaggregated")])
def test_a_serve_flag_combination_the_config_refuses_names_the_flags(flags, expected):
    # The config's own message names its fields; the command line's names the flags.
    code, out, err, took = run("serve", *flags)
    assert code == 2, err
    assert_one_error_line(err, out, f"error: {expected}")
    assert took < 30


@pytest.mark.parametrize("flags,flag", [
    (["--prefill-tensor-parallel-size", "4"], "--prefill-tensor-parallel-size"),
    (["--decode-tensor-parallel-size", "4"], "--decode-tensor-parallel-size"),
    (["--mode", "colocated", "--tensor-parallel-size", "4"], "--tensor-parallel-size")])
def test_a_tensor_parallel_size_the_heads_cannot_split_names_its_flag(flags, flag):
    # The default model: 9 query heads, 3 KV heads; 4 ranks cannot share them.
    code, out, err, took = run("serve", *flags)
    assert code == 2, err
    assert_one_error_line(err, out, f"error: {flag}: 4 ranks cannot share 3 KV heads and 9 "
                                    "query heads (with fewer KV heads than ranks, the ranks "
                                    "must be a multiple of the KV heads and divide the query "
                                    "heads); this model's heads split into 1, 2, 3, 9")
    assert took < 30


def test_a_client_of_a_running_server_does_not_check_a_model_it_never_loads():
    # --endpoint: the server's model counts; nothing answers on port 1, so the call
    # itself fails (exit 1), after the arguments were accepted.
    code, out, err, _ = run("generate", "--endpoint", "127.0.0.1:1", "--model",
                            "/nonexistent/dir", "hi")
    assert code == 1 and "--model" not in err and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("error: UNAVAILABLE: ")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command,what", [
    (["serve"], "tandem serve keeps the cluster state there"),
    (["router"], "a router joins the cluster through it"),
])
def test_an_unreachable_redis_is_named_before_ray_starts(command, what):
    port = _closed_port()
    code, out, err, _ = run(*command, "--redis-url", f"redis://127.0.0.1:{port}/0")
    assert code == 1, err
    [line] = err.splitlines()
    assert line.startswith(f"error: cluster state (Redis) unreachable at 127.0.0.1:{port}/0: "
                           f"{what} ("), line
    assert_one_error_line(err, out, line)


def test_every_flag_of_every_command_says_what_it_does():
    import argparse

    from tandem.router.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = {f"{name} {a.option_strings[-1]}" for name, p in sub.choices.items()
              for a in p._actions if a.option_strings and not a.help}
    assert not silent, sorted(silent)


@pytest.mark.parametrize("message,expected", [
    ("lend_idle_cores: it needs mode=disaggregated; drop cpu_affinity",
     "--lend-idle-cores: it needs --mode disaggregated; drop --cpu-affinity"),
    ("needs tensor_parallel_size 1 (got 2)", "needs --tensor-parallel-size 1 (got 2)"),
    # Plain words, paths and names that are no flag of the command stay as they are.
    ("the mode of /models/max_num_seqs/x.gguf: unknown_field", "the mode of "
     "/models/max_num_seqs/x.gguf: unknown_field")])
def test_a_config_error_names_the_flags_to_type(message, expected):
    from tandem.router.cli import _subcommand_parser, build_parser, with_flag_names

    assert with_flag_names(message, _subcommand_parser(build_parser(), "serve")) == expected
