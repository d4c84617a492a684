"""Generate the Python gRPC stubs from ``proto/tandem/v1/*.proto``, or check them.

Usage::

    python -m tandem.router.protogen          # rewrite the stubs in proto/tandem/v1/
    python -m tandem.router.protogen --check  # exit 1 if the committed stubs are stale

The stubs are committed so that the server runs without ``grpcio-tools``; the
check (run by the tests) proves they still match their ``.proto`` sources.
Generated files embed the protoc version of the installed ``grpcio-tools``, so
regenerate with the project's pinned environment.

Stubs are compiled with ``-I proto``: a file at ``proto/tandem/v1/x.proto`` is
imported as ``tandem.v1.x_pb2``, which the package mapping in ``pyproject.toml``
points at ``proto/tandem/v1/``.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

# router/protogen.py -> the repository root, which holds proto/.
DEFAULT_PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
PACKAGE_DIR = Path("tandem") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files(proto_root: Path = DEFAULT_PROTO_ROOT) -> list[Path]:
    """The ``.proto`` sources under ``proto_root/tandem/v1``, relative to ``proto_root``."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE_DIR).glob("*.proto"))


def generated_files(directory: Path) -> list[Path]:
    """Stub files found in ``directory/tandem/v1``, relative to ``directory``."""
    found = [p for p in (directory / PACKAGE_DIR).iterdir()
             if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)]
    return sorted(p.relative_to(directory) for p in found)


def generate(out_root: Path, proto_root: Path = DEFAULT_PROTO_ROOT) -> list[Path]:
    """Compile every ``.proto`` under ``proto_root`` into ``out_root/tandem/v1``.

    Returns:
        The written stub paths, relative to ``out_root``.

    Raises:
        FileNotFoundError: ``proto_root/tandem/v1`` holds no ``.proto`` file.
        RuntimeError: protoc reported an error (its message is on stderr).
    """
    from grpc_tools import protoc  # build-time tool: only this module needs it

    sources = proto_files(proto_root)
    if not sources:
        raise FileNotFoundError(f"no .proto files under {proto_root / PACKAGE_DIR}")
    # grpc_tools ships the well-known types (google/protobuf/*.proto).
    well_known = Path(protoc.__file__).parent / "_proto"
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}",
            f"--python_out={out_root}", f"--grpc_python_out={out_root}",
            f"--pyi_out={out_root}"]
    # protoc names each source relative to its -I root ("tandem/v1/x.proto"), so
    # no path of this machine ends up in the stubs.
    rc = protoc.main(args + [str(proto_root / s) for s in sources])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return generated_files(out_root)


def stale_files(proto_root: Path = DEFAULT_PROTO_ROOT) -> list[str]:
    """Stub files under ``proto_root/tandem/v1`` that differ from a fresh generation.

    Returns:
        Relative paths, each followed by why: ``(differs)``, ``(missing)``, or
        ``(no .proto source)`` for a committed stub whose source is gone. Empty
        when everything is current.

    Raises:
        FileNotFoundError, RuntimeError: as :func:`generate`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), proto_root)
        committed = generated_files(proto_root)
        problems = []
        for rel in fresh:
            if not (proto_root / rel).is_file():
                problems.append(f"{rel} (missing)")
            elif not filecmp.cmp(Path(tmp) / rel, proto_root / rel, shallow=False):
                problems.append(f"{rel} (differs)")
        problems += [f"{rel} (no .proto source)" for rel in committed if rel not in fresh]
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m tandem.router.protogen",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temporary folder and fail if anything differs")
    parser.add_argument("--proto-root", type=Path, default=DEFAULT_PROTO_ROOT,
                        help="folder holding tandem/v1/*.proto (default: the repository's proto/)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_files(args.proto_root)
        for p in problems:
            print(f"stale: {p}", file=sys.stderr)
        if problems:
            print("run `python -m tandem.router.protogen` and commit the result", file=sys.stderr)
            return 1
        return 0
    for rel in generate(args.proto_root, args.proto_root):
        print(f"wrote {args.proto_root / rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
