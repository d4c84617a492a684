"""KVLayout, layout compatibility, KVTransferTicket and the transport registry (no processes)."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.kvtransfer.base import KVTransferError, get_transport, transport_names
from tandem.kvtransfer.layout import KVLayout, KVLayoutMismatchError, KVTransferTicket, check_compatible

# The default model (SmolLM2-135M): 30 layers, 3 KV heads, head_dim 64; block size 16.
SMOL = KVLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")


def test_from_cache_reads_every_dimension_and_dtype():
    kv_cache = torch.zeros(30, 2, 7, 16, 3, 64, dtype=torch.bfloat16)
    assert KVLayout.from_cache(kv_cache) == KVLayout(30, 16, 3, 64, "bfloat16")


def test_from_cache_rejects_other_shapes():
    with pytest.raises(ValueError, match=r"got shape \(30, 3, 7, 16, 3, 64\)"):
        KVLayout.from_cache(torch.zeros(30, 3, 7, 16, 3, 64))
    with pytest.raises(ValueError, match="KVLayout.dtype must be one of"):
        KVLayout.from_cache(torch.zeros(30, 2, 7, 16, 3, 64, dtype=torch.int8))


def test_bytes_per_block_per_layer():
    assert SMOL.bytes_per_block_per_layer == 2 * 16 * 3 * 64 * 4 == 24576
    assert KVLayout(30, 16, 3, 64, "bfloat16").bytes_per_block_per_layer == 12288
    assert KVLayout(30, 16, 3, 64, "float16").bytes_per_block_per_layer == 12288


def test_invalid_layout_values():
    with pytest.raises(ValueError, match="KVLayout.block_size must be a positive int, got 0"):
        KVLayout(30, 0, 3, 64, "float32")
    with pytest.raises(ValueError, match="KVLayout.dtype must be one of"):
        KVLayout(30, 16, 3, 64, "torch.float32")


def test_compatible_layouts_pass():
    check_compatible(SMOL, KVLayout(30, 16, 3, 64, "float32"))


def test_block_size_mismatch_names_both_values():
    with pytest.raises(KVLayoutMismatchError) as info:
        check_compatible(SMOL, KVLayout(30, 32, 3, 64, "float32"))
    assert str(info.value) == "KV layout mismatch: block_size prefill=16 decode=32"


def test_dtype_mismatch_names_both_values():
    with pytest.raises(KVLayoutMismatchError) as info:
        check_compatible(SMOL, KVLayout(30, 16, 3, 64, "bfloat16"))
    assert str(info.value) == "KV layout mismatch: dtype prefill=float32 decode=bfloat16"


def test_every_mismatched_field_is_named_in_field_order():
    with pytest.raises(KVLayoutMismatchError) as info:
        check_compatible(SMOL, KVLayout(28, 32, 3, 128, "bfloat16"))
    assert str(info.value) == (
        "KV layout mismatch: num_layers prefill=30 decode=28; block_size prefill=16 decode=32; "
        "head_dim prefill=64 decode=128; dtype prefill=float32 decode=bfloat16")


def test_layout_mismatch_is_a_value_error():
    assert issubclass(KVLayoutMismatchError, ValueError)


def _ticket(**overrides):
    values = dict(request_id="req-1", transfer_id=5, dst_block_ids=(9, 4, 17, 2, 30),
                  num_cached_tokens=32, num_tokens=80, layout=SMOL)
    values.update(overrides)
    return KVTransferTicket(**values)


def test_ticket_sends_blocks_after_the_cached_prefix():
    ticket = _ticket()
    assert ticket.sent_block_indices() == range(2, 5)
    assert ticket.sent_dst_block_ids == (17, 2, 30)
    assert ticket.num_sent_blocks == 3
    assert ticket.bytes_per_layer == 3 * 24576


def test_partly_cached_block_is_sent_whole():
    ticket = _ticket(num_cached_tokens=20)  # 20 tokens: block 0 full, block 1 partly cached
    assert ticket.sent_block_indices() == range(1, 5)
    assert ticket.sent_dst_block_ids == (4, 17, 2, 30)


def test_nothing_cached_sends_every_block():
    assert _ticket(num_cached_tokens=0).sent_dst_block_ids == (9, 4, 17, 2, 30)


def test_fully_cached_sequence_sends_nothing():
    ticket = _ticket(num_tokens=32, dst_block_ids=(9, 4), num_cached_tokens=32)
    assert ticket.sent_block_indices() == range(2, 2)
    assert ticket.num_sent_blocks == 0
    assert ticket.bytes_per_layer == 0


def test_ticket_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="dst_block_ids has 4 ids, but 80 tokens at block_size 16 need 5"):
        _ticket(dst_block_ids=(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"dst_block_ids must be distinct, got \[1, 2, 3, 2, 5\]"):
        _ticket(dst_block_ids=(1, 2, 3, 2, 5))
    with pytest.raises(ValueError, match=r"num_cached_tokens must be in \[0, num_tokens=80\], got 81"):
        _ticket(num_cached_tokens=81)
    with pytest.raises(ValueError, match="transfer_id must be >= 0, got -1"):
        _ticket(transfer_id=-1)


def test_ticket_is_frozen_and_keeps_a_tuple():
    ticket = _ticket(dst_block_ids=[9, 4, 17, 2, 30])
    assert ticket.dst_block_ids == (9, 4, 17, 2, 30)
    with pytest.raises(AttributeError):
        ticket.num_tokens = 3


def test_ticket_round_trip_through_plain_types():
    ticket = _ticket()
    data = ticket.to_dict()
    assert data == {"request_id": "req-1", "transfer_id": 5, "dst_block_ids": [9, 4, 17, 2, 30],
                    "num_cached_tokens": 32, "num_tokens": 80,
                    "layout": {"num_layers": 30, "block_size": 16, "num_kv_heads": 3,
                               "head_dim": 64, "dtype": "float32", "kv_scales_checksum": ""},
                    "attempt": 0, "producer_generation": 0}
    # JSON is the strictest of the boundaries it crosses (Ray pickles, gRPC Struct is JSON-like).
    assert KVTransferTicket.from_dict(json.loads(json.dumps(data))) == ticket
    # A layout from before fp8 KV caches (no checksum) is a model-dtype cache's.
    del data["layout"]["kv_scales_checksum"]
    assert KVTransferTicket.from_dict(data) == ticket


def test_ticket_carries_attempt_and_producer_generation():
    ticket = _ticket(attempt=2, producer_generation=7)
    data = json.loads(json.dumps(ticket.to_dict()))
    assert (data["attempt"], data["producer_generation"]) == (2, 7)
    assert KVTransferTicket.from_dict(data) == ticket
    # A ticket from a peer that predates them loads with both 0.
    del data["attempt"], data["producer_generation"]
    old = KVTransferTicket.from_dict(data)
    assert (old.attempt, old.producer_generation) == (0, 0)
    for name in ("attempt", "producer_generation"):
        with pytest.raises(ValueError, match=name):
            _ticket(**{name: -1})


def test_from_dict_is_strict_about_keys():
    data = _ticket().to_dict()
    data["priority"] = 1
    del data["num_tokens"]
    with pytest.raises(ValueError, match=r"missing keys \['num_tokens'\], unknown keys \['priority'\]"):
        KVTransferTicket.from_dict(data)


@given(block_size=st.sampled_from([1, 8, 16, 32]), num_tokens=st.integers(1, 500),
       cached_fraction=st.floats(0, 1), transfer_id=st.integers(0, 2**40),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_ticket_round_trip_and_sent_blocks_property(block_size, num_tokens, cached_fraction,
                                                    transfer_id, dtype):
    layout = KVLayout(4, block_size, 2, 8, dtype)
    num_blocks = -(-num_tokens // block_size)
    cached = int(num_tokens * cached_fraction)
    ticket = KVTransferTicket("r", transfer_id, tuple(range(100, 100 + num_blocks)), cached,
                              num_tokens, layout)
    assert KVTransferTicket.from_dict(json.loads(json.dumps(ticket.to_dict()))) == ticket
    sent = ticket.sent_block_indices()
    # Every token at or after num_cached_tokens lies in a sent block.
    assert sent.start * block_size <= cached and sent.stop == num_blocks
    assert (sent.start + 1) * block_size > cached or sent.start == num_blocks


def test_registry_resolves_config_strings():
    from tandem.kvtransfer.gloo import GlooReceiver, GlooSender

    assert transport_names() == ["gloo", "nccl"]
    transport = get_transport("gloo")
    assert transport.sender is GlooSender and transport.receiver is GlooReceiver


def test_registry_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown KV transport 'tcp'; known: \['gloo', 'nccl'\]"):
        get_transport("tcp")


def test_transfer_error_is_a_runtime_error():
    assert issubclass(KVTransferError, RuntimeError)
