"""Gloo KV transport between this process (decode side) and a real peer process (prefill side)."""

import itertools
import threading
import time

import pytest
import torch

from kv_peer import Peer, make_cache
from tandem.kvtransfer.base import KVTransferError
from tandem.kvtransfer.gloo import GlooReceiver, GlooSender
from tandem.kvtransfer.layout import KVLayout, KVTransferTicket

pytestmark = pytest.mark.timeout(60)

SENTINEL = -7.0          # every receiver cache starts as this; untouched blocks must keep it
SRC_NUM_BLOCKS = 24      # blocks in the peer's cache
DST_NUM_BLOCKS = 32      # blocks in ours
_transfer_ids = itertools.count(1)


def _layout(dtype="float32"):
    return KVLayout(num_layers=4, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype)


def _dst_cache(layout):
    return torch.full((layout.num_layers, 2, DST_NUM_BLOCKS, layout.block_size, layout.num_kv_heads,
                       layout.head_dim), SENTINEL, dtype=layout.torch_dtype)


def _ticket(layout, dst_block_ids, num_cached_tokens, num_tokens, request_id="req"):
    return KVTransferTicket(request_id, next(_transfer_ids), tuple(dst_block_ids), num_cached_tokens,
                            num_tokens, layout)


def _assert_only(kv_cache, expected_blocks):
    """``expected_blocks`` maps dst block -> expected ``[L, 2, bs, h, d]``; all else is SENTINEL."""
    for block in range(kv_cache.shape[2]):
        got = kv_cache[:, :, block]
        if block in expected_blocks:
            assert torch.equal(got, expected_blocks[block]), f"block {block} differs"
        else:
            assert torch.equal(got, torch.full_like(got, SENTINEL)), f"block {block} was written"


@pytest.fixture(scope="module")
def pair():
    receiver = GlooReceiver.listen()
    peer = Peer()
    peer.call("connect", "gloo", receiver.rendezvous)
    yield receiver, peer
    peer.stop()
    receiver.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interleaved_transfers_land_bit_exact(pair, dtype):
    receiver, peer = pair
    layout = _layout(dtype)
    seed = 11 if dtype == "float32" else 12
    # a: 75 tokens in 5 blocks, the first 16 cached here -> 4 blocks travel.
    a = _ticket(layout, [30, 3, 12, 7, 21], num_cached_tokens=16, num_tokens=75, request_id="a")
    a_src = [17, 2, 9, 5]
    # b: 40 tokens in 3 blocks, nothing cached.
    b = _ticket(layout, [0, 25, 14], num_cached_tokens=0, num_tokens=40, request_id="b")
    b_src = [11, 20, 1]
    kv_cache = _dst_cache(layout)

    # b is awaited by another thread before anything is sent; a only after both were sent.
    errors = []
    def receive_b():
        try:
            receiver.receive(b, kv_cache, timeout_s=20)
        except KVTransferError as e:
            errors.append(e)
    thread = threading.Thread(target=receive_b)
    thread.start()
    peer.call("send", [(a.to_dict(), a_src), (b.to_dict(), b_src)], layout.to_dict(), SRC_NUM_BLOCKS, seed)
    receiver.receive(a, kv_cache, timeout_s=20)
    thread.join(20)
    assert errors == []

    src = make_cache(layout, SRC_NUM_BLOCKS, seed)
    expected = {dst: src[:, :, s] for dst, s in zip(a.sent_dst_block_ids, a_src, strict=True)}
    expected.update({dst: src[:, :, s] for dst, s in zip(b.sent_dst_block_ids, b_src, strict=True)})
    assert sorted(expected) == [0, 3, 7, 12, 14, 21, 25]  # 30 is a's cached prefix: not written
    _assert_only(kv_cache, expected)
    assert receiver.staged_transfer_ids() == []


def _wait_for(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.01)
    return value


def test_the_handshake_travels_on_the_pair(pair):
    """The receiver's tickets reach the sender's handler in order, and the sender's
    first-token handoff reaches the receiver's ``on_handoff`` behind its layers."""
    receiver, peer = pair
    layout = _layout()
    first = _ticket(layout, [4, 9], num_cached_tokens=0, num_tokens=20, request_id="hs-1")
    second = _ticket(layout, [6], num_cached_tokens=0, num_tokens=3, request_id="hs-2")
    already = len(peer.call("tickets"))
    receiver.post_ticket(first.to_dict())
    receiver.post_ticket(second.to_dict())
    got = _wait_for(lambda: len(peer.call("tickets")) == already + 2 and peer.call("tickets"))
    assert got[already:] == [first.to_dict(), second.to_dict()]
    handed = []
    receiver.on_handoff = lambda transfer_id, payload: handed.append((transfer_id, payload))
    try:
        payload = {"token_id": 42, "logprob": -0.5, "top": [[42, -0.5], [7, -1.25]]}
        peer.call("send", [(first.to_dict(), [3, 8])], layout.to_dict(), SRC_NUM_BLOCKS, 21)
        peer.call("handoff", first.transfer_id, payload)
        kv_cache = _dst_cache(layout)
        receiver.receive(first, kv_cache, timeout_s=20)
        assert _wait_for(lambda: handed) == [(first.transfer_id, payload)]
    finally:
        receiver.on_handoff = None
    receiver.discard(second.transfer_id)
    assert receiver.staged_transfer_ids() == []


def test_layers_are_yielded_as_they_land(pair):
    receiver, peer = pair
    layout = _layout()
    ticket = _ticket(layout, [4, 9], num_cached_tokens=0, num_tokens=20)
    src_ids = [6, 3]
    kv_cache = _dst_cache(layout)
    src = make_cache(layout, SRC_NUM_BLOCKS, seed=5)
    expected = src[:, :, src_ids]
    dst = list(ticket.sent_dst_block_ids)

    peer.call("send", [(ticket.to_dict(), src_ids)], layout.to_dict(), SRC_NUM_BLOCKS, 5, [0, 1], None)
    layers = receiver.receive_layers(ticket, kv_cache, timeout_s=20)
    landed = [next(layers), next(layers)]
    assert landed == [0, 1]
    assert torch.equal(kv_cache[:2, :, dst], expected[:2])
    # Layers 2 and 3 have not been sent: their blocks are untouched.
    assert torch.equal(kv_cache[2:], torch.full_like(kv_cache[2:], SENTINEL))

    peer.call("send", [(ticket.to_dict(), src_ids)], layout.to_dict(), SRC_NUM_BLOCKS, 5, [2, 3])
    assert list(layers) == [2, 3]
    assert torch.equal(kv_cache[:, :, dst], expected)


def test_timeout_then_late_data_is_dropped_and_receiver_still_works(pair):
    receiver, peer = pair
    layout = _layout()
    late = _ticket(layout, [1, 2, 3], num_cached_tokens=0, num_tokens=48, request_id="late")
    kv_cache = _dst_cache(layout)

    start = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        receiver.receive(late, kv_cache, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert str(info.value) == (f"request 'late' transfer {late.transfer_id}: "
                               "4 of 4 layers not received within 1.0 s")
    assert 1.0 <= elapsed < 2.0

    # The sender shows up after all: its bytes are drained and dropped, not written.
    peer.call("send", [(late.to_dict(), [5, 6, 7])], layout.to_dict(), SRC_NUM_BLOCKS, 8)
    on_time = _ticket(layout, [10, 11], num_cached_tokens=0, num_tokens=17, request_id="on-time")
    peer.call("send", [(on_time.to_dict(), [0, 23])], layout.to_dict(), SRC_NUM_BLOCKS, 8)
    receiver.receive(on_time, kv_cache, timeout_s=20)

    src = make_cache(layout, SRC_NUM_BLOCKS, seed=8)
    _assert_only(kv_cache, {10: src[:, :, 0], 11: src[:, :, 23]})
    assert receiver.staged_transfer_ids() == []
    with pytest.raises(KVTransferError, match=f"transfer {late.transfer_id} was already received or discarded"):
        receiver.receive(late, kv_cache, timeout_s=1.0)


def test_an_extended_receive_waits_past_its_timeout_for_a_queued_sender(pair):
    """A load kept alive with ``extend`` (its sender busy with other prompts) does not
    time out at its own ``timeout_s``, and lands the layers when they come; a
    receive nobody extends still times out as before."""
    receiver, peer = pair
    layout = _layout()
    ticket = _ticket(layout, [4, 5], num_cached_tokens=0, num_tokens=20, request_id="queued")
    kv_cache = _dst_cache(layout)
    result: dict = {}

    def receive():
        try:
            receiver.receive(ticket, kv_cache, timeout_s=1.0)
            result["ok"] = time.monotonic()
        except KVTransferError as exc:
            result["error"] = exc

    start = time.monotonic()
    t = threading.Thread(target=receive)
    t.start()
    for _ in range(4):                     # keep-alives, as the router sends them
        time.sleep(0.5)
        receiver.extend(ticket.transfer_id, 1.0)
    assert t.is_alive() and not result, result      # 2 s in: past its own 1 s
    peer.call("send", [(ticket.to_dict(), [3, 9])], layout.to_dict(), SRC_NUM_BLOCKS, 11)
    t.join(20)
    assert "ok" in result and result["ok"] - start >= 2.0, result
    src = make_cache(layout, SRC_NUM_BLOCKS, seed=11)
    _assert_only(kv_cache, {4: src[:, :, 3], 5: src[:, :, 9]})
    receiver.extend(ticket.transfer_id, 60.0)        # finished: nothing to extend
    assert receiver.staged_transfer_ids() == []


def test_sender_checks_layout_before_sending(pair):
    _, peer = pair
    decode_layout = _layout()
    ticket = _ticket(decode_layout, [1], num_cached_tokens=0, num_tokens=16)
    prefill_layout = KVLayout(4, 32, 3, 64, "float32")
    with pytest.raises(RuntimeError) as info:
        peer.call("send", [(ticket.to_dict(), [0])], prefill_layout.to_dict(), SRC_NUM_BLOCKS, 1)
    assert str(info.value).splitlines()[0] == (
        "KVLayoutMismatchError: KV layout mismatch: block_size prefill=32 decode=16")


def test_receiver_rejects_a_layer_of_the_wrong_size(pair):
    receiver, peer = pair
    layout = _layout()
    # The two ends disagree on the cached prefix: the sender sends 3 blocks, we expect 2.
    ours = _ticket(layout, [1, 2, 3], num_cached_tokens=16, num_tokens=48, request_id="skew")
    theirs = KVTransferTicket("skew", ours.transfer_id, ours.dst_block_ids, 0, 48, layout)
    peer.call("send", [(theirs.to_dict(), [4, 5, 6])], layout.to_dict(), SRC_NUM_BLOCKS, 2)
    kv_cache = _dst_cache(layout)
    with pytest.raises(KVTransferError) as info:
        receiver.receive(ours, kv_cache, timeout_s=20)
    assert str(info.value) == (f"request 'skew' transfer {ours.transfer_id} layer 0: received 73728 "
                               "bytes, ticket expects 49152 (2 blocks x 24576)")
    _assert_only(kv_cache, {})
    assert receiver.staged_transfer_ids() == []


def test_receive_without_a_sender_times_out_and_says_so():
    layout = _layout()
    with GlooReceiver.listen(connect_timeout_s=30) as receiver:
        ticket = _ticket(layout, [0], num_cached_tokens=0, num_tokens=1, request_id="alone")
        with pytest.raises(KVTransferError) as info:
            receiver.receive(ticket, _dst_cache(layout), timeout_s=0.5)
    assert str(info.value) == (f"request 'alone' transfer {ticket.transfer_id}: 4 of 4 layers not "
                               "received within 0.5 s (the sender has not connected)")


def test_close_wakes_a_waiting_receive():
    layout = _layout()
    receiver = GlooReceiver.listen(connect_timeout_s=30)
    ticket = _ticket(layout, [0], num_cached_tokens=0, num_tokens=1, request_id="closing")
    errors = []
    def receive():
        try:
            receiver.receive(ticket, _dst_cache(layout), timeout_s=30)
        except KVTransferError as e:
            errors.append(str(e))
    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    receiver.close()
    thread.join(5)
    assert time.monotonic() - start < 2.0
    assert errors == [f"request 'closing' transfer {ticket.transfer_id}: 4 of 4 layers not received: "
                      "the receiver is closed"]


def test_peer_death_fails_both_directions_fast():
    layout = _layout()
    receiver = GlooReceiver.listen()
    peer = Peer()
    try:
        peer.call("connect", "gloo", receiver.rendezvous)
        sender = GlooSender.connect(peer.call("listen", "gloo"), timeout_s=20)

        ticket = _ticket(layout, [3, 4], num_cached_tokens=0, num_tokens=32, request_id="doomed")
        peer.call("send", [(ticket.to_dict(), [1, 2])], layout.to_dict(), SRC_NUM_BLOCKS, 3, [0, 1], None)
        kv_cache = _dst_cache(layout)
        layers = receiver.receive_layers(ticket, kv_cache, timeout_s=30)
        assert [next(layers), next(layers)] == [0, 1]

        peer.die()
        start = time.monotonic()
        with pytest.raises(KVTransferError) as info:
            next(layers)
        assert time.monotonic() - start < 5.0  # the watchdog, not the 30 s timeout
        assert str(info.value).startswith(
            f"request 'doomed' transfer {ticket.transfer_id}: 2 of 4 layers not received: "
            "lost the connection to the sender: ")
        assert str(receiver.error).startswith("lost the connection to the sender: ")
        # Layers that landed before the death stay landed.
        src = make_cache(layout, SRC_NUM_BLOCKS, seed=3)
        assert torch.equal(kv_cache[:2, :, [3, 4]], src[:2, :, [1, 2]])

        # Our sender towards the dead peer fails within its timeout instead of hanging.
        out = _ticket(layout, [0], num_cached_tokens=0, num_tokens=5, request_id="to-dead")
        src_cache = make_cache(layout, SRC_NUM_BLOCKS, seed=4)
        start = time.monotonic()
        with pytest.raises(KVTransferError):
            for layer in range(layout.num_layers):
                sender.send_layer(out, layer, [0], src_cache)
            sender.finish(out, timeout_s=5)
        assert time.monotonic() - start < 6.0
        assert sender.error is not None
        sender.close()
    finally:
        peer.stop()
        receiver.close()


@pytest.mark.parametrize("sender_host", [None, "127.0.0.2"])
def test_receiver_and_sender_on_different_node_addresses(sender_host):
    # Two nodes of one machine, as the multi-node cluster test runs them: the decode
    # worker listens on its node address, the prefill worker is on another one. With
    # no local_host the sender takes the local end of the route to the receiver,
    # which for a loopback receiver is the receiver's own (local) address.
    from tandem.kvtransfer.gloo import local_address_for

    assert local_address_for("127.0.0.3") == "127.0.0.3"
    layout = _layout()
    peer = Peer()
    try:
        with GlooReceiver.listen("127.0.0.3", connect_timeout_s=30) as receiver:
            assert receiver.rendezvous["host"] == "127.0.0.3"
            options = {} if sender_host is None else {"local_host": sender_host}
            peer.call("connect", "gloo", receiver.rendezvous, options)
            ticket = _ticket(layout, [5, 0, 9], num_cached_tokens=0, num_tokens=40, request_id="remote")
            peer.call("send", [(ticket.to_dict(), [2, 19, 7])], layout.to_dict(), SRC_NUM_BLOCKS, 21)
            kv_cache = _dst_cache(layout)
            receiver.receive(ticket, kv_cache, timeout_s=20)
            src = make_cache(layout, SRC_NUM_BLOCKS, seed=21)
            _assert_only(kv_cache, {5: src[:, :, 2], 0: src[:, :, 19], 9: src[:, :, 7]})
            peer.stop()
    finally:
        peer.stop()


@pytest.mark.parametrize("peer_secret", ["wrong", None])
def test_a_peer_without_the_cluster_secret_is_refused(monkeypatch, peer_secret):
    """The receiver accepts only a sender that proves the cluster secret (an HMAC of
    the pair name) before any data channel exists; the sender is told at once."""
    from tandem.kvtransfer.staging import CLUSTER_SECRET_ENV

    if peer_secret is None:
        monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(CLUSTER_SECRET_ENV, peer_secret)
    peer = Peer()                                   # spawned with that environment
    try:
        monkeypatch.setenv(CLUSTER_SECRET_ENV, "right")
        layout = _layout()
        with GlooReceiver.listen(connect_timeout_s=30) as receiver:
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="refused this peer"):
                peer.call("connect", "gloo", receiver.rendezvous)
            assert time.monotonic() - start < 10
            ticket = _ticket(layout, [0], num_cached_tokens=0, num_tokens=1, request_id="intruder")
            with pytest.raises(KVTransferError, match="refused a peer without the cluster secret"):
                receiver.receive(ticket, _dst_cache(layout), timeout_s=5)
    finally:
        peer.stop()


def test_a_peer_with_the_cluster_secret_transfers(monkeypatch):
    from tandem.kvtransfer.staging import CLUSTER_SECRET_ENV

    monkeypatch.setenv(CLUSTER_SECRET_ENV, "shared")
    peer = Peer()
    try:
        layout = _layout()
        with GlooReceiver.listen(connect_timeout_s=30) as receiver:
            peer.call("connect", "gloo", receiver.rendezvous)
            ticket = _ticket(layout, [5], num_cached_tokens=0, num_tokens=16, request_id="friend")
            peer.call("send", [(ticket.to_dict(), [2])], layout.to_dict(), SRC_NUM_BLOCKS, 3)
            dst = _dst_cache(layout)
            receiver.receive(ticket, dst, timeout_s=10)
            _assert_only(dst, {5: make_cache(layout, SRC_NUM_BLOCKS, 3)[:, :, 2]})
    finally:
        peer.stop()
