"""NCCL transport: libnccl bindings wherever the library is installed, transfers on two GPUs."""

import time

import pytest
import torch

from kv_peer import Peer, make_cache
from tandem.kvtransfer.base import KVTransferError, get_transport
from tandem.kvtransfer.layout import KVLayout, KVTransferTicket
from tandem.kvtransfer.libnccl import LIBRARY_ENV, UNIQUE_ID_BYTES, NCCLLibrary, find_libnccl
from tandem.kvtransfer.nccl import NCCLReceiver, NCCLSender

pytestmark = pytest.mark.timeout(120)

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="an NCCL pair needs two GPUs (NCCL refuses two ranks on one)")


def _library_or_skip() -> NCCLLibrary:
    try:
        return NCCLLibrary()
    except FileNotFoundError as e:
        pytest.skip(f"libnccl is not installed (a CPU build of torch brings none): {e}")


def test_registry_resolves_nccl_without_loading_the_library():
    transport = get_transport("nccl")
    assert transport.sender is NCCLSender and transport.receiver is NCCLReceiver


def test_missing_library_override_is_reported(monkeypatch):
    monkeypatch.setenv(LIBRARY_ENV, "/nonexistent/libnccl.so.2")
    with pytest.raises(FileNotFoundError) as info:
        find_libnccl()
    assert str(info.value) == f"{LIBRARY_ENV}=/nonexistent/libnccl.so.2 is not a file"


def test_version_and_unique_ids():
    lib = _library_or_skip()
    assert lib.version() >= 21800  # ncclSend/ncclRecv and ncclCommGetAsyncError: 2.18 or later
    first, second = lib.unique_id(), lib.unique_id()
    assert len(first) == len(second) == UNIQUE_ID_BYTES
    assert first != second


def test_comm_init_checks_the_unique_id_length():
    lib = _library_or_skip()
    with pytest.raises(ValueError, match="ncclUniqueId must be 128 bytes, got 5"):
        lib.comm_init_rank(2, b"short", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_nccl_without_cuda_says_to_use_gloo():
    with pytest.raises(KVTransferError, match="the NCCL KV transport needs CUDA; use 'gloo' on this machine"):
        NCCLReceiver.listen()


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpu_transfers_land_bit_exact_and_time_out_cleanly(dtype):
    layout = KVLayout(num_layers=4, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype)
    receiver = NCCLReceiver.listen(device="cuda:0")
    peer = Peer()
    try:
        peer.call("connect", "nccl", receiver.rendezvous, {"device": "cuda:1"})
        kv_cache = torch.full((4, 2, 32, 16, 3, 64), -7.0, dtype=layout.torch_dtype, device="cuda:0")
        a = KVTransferTicket("a", 1, (30, 3, 12, 7, 21), 16, 75, layout)
        b = KVTransferTicket("b", 2, (0, 25, 14), 0, 40, layout)
        a_src, b_src = [17, 2, 9, 5], [11, 20, 1]
        peer.call("send", [(a.to_dict(), a_src), (b.to_dict(), b_src)], layout.to_dict(), 24, 21)
        receiver.receive(b, kv_cache, timeout_s=30)
        receiver.receive(a, kv_cache, timeout_s=30)
        src = make_cache(layout, 24, 21).to("cuda:0")
        assert torch.equal(kv_cache[:, :, list(a.sent_dst_block_ids)], src[:, :, a_src])
        assert torch.equal(kv_cache[:, :, list(b.sent_dst_block_ids)], src[:, :, b_src])
        untouched = [i for i in range(32) if i not in (3, 12, 7, 21, 0, 25, 14)]
        assert torch.equal(kv_cache[:, :, untouched], torch.full_like(kv_cache[:, :, untouched], -7.0))

        never = KVTransferTicket("never", 3, (1,), 0, 1, layout)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="4 of 4 layers not received within 1.0 s"):
            receiver.receive(never, kv_cache, timeout_s=1.0)
        assert time.monotonic() - start < 2.0
        after = KVTransferTicket("after", 4, (9,), 0, 16, layout)
        peer.call("send", [(after.to_dict(), [4])], layout.to_dict(), 24, 21)
        receiver.receive(after, kv_cache, timeout_s=30)
        assert torch.equal(kv_cache[:, :, 9], src[:, :, 4])
        assert receiver.error is None and receiver.staged_transfer_ids() == []
    finally:
        peer.stop()
        receiver.close()
