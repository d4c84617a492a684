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
