"""Build and load the compiled CPU kernels (``csrc/*.cpp``, one shared library).

The sources are compiled once per machine with the system C++ compiler into a
shared library cached under ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``),
named by a hash of the sources, the flags, the compiler and the CPU's feature
flags, so an edit or a different CPU builds afresh. Concurrent processes (the
workers of one node) serialise the build with a file lock and publish the
library with an atomic rename. ``python -m tandem.kernels.cpu.build`` builds it
ahead of time (``make setup`` does).

OpenMP: torch ships ``libgomp.so.1``; the library links against the same soname,
so once torch is imported both share one OpenMP runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
# $TANDEM_CPU_MARCH (default ``native``) is gcc's -march: e.g. ``haswell`` builds the
# AVX2 + FMA tiers, ``x86-64`` the portable loops, on a machine that has more (a
# stand-in for another CPU's kernels when measuring or testing them).
FLAGS = ["-O3", f"-march={os.environ.get('TANDEM_CPU_MARCH', 'native')}", "-fopenmp",
         "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC"]


class CpuKernelsUnavailable(RuntimeError):
    """No C++ compiler, or the kernels failed to compile on this machine."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tandem")
    return Path(root) / "cpu_kernels"


def library_path(compiler: str) -> Path:
    h = hashlib.sha256()
    parts = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(FLAGS).encode(), compiler.encode(), _cpu_flags().encode()):
        h.update(part)
    return cache_dir() / f"tandem_cpu_ops_{h.hexdigest()[:16]}.so"


def find_compiler() -> str:
    """``$CXX``, else ``c++`` or ``g++`` on the PATH.

    Raises:
        CpuKernelsUnavailable: none found.
    """
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise CpuKernelsUnavailable("no C++ compiler found (set CXX, or install g++)")
    return compiler


def build(verbose: bool = False) -> Path:
    """Compile the library if this machine has no current build; return its path.

    Raises:
        CpuKernelsUnavailable: no compiler, the build failed, or the cache
            directory cannot be written.
    """
    compiler = find_compiler()
    path = library_path(compiler)
    if path.exists():
        return path
    try:
        return _compile(compiler, path, verbose)
    except OSError as exc:
        raise CpuKernelsUnavailable(f"cannot build into {path.parent}: {exc} "
                                    "(set TANDEM_CACHE_DIR to a writable directory)") from exc


def _compile(compiler: str, path: Path, verbose: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():                      # another process built it meanwhile
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        with tempfile.TemporaryDirectory(dir=path.parent) as objdir:
            # One compiler per source, as many at once as there are cores (decode
            # attention alone takes about half of a serial build), then one link.
            objects = [os.path.join(objdir, f"{src.stem}.o") for src in SOURCES]
            jobs = [[compiler, *FLAGS, "-c", str(src), "-o", obj]
                    for src, obj in zip(SOURCES, objects)]
            _run_all(jobs, len(os.sched_getaffinity(0)), tmp)
            _run_all([[compiler, *FLAGS, "-o", tmp, *objects]], 1, tmp)
        os.replace(tmp, path)
        if verbose:
            print(f"built {path}")
    return path


def _run_all(cmds: list[list[str]], parallel: int, tmp: str) -> None:
    """Run the compiler commands, up to ``parallel`` at a time.

    Raises:
        CpuKernelsUnavailable: one failed (its command and the end of its stderr);
            ``tmp`` (the unfinished library) is removed.
    """
    pending, running = list(cmds), []
    while pending or running:
        while pending and len(running) < max(1, parallel):
            cmd = pending.pop(0)
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)))
        cmd, proc = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode != 0:
            for _, other in running:
                other.kill()
                other.wait()
            os.unlink(tmp)
            raise CpuKernelsUnavailable(f"{' '.join(cmd)} failed:\n{err[-4000:]}")


_I64, _F32, _INT, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    # ..., scale, window (tokens, 0: none), softcap (0: none), threads
    "decode_attention": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                         _I64, _I64, _I64, _I64, _I64, _F32, _I64, _F32, _INT],
    "reshape_and_cache": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64],
    "rms_norm": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT],
    "rotary_embedding": [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT],
    "silu_and_mul": [_PTR, _PTR, _I64, _I64, _INT],
    "linear": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT],
    "gguf_linear": [_PTR, _I64, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _INT],
    # int8 activation blocks (x quantized per 32 values), same arguments.
    "gguf_linear_q8": [_PTR, _I64, _PTR, _I64, _PTR, _INT, _I64, _I64, _I64, _INT],
    # fp8 (e4m3) KV cache: the suffix names the query / K-V input dtype.
    "decode_attention_fp8": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                             _I64, _I64, _I64, _I64, _I64, _F32, _PTR, _PTR, _INT],
    "reshape_and_cache_fp8": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                              _PTR, _PTR],
    # int4 KV cache (packed rows): the suffix names the query dtype.
    "decode_attention_int4": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                              _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _PTR, _PTR,
                              _INT],
    "reshape_and_cache_int4": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                               _I64, _I64, _INT],
}
# Kernels without a dtype suffix: (argument types, result type).
_UNSUFFIXED = {
    "gguf_dequantize": ([_PTR, _PTR, _INT, _I64, _I64, _INT], None),
    "gguf_block_bytes": ([_INT], _INT),
    "gguf_block_weights": ([_INT], _INT),
    "gguf_int8_dot_tier": ([], _INT),
    "gguf_quantize_activations_f32": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _INT], None),
    "fp8_e4m3_encode": ([_PTR, _PTR, _I64], None),
    "fp8_e4m3_decode": ([_PTR, _PTR, _I64, _INT], None),
    "float_to_fp16": ([_PTR, _PTR, _I64], None),
    # bfloat16 linear on AMX tiles (csrc/amx_linear.cpp): usable(in_features), then
    # out, out row stride, x, x row stride, panel weight, M, N, K, threads.
    "amx_linear_usable": ([_I64], _INT),
    "amx_linear_bf16": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT], None),
    # the same on AVX-512 BF16 without AMX (csrc/dpbf16_linear.cpp), same arguments.
    "dpbf16_linear_usable": ([_I64], _INT),
    "dpbf16_linear_bf16": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT], None),
    # float32 on AVX-512F (the same file), same arguments, float32 panels.
    "avx512_f32_linear_usable": ([_I64], _INT),
    "avx512_f32_linear_f32": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT], None),
}
# Kernels that exist only where the CPU has them: for bfloat16 with AVX-512 BF16, for
# float32 with AVX-512F (``tandem_has_{name}_{suffix}`` says).
_WHERE_SUPPORTED = {
    "prefill_attention": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR,
                          _I64, _I64, _I64, _I64, _I64, _F32, _INT],
}


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build if needed, load, and declare the argument types of every kernel.

    Raises:
        CpuKernelsUnavailable: see :func:`build`.
    """
    import torch  # noqa: F401  -- torch's libgomp must be loaded first (see module doc)

    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise CpuKernelsUnavailable(f"cannot load {path}: {exc}") from exc
    for name, argtypes in _SIGNATURES.items():
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"tandem_{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
    for name, (argtypes, restype) in _UNSUFFIXED.items():
        fn = getattr(lib, f"tandem_{name}")
        fn.argtypes, fn.restype = argtypes, restype
    for name, argtypes in _WHERE_SUPPORTED.items():
        for suffix in ("f32", "bf16"):
            has = getattr(lib, f"tandem_has_{name}_{suffix}")
            has.argtypes, has.restype = [], ctypes.c_int
            if has():
                fn = getattr(lib, f"tandem_{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
    usable = lib.tandem_prefill_attention_bf16_amx_usable
    usable.argtypes, usable.restype = [_I64], ctypes.c_int
    if usable(64):
        fn = lib.tandem_prefill_attention_bf16_amx
        fn.argtypes, fn.restype = _WHERE_SUPPORTED["prefill_attention"], None
    return lib


if __name__ == "__main__":
    print(build(verbose=True))
