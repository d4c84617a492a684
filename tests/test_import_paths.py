"""No top-level folder of the checkout shadows an installed distribution, however
Python is started from the checkout root.

The design fixes generic top-level folder names (``kernels/``, ``proto/``,
``engine/``, ...); pyproject.toml installs them as ``tandem.*``. A process whose
``sys.path`` holds the checkout root (``python -c`` / ``python -m`` from the root,
pytest's rootdir insertion, a Ray worker of such a driver) used to import our
``kernels/`` for Hugging Face's ``kernels`` package, which transformers 5 imports
(``cannot import name 'CUDAProperties' from 'kernels'``). The folders now have no
``__init__.py`` at their top: a namespace portion always loses to an installed
regular package, wherever it stands on ``sys.path`` (docs/architecture.md,
"Import names").
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.import_probe import ROOT, probe

PYPROJECT = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())


def _top_level_folders() -> set[str]:
    package_dir = PYPROJECT["tool"]["setuptools"]["package-dir"]
    return {pathlib.PurePosixPath(path).parts[0] for path in package_dir.values()}


def _ours(origin: str | None, folder: str) -> bool:
    """Whether a module file comes from the checkout's own top-level ``folder`` (the
    venv may live inside the checkout: only the folder itself counts)."""
    return origin is not None and origin.startswith(os.path.join(ROOT, folder) + os.sep)


def _check_probe(result: dict) -> None:
    assert result["root_on_path"], "the checkout root was not on sys.path: nothing was probed"
    assert not _ours(result["kernels"], "kernels"), result["kernels"]
    assert not _ours(result["proto"], "proto"), result["proto"]
    assert result["tokens"] in (None, [28120, 905])   # "hello world", the default model's BPE


def _run_probe(args: list[str], tmp_path, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path), **(extra_env or {})}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# Plugins the in-process check has no use for: their imports (hypothesis,
# schemathesis and what they pull in) were about 1.5 s of CPU in each run. Without
# them the check is, if anything, stricter: fewer modules are imported before it
# looks the names up.
_UNUSED_PLUGINS = ("schemathesis", "hypothesispytest", "anyio")


def _run_pytest(mode: str, tmp_path) -> subprocess.CompletedProcess:
    """A pytest run of this file's in-process check under import mode ``mode``."""
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         *(arg for name in _UNUSED_PLUGINS for arg in ("-p", f"no:{name}")),
         f"--import-mode={mode}", "tests/test_import_paths.py::test_installed_package_wins_with_the_root_first_on_sys_path"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


PYTHON_C = "import json; from tests.import_probe import probe; print(json.dumps(probe()))"

RAY_DRIVER = """
import json, os, ray
from tests.import_probe import probe
ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024 * 1024,
         runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
try:
    print(json.dumps(ray.get(ray.remote(probe).remote(), timeout=240)))
finally:
    ray.shutdown()
"""

# The subprocess of each test below, by name: ``job(cache_dir) -> result``.
JOBS = {
    "python-c": lambda cache: _run_probe(["-c", PYTHON_C], cache),
    "python-m": lambda cache: _run_probe(["-m", "tests.import_probe"], cache),
    **{f"pytest-{mode}": (lambda cache, mode=mode: _run_pytest(mode, cache))
       for mode in ("prepend", "append", "importlib")},
    "ray-worker": lambda cache: _run_probe(["-c", RAY_DRIVER], cache, {"RAY_AUTH_MODE": "disabled"}),
}


def _job_of(item) -> str | None:
    name = getattr(item, "originalname", item.name)
    if name == "test_pytest_import_modes":
        return f"pytest-{item.callspec.params['mode']}"
    return {"test_python_c_from_the_root_with_an_empty_cache": "python-c",
            "test_python_m_from_the_root": "python-m",
            "test_ray_worker_of_a_driver_in_the_root": "ray-worker"}.get(name)


class _Jobs:
    """Each job in a fresh, empty ``TANDEM_CACHE_DIR`` of its own, run on a pool of two
    threads; ``result(name)`` waits for a job (starting it if it has not been) and
    gives ``(result, cache_dir)``, re-raising what the job raised."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, tuple[Future, pathlib.Path]] = {}

    def start(self, name: str) -> None:
        if name not in self.futures:
            cache = self.tmp_path_factory.mktemp(f"cache-{name}")
            self.futures[name] = (self.pool.submit(JOBS[name], cache), cache)

    def result(self, name: str):
        self.start(name)
        future, cache = self.futures[name]
        return future.result(), cache


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The subprocesses of this module's selected tests, all queued when the first
    of those tests needs one: they are independent processes, each mostly CPU spent
    importing, so two run at once, each with a core of a 2-core host to itself (the
    tests assert on each one's own output, as when each test ran its subprocess
    itself). The longest (Ray) goes first. Nothing is shared between the jobs: each
    has its own empty ``TANDEM_CACHE_DIR``, as each test had its own ``tmp_path``."""
    jobs = _Jobs(tmp_path_factory)
    selected = {_job_of(item) for item in request.session.items if item.module is request.module}
    for name in sorted(JOBS, key=lambda n: n != "ray-worker"):
        if name in selected:
            jobs.start(name)
    try:
        yield jobs
    finally:
        jobs.pool.shutdown(wait=True, cancel_futures=True)


def test_mapped_top_level_folders_are_not_regular_packages():
    folders = _top_level_folders()
    assert {"kernels", "engine", "proto", "router", "kvtransfer", "control"} <= folders
    regular = sorted(f for f in folders if (pathlib.Path(ROOT) / f / "__init__.py").exists())
    assert regular == [], f"{regular}: an __init__.py here shadows an installed package of that name"


def test_tandem_packages_import_as_namespace_portions():
    import tandem.kernels.cpu.ops  # noqa: F401
    import tandem.control.state  # noqa: F401
    import tandem.engine.config  # noqa: F401
    import tandem.kvtransfer.layout  # noqa: F401
    import tandem.v1.tandem_pb2  # noqa: F401

    for folder, package in (("kernels", "tandem.kernels"), ("engine", "tandem.engine"),
                            ("control", "tandem.control")):
        paths = list(sys.modules[package].__path__)
        assert os.path.join(ROOT, folder) in paths, (package, paths)


def test_installed_package_wins_with_the_root_first_on_sys_path(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    importlib.invalidate_caches()
    assert sys.path[0] == ROOT
    for name in _top_level_folders():
        spec = importlib.util.find_spec(name)
        # Either nothing of that name is installed (then our folder is an inert
        # namespace portion) or the installed distribution is what imports.
        assert spec is None or not _ours(spec.origin, name), (name, spec)
    _check_probe(probe(convert_tokenizer=False))


def test_python_c_from_the_root_with_an_empty_cache(jobs):
    """The issue's failing path from scratch: ``python -c`` in the checkout root,
    converting the GGUF tokenizer into an empty ``TANDEM_CACHE_DIR``."""
    result, cache = jobs.result("python-c")
    _check_probe(result)
    assert result["tokens"] == [28120, 905]
    assert any(cache.iterdir()), "the tokenizer conversion wrote nothing into the empty cache"


def test_python_m_from_the_root(jobs):
    _check_probe(jobs.result("python-m")[0])


@pytest.mark.parametrize("mode", ["prepend", "append", "importlib"])
def test_pytest_import_modes(mode, jobs):
    """A pytest run of this file's in-process check under each import mode."""
    out, _ = jobs.result(f"pytest-{mode}")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.slow
def test_ray_worker_of_a_driver_in_the_root(jobs):
    """Ray hands the driver's working directory to its workers' ``sys.path``."""
    result, _ = jobs.result("ray-worker")
    _check_probe(result)
    assert result["tokens"] == [28120, 905]
