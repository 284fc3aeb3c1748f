"""The SQLite store: round trips, owners, history chains, pages, eviction, durability settings."""

from __future__ import annotations

import time

import trio

from spark.state import ANONYMOUS, AsyncStore, Store, owner_of

A, B = owner_of("key-a"), owner_of("key-b")


def _response(rid: str, *, prev: str | None = None, text: str = "hi", created_at: float | None = None, **kw) -> dict:
    return {"id": rid, "object": "response", "created_at": time.time() if created_at is None else created_at,
            "previous_response_id": prev,
            "output": [{"type": "message", "id": f"msg_{rid}", "role": "assistant",
                        "content": [{"type": "output_text", "text": text}]}], **kw}


def _item(iid: str, text: str = "x") -> dict:
    return {"type": "message", "id": iid, "role": "user", "content": [{"type": "input_text", "text": text}]}


def _store(tmp_path, **kw) -> Store:
    return Store(str(tmp_path / "state.sqlite3"), **kw)


def test_owner_is_a_hash_never_the_key():
    assert owner_of(None) == owner_of("") == ANONYMOUS
    assert A != B and len(A) == 64 and "key-a" not in A


def test_response_round_trip_update_and_isolation(tmp_path):
    store = _store(tmp_path)
    store.put_response(A, _response("resp_1", status="in_progress"), [_item("m1")])
    store.put_response(A, _response("resp_1", status="completed"), [_item("ignored")])  # items stored once
    assert store.get_response(A, "resp_1")["status"] == "completed"
    assert store.get_response(B, "resp_1") is None and store.response_input_items(B, "resp_1") is None
    assert [i["id"] for i in store.response_input_items(A, "resp_1")[0]] == ["m1"]
    assert not store.delete_response(B, "resp_1") and store.get_response(A, "resp_1") is not None
    assert store.delete_response(A, "resp_1") and store.get_response(A, "resp_1") is None
    assert not store.delete_response(A, "resp_1")
    assert store.total_bytes() == 0  # the items went with their response


def test_history_walks_the_chain_oldest_first(tmp_path):
    store = _store(tmp_path)
    store.put_response(A, _response("r1", text="one"), [_item("u1")])
    store.put_response(A, _response("r2", prev="r1", text="two"), [_item("u2")])
    store.put_response(A, _response("r3", prev="r2", text="three"), [_item("u3")])
    assert [i["id"] for i in store.response_history(A, "r3")] == ["u1", "msg_r1", "u2", "msg_r2", "u3", "msg_r3"]
    assert [i["id"] for i in store.response_history(A, "r2")] == ["u1", "msg_r1", "u2", "msg_r2"]
    assert store.response_history(B, "r3") is None
    store.delete_response(A, "r1")  # a broken chain starts at the oldest response still there
    assert [i["id"] for i in store.response_history(A, "r3")] == ["u2", "msg_r2", "u3", "msg_r3"]


def test_item_pages(tmp_path):
    store = _store(tmp_path)
    store.put_response(A, _response("r"), [_item(f"i{k}") for k in range(5)])
    ids = lambda page: [i["id"] for i in page[0]]  # noqa: E731
    assert ids(store.response_input_items(A, "r")) == ["i4", "i3", "i2", "i1", "i0"]  # desc by default
    page = store.response_input_items(A, "r", limit=2, order="asc")
    assert ids(page) == ["i0", "i1"] and page[1] is True
    page = store.response_input_items(A, "r", limit=2, order="asc", after="i1")
    assert ids(page) == ["i2", "i3"] and page[1] is True
    page = store.response_input_items(A, "r", limit=2, order="asc", after="i3")
    assert ids(page) == ["i4"] and page[1] is False
    assert ids(store.response_input_items(A, "r", limit=10, after="i2")) == ["i1", "i0"]


def test_conversations(tmp_path):
    store = _store(tmp_path)
    store.create_conversation(A, {"id": "conv_1", "object": "conversation", "metadata": {"k": "v"}}, [_item("c0")])
    assert store.append_conversation_items(A, "conv_1", [_item("c1"), _item("c2")])
    assert not store.append_conversation_items(B, "conv_1", [_item("evil")])
    assert [i["id"] for i in store.conversation_items(A, "conv_1")[0]] == ["c0", "c1", "c2"]
    assert store.get_conversation(A, "conv_1")["metadata"] == {"k": "v"}
    assert store.get_conversation(B, "conv_1") is None and store.conversation_items(B, "conv_1") is None
    assert not store.delete_conversation(B, "conv_1")
    assert store.delete_conversation(A, "conv_1") and store.get_conversation(A, "conv_1") is None
    assert not store.append_conversation_items(A, "conv_1", [_item("late")])
    assert store.total_bytes() == 0


def test_conversation_metadata_is_replaced(tmp_path):
    now = [1000.0]
    store = _store(tmp_path, clock=lambda: now[0])
    store.create_conversation(A, {"id": "conv_1", "object": "conversation", "metadata": {"k": "v"}})
    before = store.total_bytes()
    now[0] = 1010.0
    updated = store.update_conversation(A, "conv_1", {"topic": "a longer value"})
    assert updated == {"id": "conv_1", "object": "conversation", "metadata": {"topic": "a longer value"}}
    assert store.get_conversation(A, "conv_1") == updated
    assert store.total_bytes() > before  # the byte count follows the body
    assert store._db.execute("SELECT used_at FROM conversations").fetchone()[0] == 1010.0  # an update is a use
    assert store.update_conversation(B, "conv_1", {"evil": "1"}) is None
    assert store.update_conversation(A, "conv_missing", {}) is None
    assert store.get_conversation(A, "conv_1")["metadata"] == {"topic": "a longer value"}


def test_conversation_items_are_read_and_deleted_one_by_one(tmp_path):
    store = _store(tmp_path)
    store.create_conversation(A, {"id": "conv_1", "object": "conversation"}, [_item("c0"), _item("c1", "one")])
    store.create_conversation(A, {"id": "conv_2", "object": "conversation"}, [_item("c1", "other")])
    assert store.conversation_item(A, "conv_1", "c1") == _item("c1", "one")
    assert store.conversation_item(A, "conv_2", "c1") == _item("c1", "other")  # items belong to their conversation
    assert store.conversation_item(B, "conv_1", "c1") is None
    assert store.conversation_item(A, "conv_1", "nope") is None
    assert store.delete_conversation_item(B, "conv_1", "c1") is None
    assert store.delete_conversation_item(A, "conv_1", "c1") == {"id": "conv_1", "object": "conversation"}
    assert store.delete_conversation_item(A, "conv_1", "c1") is None  # gone already
    assert store.conversation_item(A, "conv_1", "c1") is None
    assert [i["id"] for i in store.conversation_items(A, "conv_1")[0]] == ["c0"]
    assert store.conversation_item(A, "conv_2", "c1") is not None
    store.append_conversation_items(A, "conv_1", [_item("c2")])  # after a gap, the order still holds
    assert [i["id"] for i in store.conversation_items(A, "conv_1")[0]] == ["c0", "c2"]
    store.delete_conversation(A, "conv_1")
    store.delete_conversation(A, "conv_2")
    assert store.total_bytes() == 0


def test_eviction_by_age_and_by_size_oldest_first(tmp_path):
    now = [1000.0]
    store = _store(tmp_path, max_age_s=100, max_bytes=10_000, clock=lambda: now[0])
    store.put_response(A, _response("old", created_at=1000.0))
    now[0] = 1050.0
    store.create_conversation(A, {"id": "conv", "created_at": 1050.0})
    now[0] = 1101.0
    store.put_response(A, _response("new", created_at=1101.0))  # "old" is now 101 s old
    assert store.get_response(A, "old") is None and store.get_conversation(A, "conv") is not None
    big = "x" * 3000
    for k in range(5):  # ~3.2 kB each: only three fit beside the rest
        store.put_response(A, _response(f"big{k}", text=big, created_at=1101.0 + k))
    assert store.total_bytes() <= 10_000
    kept = [k for k in ("new", "big0", "big1", "big2", "big3", "big4") if store.get_response(A, k)]
    assert kept == ["big2", "big3", "big4"]  # oldest first: "new", the conversation (used at 1050), big0, big1
    assert store.get_conversation(A, "conv") is None
    store.put_response(A, _response("huge", text="y" * 20_000, created_at=1200.0))
    assert store.get_response(A, "huge") is not None  # the row just written is never evicted by its own write


def test_durable_settings_and_a_second_connection_sees_commits(tmp_path):
    store = _store(tmp_path)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.put_response(A, _response("r1"))
    other = _store(tmp_path)  # as a restarted server would open it
    assert other.get_response(A, "r1")["id"] == "r1"
    store.close()
    other.close()


def test_async_store_runs_in_threads(tmp_path):
    async def main():
        store = AsyncStore(_store(tmp_path))
        async with trio.open_nursery() as nursery:
            for k in range(20):
                nursery.start_soon(store.put_response, A, _response(f"r{k}"))
        assert all([await store.get_response(A, f"r{k}") for k in range(20)])
        store.sync.close()

    trio.run(main)


def test_responses_a_stopped_server_left_in_progress_are_failed_at_the_next_start(tmp_path):
    """Issue 27: a response cut right after response.created stayed in_progress forever."""
    store = _store(tmp_path)
    store.put_response("o", _response("resp_cut", status="in_progress"))
    store.put_response("o", _response("resp_done", status="completed"))
    store.close()
    store = _store(tmp_path)
    cut, done = store.get_response("o", "resp_cut"), store.get_response("o", "resp_done")
    assert cut["status"] == "failed" and "stopped" in cut["error"]["message"]
    assert cut["output"] == _response("resp_cut")["output"]  # nothing else of it changed
    assert done["status"] == "completed" and "error" not in done
    store.close()
