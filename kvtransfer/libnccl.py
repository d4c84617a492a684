"""ctypes bindings for the few libnccl functions KV transfer needs.

The library is the ``libnccl.so.2`` of the ``nvidia-nccl-cu13`` / ``nvidia-nccl-cu12``
wheel that a CUDA build of torch depends on; ``TANDEM_NCCL_LIBRARY`` may name
another file. Loading it needs no GPU (``ncclGetVersion`` and ``ncclGetUniqueId``
work on any machine); communicators and send/recv need one GPU per rank.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
from pathlib import Path

from tandem.kvtransfer.base import KVTransferError

LIBRARY_ENV = "TANDEM_NCCL_LIBRARY"
_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h

# ncclDataType_t: KV travels as raw bytes, whatever its dtype.
NCCL_UINT8 = 1
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7

_ncclResult_t = ctypes.c_int
_ncclComm_t = ctypes.c_void_p
_cudaStream_t = ctypes.c_void_p


class NCCLError(KVTransferError):
    """A libnccl call returned an error code."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def find_libnccl() -> Path:
    """Path of ``libnccl.so.2``: ``$TANDEM_NCCL_LIBRARY``, else the nvidia-nccl wheel's copy.

    Raises:
        FileNotFoundError: no such file (the message lists where it looked).
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{LIBRARY_ENV}={override} is not a file")
        return Path(override)
    looked = []
    for wheel in _WHEELS:
        try:
            files = importlib.metadata.distribution(wheel).files or []
        except importlib.metadata.PackageNotFoundError:
            looked.append(f"{wheel} (not installed)")
            continue
        for file in files:
            if file.name == "libnccl.so.2":
                return Path(file.locate())
        looked.append(f"{wheel} (no libnccl.so.2 in it)")
    raise FileNotFoundError(f"libnccl.so.2 not found: set {LIBRARY_ENV} or install one of "
                            f"{', '.join(looked)}")


class NCCLLibrary:
    """One loaded ``libnccl.so.2``; methods raise :class:`NCCLError` on a failed call."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else find_libnccl()
        lib = ctypes.CDLL(str(self.path))
        self._lib = lib
        self._declare("ncclGetErrorString", ctypes.c_char_p, _ncclResult_t)
        self._declare("ncclGetVersion", _ncclResult_t, ctypes.POINTER(ctypes.c_int))
        self._declare("ncclGetUniqueId", _ncclResult_t, ctypes.POINTER(_UniqueId))
        self._declare("ncclCommInitRank", _ncclResult_t, ctypes.POINTER(_ncclComm_t), ctypes.c_int,
                      _UniqueId, ctypes.c_int)
        self._declare("ncclCommAbort", _ncclResult_t, _ncclComm_t)
        self._declare("ncclCommGetAsyncError", _ncclResult_t, _ncclComm_t,
                      ctypes.POINTER(_ncclResult_t))
        self._declare("ncclGroupStart", _ncclResult_t)
        self._declare("ncclGroupEnd", _ncclResult_t)
        for name in ("ncclSend", "ncclRecv"):
            self._declare(name, _ncclResult_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, _ncclComm_t, _cudaStream_t)

    def _declare(self, name: str, restype, *argtypes) -> None:
        fn = getattr(self._lib, name)
        fn.restype, fn.argtypes = restype, list(argtypes)

    def _check(self, result: int, call: str) -> None:
        if result != NCCL_SUCCESS:
            message = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise NCCLError(f"{call} failed: {message} (ncclResult_t {result})")

    def version(self) -> int:
        """``NCCL_VERSION_CODE``, e.g. 23007 for 2.30.7."""
        version = ctypes.c_int()
        self._check(self._lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
        return version.value

    def unique_id(self) -> bytes:
        """A fresh ``ncclUniqueId`` (128 bytes) for a new communicator; made by one rank, shared with the others."""
        uid = _UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Join communicator ``unique_id`` as ``rank`` on the current CUDA device; blocks until all ranks joined.

        Returns:
            the ``ncclComm_t`` handle (an address).
        """
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"ncclUniqueId must be {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = _ncclComm_t()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank),
                    "ncclCommInitRank")
        return comm.value

    def comm_abort(self, comm: int) -> None:
        """Free ``comm`` without waiting for its pending operations (they are cancelled)."""
        self._check(self._lib.ncclCommAbort(comm), "ncclCommAbort")

    def async_error(self, comm: int) -> int:
        """The communicator's asynchronous error code (``NCCL_SUCCESS`` while healthy)."""
        result = _ncclResult_t()
        self._check(self._lib.ncclCommGetAsyncError(comm, ctypes.byref(result)), "ncclCommGetAsyncError")
        return result.value

    def error_string(self, result: int) -> str:
        return self._lib.ncclGetErrorString(result).decode(errors="replace")

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        """Queue sending ``nbytes`` bytes at device address ``ptr`` to ``peer`` on ``stream``."""
        self._grouped("ncclSend", ptr, nbytes, peer, comm, stream)

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        """Queue receiving ``nbytes`` bytes from ``peer`` into device address ``ptr`` on ``stream``."""
        self._grouped("ncclRecv", ptr, nbytes, peer, comm, stream)

    def _grouped(self, name: str, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        # Point-to-point calls go in a group so that NCCL launches them without
        # waiting for the peer at call time (only the stream waits).
        self._check(self._lib.ncclGroupStart(), "ncclGroupStart")
        try:
            self._check(getattr(self._lib, name)(ptr, nbytes, NCCL_UINT8, peer, comm, stream), name)
        finally:
            self._check(self._lib.ncclGroupEnd(), "ncclGroupEnd")
