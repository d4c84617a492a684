"""tandem.kvtransfer: moving KV blocks from a prefill worker's cache into a decode worker's.

Modules:
    layout   KVLayout, check_compatible, KVTransferTicket (plain data; cross Ray/gRPC via to_dict)
    base     KVSender / KVReceiver ABCs, KVTransferError, the transport registry
    staging  header queue, arrivals board and receive loop shared by the transports
    blocks   gathering/scattering a layer's blocks on CPU
    gloo     CPU transport (torch ProcessGroupGloo, one 2-rank group per pair)
    nccl     GPU transport (libnccl via ctypes, one 2-rank communicator per pair)
    libnccl  the ctypes bindings
    connector  TransportKVConnector: the engine's KVConnector over these transports

Only ``layout`` and ``base`` are imported here; a transport module loads when
:func:`get_transport` first names it.
"""

from tandem.kvtransfer.base import (KVReceiver, KVSender, KVTransferError, Transport, get_transport,
                                    transport_names)
from tandem.kvtransfer.layout import KVLayout, KVLayoutMismatchError, KVTransferTicket, check_compatible

__all__ = [
    "KVLayout", "KVLayoutMismatchError", "KVReceiver", "KVSender", "KVTransferError",
    "KVTransferTicket", "Transport", "check_compatible", "get_transport", "transport_names",
]
