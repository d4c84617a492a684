"""The request journal, in process and in Redis: exact entries, finish, and ownership."""

from __future__ import annotations

import time

import pytest

from tandem.control.journal import InProcessJournal, JournalEntry, RedisJournal
from tandem.control.state import ClusterState

RECORD = {"prompt_ids": [1, 2, 3], "sampling": {"temperature": 0.7, "max_tokens": 32, "stop": ["\n"]},
          "priority": 2}


@pytest.fixture(params=["in_process", "redis"])
def journal(request):
    if request.param == "in_process":
        return InProcessJournal()
    return RedisJournal(request.getfixturevalue("state"))


def test_begin_assign_append_load_exact(journal):
    journal.begin("r1", "router-a", RECORD)
    assert journal.load("r1") == JournalEntry("r1", "router-a", RECORD, [], None, 0)
    journal.assign("r1", "decode-0", 1)
    journal.append_tokens("r1", [10, 11])
    journal.append_tokens("r1", [])
    journal.append_tokens("r1", (12,))
    assert journal.load("r1") == JournalEntry("r1", "router-a", RECORD, [10, 11, 12], "decode-0", 1)
    journal.assign("r1", "decode-1", 2)
    journal.append_tokens("r1", list(range(2500)))       # more than one script chunk
    entry = journal.load("r1")
    assert (entry.worker_id, entry.attempt) == ("decode-1", 2)
    assert entry.token_ids == [10, 11, 12, *range(2500)]


def test_load_returns_a_copy(journal):
    journal.begin("r1", "router-a", RECORD)
    journal.load("r1").token_ids.append(99)
    journal.load("r1").record["priority"] = 0
    assert journal.load("r1") == JournalEntry("r1", "router-a", RECORD, [], None, 0)


def test_finish_removes_and_unknown_requests(journal):
    journal.begin("r1", "router-a", RECORD)
    journal.append_tokens("r1", [5])
    journal.finish("r1")
    journal.finish("r1")
    assert journal.load("r1") is None
    assert journal.active() == []
    with pytest.raises(KeyError, match="r1"):
        journal.append_tokens("r1", [6])
    with pytest.raises(KeyError, match="r1"):
        journal.assign("r1", "decode-0", 1)


def test_begin_again_starts_over(journal):
    journal.begin("r1", "router-a", RECORD)
    journal.assign("r1", "decode-0", 1)
    journal.append_tokens("r1", [5])
    journal.begin("r1", "router-b", {"prompt_ids": [4]})
    assert journal.load("r1") == JournalEntry("r1", "router-b", {"prompt_ids": [4]}, [], None, 0)
    assert journal.active("router-a") == []
    assert journal.active("router-b") == ["r1"]


def test_active_per_router(journal):
    for rid, router in [("r3", "router-a"), ("r1", "router-b"), ("r2", "router-a")]:
        journal.begin(rid, router, RECORD)
    assert journal.active("router-a") == ["r2", "r3"]
    assert journal.active("router-b") == ["r1"]
    assert journal.active("router-c") == []
    assert journal.active() == ["r1", "r2", "r3"]
    journal.finish("r3")
    assert journal.active("router-a") == ["r2"]
    assert journal.active() == ["r1", "r2"]


def test_redis_entries_expire_after_their_last_write(state):
    journal = RedisJournal(state, ttl_s=1.0)
    journal.begin("r1", "router-a", RECORD)
    journal.begin("r2", "router-a", RECORD)
    time.sleep(0.6)
    journal.append_tokens("r2", [1])              # a write pushes the expiry out
    time.sleep(0.6)
    assert journal.load("r1") is None
    assert journal.load("r2").token_ids == [1]
    assert journal.active("router-a") == ["r2"]
    assert state.redis.smembers(state.key("journal_router", "router-a")) == {"r2"}   # pruned
    assert journal.active() == ["r2"]


def test_redis_journal_is_shared_between_routers(redis_server, state):
    other = ClusterState(redis_server.url)
    RedisJournal(state).begin("r1", "router-a", RECORD)
    RedisJournal(state).append_tokens("r1", [7, 8])
    assert RedisJournal(other).load("r1").token_ids == [7, 8]
    assert RedisJournal(other).active("router-a") == ["r1"]
    other.close()


# -- write_batch and the write-behind writer ------------------------------------------------------


def test_write_batch_applies_in_order_and_reports_each_op(journal):
    journal.begin("gone", "router-a", RECORD)
    journal.finish("gone")
    results = journal.write_batch([
        ("begin", "r1", "router-a", RECORD), ("assign", "r1", "decode-0", 1),
        ("append_tokens", "r1", [7, 8]), ("append_tokens", "r1", []),
        ("append_tokens", "gone", [1]), ("assign", "gone", "decode-0", 1),
        ("begin", "r2", "router-a", RECORD), ("finish", "r2")])
    assert [type(r).__name__ if r is not None else None for r in results] == \
        [None, None, None, None, "KeyError", "KeyError", None, None]
    assert journal.load("r1") == JournalEntry("r1", "router-a", RECORD, [7, 8], "decode-0", 1)
    assert journal.load("r2") is None and journal.load("gone") is None


class _CountingJournal(InProcessJournal):
    """An in-process journal that records each batch it is given."""

    def __init__(self):
        super().__init__()
        self.batches: list[list[tuple]] = []

    def write_batch(self, ops):
        self.batches.append([tuple(op[:2]) + (list(op[2]) if op[0] == "append_tokens" else (),)
                             for op in ops])
        return super().write_batch(ops)


def test_writer_merges_appends_and_keeps_order():
    """Appends of one request queued while a batch is in flight merge into one op;
    flush() returns once everything submitted before it is applied."""
    import asyncio

    from tandem.control.journal import JournalWriter

    journal = _CountingJournal()

    async def main():
        w = JournalWriter(journal, "router-a", lambda rid: None)
        w.submit("begin", "r1", "router-a", RECORD)
        w.submit("assign", "r1", "decode-0", 1)
        for t in range(50):                  # per-token submits, no await between them
            w.submit("append_tokens", "r1", [t])
            w.submit("append_tokens", "r2", [t])   # never begun: KeyError, no rewrite
        await w.flush()
        entry = journal.load("r1")
        w.submit("append_tokens", "r1", [50])
        w.submit("finish", "r1")
        await w.close()
        return entry, w.batches

    entry, batches = asyncio.run(main())
    assert entry == JournalEntry("r1", "router-a", RECORD, list(range(50)), "decode-0", 1)
    assert journal.load("r1") is None
    # 102 submits before the first flush became one batch of 4 ops.
    assert journal.batches[0] == [("begin", "r1", ()), ("assign", "r1", ()),
                                  ("append_tokens", "r1", list(range(50))),
                                  ("append_tokens", "r2", list(range(50)))]
    assert batches == len(journal.batches) == 2


def test_writer_rewrites_an_entry_the_state_lost(redis_server, state):
    """The cluster state forgot a running request (Redis flushed): the writer writes
    the whole entry again from the router's own record and tokens, without
    duplicating tokens still queued."""
    import asyncio

    from tandem.control.journal import JournalWriter

    journal = RedisJournal(state)
    tokens: list[int] = []

    async def main():
        w = JournalWriter(journal, "router-a", lambda rid: (RECORD, list(tokens)))
        w.submit("begin", "r1", "router-a", RECORD)
        tokens.extend([1, 2])
        w.submit("append_tokens", "r1", [1, 2])
        await w.flush()
        state.redis.flushall()
        tokens.append(3)
        w.submit("append_tokens", "r1", [3])      # finds the entry gone
        await w.flush()
        tokens.append(4)
        w.submit("append_tokens", "r1", [4])
        await w.flush()
        await w.flush()                           # the rewrite, queued by the failed batch
        await w.close()

    asyncio.run(main())
    entry = journal.load("r1")
    assert entry is not None and entry.record == RECORD
    assert entry.token_ids == [1, 2, 3, 4]
