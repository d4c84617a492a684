"""Cores lent between the workers of one machine (``tandem serve --lend-idle-cores``).

The board's arithmetic first (real files, real mappings, a recorder in place of
torch's thread setter), then a disaggregated pair of engine loops on the real model
in one process, their KV connectors joined by a real Gloo pair: the decode loop that
only waits for its prompt's KV never claims its cores, the prefill step runs on both
workers' shares, the decode steps that follow too, and the tokens equal one engine's.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tandem.engine.runtime.core_lending import (CoreLending, CoreLendingConfig, create_board,
                                                remove_board)


class Recorder:
    """Stands in for ``torch.set_num_threads``: what it was asked, in order."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


@pytest.fixture
def board(tmp_path):
    path = create_board(3, directory=str(tmp_path))
    yield path
    remove_board(path)


def _slot(path: str, slot: int, rec: Recorder, shares=(1, 1, 2), **kw) -> CoreLending:
    return CoreLending(CoreLendingConfig(path, slot, shares, kw.pop("max_threads", None)),
                       set_threads=rec, **kw)


def _read(path: str) -> list[int]:
    with open(path, "rb") as f:
        return list(f.read())


def _busy_in_thread(lending: CoreLending):
    """``lending.busy()`` on a thread of its own (it may wait for a peer): the thread
    and a dict that gets its result as ``n``."""
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("n", lending.busy()))
    t.start()
    return t, got


def test_claims_never_exceed_the_cores_and_a_lender_waits_for_the_borrowers_step(board):
    """Shares 1, 1, 2 (4 cores): a claims everything while alone; b, whose core a
    steps on, marks its share and waits until a's next step gives it back; the same
    for c; with everyone busy each has its share; a worker that ends lends its cores."""
    ra, rb, rc = Recorder(), Recorder(), Recorder()
    a, b, c = _slot(board, 0, ra), _slot(board, 1, rb), _slot(board, 2, rc)
    assert a.busy() == 4 and _read(board) == [4, 0, 0]
    t, got = _busy_in_thread(b)
    time.sleep(0.1)
    assert t.is_alive() and _read(board) == [4, 1, 0]     # waiting, its share marked
    assert a.busy() == 3                                   # b's core back; c still idle
    t.join(5)
    assert got["n"] == 1 and _read(board) == [3, 1, 0]
    t, got = _busy_in_thread(c)
    time.sleep(0.1)
    assert t.is_alive() and _read(board) == [3, 1, 2]
    assert a.busy() == 1
    t.join(5)
    assert got["n"] == 2 and _read(board) == [1, 1, 2]    # all busy: 4 threads, 4 cores
    assert a.busy() == 1                                   # unchanged: torch not asked again
    assert ra.calls == [4, 3, 1] and rb.calls == [1] and rc.calls == [2]
    assert b.waited_s > 0.05 and c.waited_s > 0.05 and a.waited_s == 0
    c.close()                                              # ended: its cores are lent
    assert a.busy() == 3 and a.lendable() == 3
    b.idle()
    assert a.busy() == 4
    a.close()
    b.close()
    assert _read(board) == [0, 0, 0]


def test_a_borrower_gives_a_share_back_between_layers_when_its_owner_claims_it(board):
    """Shares 1, 1, 2: a borrows all 4 cores; while nobody asks, give_back changes
    nothing (no lock, no call to torch); once b waits for its core, a's next
    give_back (after the layer it computes) shrinks a to 3 and b steps at once,
    long before a's next busy; with c waiting too, a comes down to its share, never
    below it."""
    ra, rb, rc = Recorder(), Recorder(), Recorder()
    a, b, c = _slot(board, 0, ra), _slot(board, 1, rb), _slot(board, 2, rc)
    assert a.busy() == 4 and a.borrowing
    assert a.give_back() == 4 and ra.calls == [4] and a.given_back == 0
    t, got = _busy_in_thread(b)
    time.sleep(0.05)
    assert t.is_alive() and _read(board) == [4, 1, 0]
    assert a.give_back() == 3 and _read(board)[0] == 3
    t.join(5)
    assert got["n"] == 1 and _read(board) == [3, 1, 0]
    assert a.give_back() == 3                    # c idle: its cores stay borrowed
    t, got = _busy_in_thread(c)
    time.sleep(0.05)
    assert a.give_back() == 1 and not a.borrowing
    t.join(5)
    assert got["n"] == 2 and _read(board) == [1, 1, 2]
    assert a.give_back() == 1                    # its own share: nothing to give
    assert ra.calls == [4, 3, 1] and a.given_back == 2
    assert b.waited_s < 1.0 and c.waited_s < 1.0
    for w in (a, b, c):
        w.close()


def test_more_workers_than_cores_take_at_most_the_cores(board):
    """1 prefill + 2 decode workers on 2 cores: shares 1, 1, 1 (two share a core);
    with the others idle a worker takes the machine's 2, not 3; once all are busy
    each steps on its share at once (the shares overlap: nothing is borrowed, so
    nothing to wait for)."""
    a = _slot(board, 0, Recorder(), (1, 1, 1), max_threads=2)
    b = _slot(board, 1, Recorder(), (1, 1, 1), max_threads=2)
    c = _slot(board, 2, Recorder(), (1, 1, 1), max_threads=2)
    assert a.busy() == 2
    t, got = _busy_in_thread(b)
    time.sleep(0.05)
    assert t.is_alive()                   # a borrowed b's core: b waits for a's next step
    assert a.busy() == 1
    t.join(5)
    assert got["n"] == 1 and _read(board) == [1, 1, 0]
    t0 = time.monotonic()
    assert c.busy() == 1 and _read(board) == [1, 1, 1]
    assert time.monotonic() - t0 < 0.5 and c.waited_s == 0
    with pytest.raises(ValueError, match="max_threads: 1 is below this slot's share 2"):
        CoreLendingConfig(board, 2, (1, 1, 2), max_threads=1)


def test_a_new_worker_starts_idle_in_its_slot(board):
    with open(board, "r+b") as f:        # a predecessor died stepping on 2 cores in slot 1
        f.seek(1)
        f.write(b"\x02")
    a = _slot(board, 0, Recorder())
    assert a.lendable() == 2             # 4 cores, 2 held by the dead worker
    b = _slot(board, 1, Recorder())      # its replacement releases them
    assert a.lendable() == 4
    a.close()
    b.close()


def test_a_share_held_by_a_dead_borrower_is_waited_for_at_most_max_wait(board):
    with open(board, "r+b") as f:        # slot 1 (share 1) died stepping on all 4 cores
        f.seek(1)
        f.write(b"\x04")
    a = _slot(board, 0, Recorder(), max_wait_s=0.1)
    t0 = time.monotonic()
    assert a.busy() == 1                 # waited for a step that never ends, then its share
    assert time.monotonic() - t0 >= 0.1 and a.waited_s >= 0.1
    a.close()


def test_bad_board_configs_are_refused_by_field(board, tmp_path):
    with pytest.raises(ValueError, match="slot: 3 is not one of the board's 3 slots"):
        CoreLendingConfig(board, 3, (1, 1, 2))
    with pytest.raises(ValueError, match="shares: each slot needs at least one core"):
        CoreLendingConfig(board, 0, (1, 0))
    with pytest.raises(ValueError, match="num_slots: must be at least 1"):
        create_board(0, directory=str(tmp_path))
    with pytest.raises(ValueError, match="a board of 3 slots, expected 4"):
        CoreLending(CoreLendingConfig(board, 0, (1, 1, 1, 1)), set_threads=Recorder())
    remove_board(board)
    remove_board(board)                  # twice: nothing to remove, no error
    assert not os.path.exists(board)
    with pytest.raises(FileNotFoundError):
        CoreLending(CoreLendingConfig(board, 0, (1, 1, 2)), set_threads=Recorder())


def test_the_thread_count_is_the_calling_threads(board):
    """torch's OpenMP thread count is per thread: a loop sizing its own leaves the
    process's other threads (RPC, tokenizer) as they were."""
    import torch

    before = torch.get_num_threads()
    seen = {}

    def loop_thread():
        lending = CoreLending(CoreLendingConfig(board, 0, (1, 1, 2)))
        lending.busy()
        seen["n"] = torch.get_num_threads()
        lending.close()

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    assert seen["n"] == 4
    assert torch.get_num_threads() == before


# -- a disaggregated pair of engine loops on the real model -----------------------------------

PROMPT = ("The history of the printing press begins in the fifteenth century, when a "
          "goldsmith in Mainz combined a screw press with movable metal type, and")


@pytest.mark.slow
def test_a_disaggregated_pair_lends_each_other_their_cores(f32_weights, tmp_path):
    import dataclasses

    import torch

    from tandem.engine.kv.kv_connector import KVTransferParams
    from tandem.engine.llm import LLM, LLMEngine
    from tandem.engine.runtime.engine_loop import EngineLoop
    from tandem.engine.sampling.sampling_params import SamplingParams

    base = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
    prompt = base.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = base.generate([prompt], params)[0].outputs[0].token_ids
    path = create_board(2, directory=str(tmp_path))

    def make(role):
        return lambda: LLMEngine(base.config, weights_from=base.engine, kv_transport="gloo",
                                 transfer_timeout_s=10.0)

    decode = EngineLoop.build(make("decode"), "decode-0", "decode", idle_wait_s=0.02,
                              core_lending=CoreLendingConfig(path, 0, (1, 1)))
    prefill = EngineLoop.build(make("prefill"), "prefill-0", "prefill", idle_wait_s=0.02,
                               publish_deltas=False,
                               core_lending=CoreLendingConfig(path, 1, (1, 1)))
    try:
        rdv = decode.call(decode.engine.kv_connector.open_channel, "prefill-0",
                          "127.0.0.1").result(30)
        prefill.call(prefill.engine.kv_connector.connect, "decode-0", rdv,
                     decode.engine.kv_connector.layout()).result(30)
        # The prefill side takes the decode side's ticket from their channel.
        ticket = prefill.engine.kv_connector.ticket_future("decode-0", "r1", 0)
        req = decode.call(lambda: decode.engine.add_request(
            prompt, params, "r1", kv_transfer_params=KVTransferParams("prefill-0"))).result(30)[0]
        ticket = ticket.result(timeout=30)
        time.sleep(0.1)          # several idle wake-ups while it waits for the KV
        # Reserving blocks and waiting for the KV computed nothing: never busy.
        assert decode.core_lending.threads == 0
        with open(path, "rb") as f:
            assert f.read() == b"\x00\x00"
        first = dataclasses.replace(params, max_tokens=1)

        def add_prefill():
            done = prefill.track("r1")
            prefill.engine.add_request(prompt, first, "r1",
                                       kv_transfer_params=KVTransferParams("decode-0", ticket))
            return done
        prefill.call(add_prefill).result(30).result(30)
        # The prompt was prefilled on both workers' shares: the decode side was idle.
        assert prefill.core_lending.threads == 2
        assert prefill.call(torch.get_num_threads).result(30) == 2
        # That step would have given the borrowed core back between layers.
        assert prefill.engine.runner.between_layers == prefill.core_lending.give_back
        deadline = time.monotonic() + 60
        while not req.is_finished:
            assert time.monotonic() < deadline, "decode did not finish"
            time.sleep(0.01)
        assert list(req.output_token_ids) == list(want)
        # It decoded on both shares too: the prefill side was idle by then.
        assert decode.core_lending.threads == 2
        assert decode.call(torch.get_num_threads).result(30) == 2
        time.sleep(0.1)
        with open(path, "rb") as f:
            assert f.read() == b"\x00\x00"       # both idle again
    finally:
        decode.shutdown()
        prefill.shutdown()
        decode.engine.kv_connector.close()
        prefill.engine.kv_connector.close()
        remove_board(path)


@pytest.mark.slow
def test_a_step_on_borrowed_cores_gives_them_back_after_the_layer_a_peer_claims_them(
        f32_weights, tmp_path):
    """The real model's forward pass on both cores of a 2-slot board: the peer wakes
    during layer 3 and claims its core; the step goes on with one thread from layer
    4 on and the peer steps at once (it would wait 30 s for the step's end
    otherwise); the tokens are those of the step on a fixed pool."""
    import torch

    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    llm = LLM(dtype="float32", num_blocks=64, weights_from=f32_weights)
    prompt = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = llm.generate([prompt], params)[0].outputs[0].token_ids
    num_layers = len(llm.engine.model.model.layers)
    path = create_board(2, directory=str(tmp_path))
    before = torch.get_num_threads()
    lending = CoreLending(CoreLendingConfig(path, 0, (1, 1)))
    peer = CoreLending(CoreLendingConfig(path, 1, (1, 1)), set_threads=Recorder(),
                       max_wait_s=30.0)
    threads: list[int] = []         # torch's thread count as each layer ended
    claim: dict = {}

    def between_layers():
        threads.append(torch.get_num_threads())
        if len(threads) == 3:       # the peer claims its core while layer 3 runs
            claim["thread"] = threading.Thread(
                target=lambda: claim.setdefault("n", peer.busy()))
            claim["thread"].start()
            deadline = time.monotonic() + 5
            while _read(path)[1] != 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        lending.give_back()
        if len(threads) == 4:       # the peer stepped before this step went on
            claim["thread"].join(5)
            claim["alive"] = claim["thread"].is_alive()
    try:
        assert lending.busy() == 2 and lending.borrowing
        llm.engine.runner.between_layers = between_layers
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
    finally:
        llm.engine.runner.between_layers = None
        if "thread" in claim:
            claim["thread"].join(30)
        lending.close()
        peer.close()
        remove_board(path)
        torch.set_num_threads(before)
    assert claim["alive"] is False and claim["n"] == 1 and peer.waited_s < 5
    assert threads[:3] == [2, 2, 2]
    assert set(threads[3:]) == {1} and len(threads) == 4 * num_layers
    assert lending.given_back == 1
    assert list(got) == list(want)
