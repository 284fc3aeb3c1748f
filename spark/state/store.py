"""Responses, conversations and their items in one SQLite file, durable and bounded.

Durability: WAL journal with ``synchronous=FULL``, so every commit is on disk (the WAL
fsynced) before the call that made it returns; handlers commit before a response id
reaches the client, so neither a crash nor a power cut loses an id a client was given.

Bounds: rows older than ``max_age_s`` go, then the oldest rows (responses by creation,
conversations by their last use) until the stored JSON totals at most ``max_bytes``.
Eviction runs inside each write transaction; triggers keep the running total.

Isolation: every row has an owner (``owner_of(api_key)``: a hash, never the key);
every read, list and delete names one, and a row of another owner reads as absent.

The methods are synchronous and thread-safe (one connection, one lock): call them
from trio through ``AsyncStore``, which runs each in a worker thread.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

ANONYMOUS = "anonymous"  # the owner of everything when the server has no API keys
DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0
DEFAULT_MAX_BYTES = 1 << 30

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at REAL NOT NULL,
    previous_response_id TEXT, conversation_id TEXT, body TEXT NOT NULL, bytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS responses_age ON responses(created_at);
-- the few unfinished ones, found at start-up without reading every body
CREATE INDEX IF NOT EXISTS responses_unfinished ON responses(id) WHERE json_extract(body, '$.status') = 'in_progress';
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at REAL NOT NULL, used_at REAL NOT NULL,
    body TEXT NOT NULL, bytes INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS conversations_age ON conversations(used_at);
-- parent: a response (its input items) or a conversation (its items); ids do not collide
CREATE TABLE IF NOT EXISTS items (
    parent TEXT NOT NULL, position INTEGER NOT NULL, id TEXT NOT NULL, body TEXT NOT NULL,
    bytes INTEGER NOT NULL, PRIMARY KEY (parent, position));
CREATE INDEX IF NOT EXISTS items_id ON items(parent, id);
CREATE TABLE IF NOT EXISTS total (bytes INTEGER NOT NULL);
INSERT INTO total SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM total);
"""
_TRIGGERS = "".join(f"""
CREATE TRIGGER IF NOT EXISTS {t}_add AFTER INSERT ON {t} BEGIN UPDATE total SET bytes = bytes + NEW.bytes; END;
CREATE TRIGGER IF NOT EXISTS {t}_sub AFTER DELETE ON {t} BEGIN UPDATE total SET bytes = bytes - OLD.bytes; END;
CREATE TRIGGER IF NOT EXISTS {t}_upd AFTER UPDATE OF bytes ON {t}
    BEGIN UPDATE total SET bytes = bytes - OLD.bytes + NEW.bytes; END;
""" for t in ("responses", "conversations", "items")) + """
CREATE TRIGGER IF NOT EXISTS responses_items AFTER DELETE ON responses
    BEGIN DELETE FROM items WHERE parent = OLD.id; END;
CREATE TRIGGER IF NOT EXISTS conversations_items AFTER DELETE ON conversations
    BEGIN DELETE FROM items WHERE parent = OLD.id; END;
"""


def default_path() -> str:
    """``$XDG_DATA_HOME/spark/state.sqlite3``, by default ``~/.local/share/spark/state.sqlite3``: the
    state belongs to the user running the server, not to whatever directory it was started in."""
    root = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(root, "spark", "state.sqlite3")


def owner_of(api_key: str | None) -> str:
    """The owner of what a client stores: a SHA-256 of its key, or ``ANONYMOUS`` without keys."""
    if not api_key:
        return ANONYMOUS
    return hashlib.sha256(b"spark-owner\0" + api_key.encode()).hexdigest()


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Store:
    """The state of the Responses API in SQLite.

    Args:
      path: the database file (created, with its directory), or ``":memory:"``; None: ``default_path()``.
      max_age_s: rows unused for longer are evicted.
      max_bytes: total JSON kept at most; the oldest rows are evicted first.
      clock: seconds since the epoch (tests move it).
    """

    def __init__(self, path: str | None = None, *, max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, clock: Callable[[], float] = time.time):
        path = os.path.expanduser(path or default_path())
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self.max_age_s, self.max_bytes, self.clock = path, max_age_s, max_bytes, clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit is fsynced before it returns
        self._db.executescript(_SCHEMA + _TRIGGERS)
        self._fail_unfinished()

    def _fail_unfinished(self) -> None:
        """Responses left in_progress by a server that stopped mid-generation will never finish:
        they become failed, so that a client polling one learns so (one server per state file)."""
        error = {"code": "server_error", "message": "the server stopped before this response was finished"}
        with self._lock:
            rows = self._db.execute(
                "SELECT id, body FROM responses WHERE json_extract(body, '$.status') = 'in_progress'").fetchall()
            for rid, body in rows:
                response = json.loads(body)
                new = _dump({**response, "status": "failed", "error": error})
                self._db.execute("UPDATE responses SET body = ?, bytes = ? WHERE id = ?", (new, len(new), rid))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- responses ------------------------------------------------------------------

    def put_response(self, owner: str, response: dict, input_items: Sequence[dict] | None = None) -> None:
        """Insert or replace a response (``response["id"]``); ``input_items`` are stored with it once.

        Its ``previous_response_id`` and ``conversation.id`` are kept as links.
        """
        body = _dump(response)
        conversation = (response.get("conversation") or {}).get("id")
        with self._write(keep=response["id"]) as db:
            row = db.execute("SELECT owner FROM responses WHERE id = ?", (response["id"],)).fetchone()
            if row is not None and row[0] != owner:
                raise KeyError(response["id"])  # ids are random: only a bug gets here
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                       "body = excluded.body, bytes = excluded.bytes",
                       (response["id"], owner, response.get("created_at", self.clock()),
                        response.get("previous_response_id"), conversation, body, len(body)))
            if input_items is not None and row is None:
                self._add_items(db, response["id"], input_items)

    def get_response(self, owner: str, response_id: str) -> dict | None:
        with self._read() as db:
            row = db.execute("SELECT body FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_response(self, owner: str, response_id: str) -> bool:
        with self._write() as db:
            return db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount > 0

    def response_history(self, owner: str, response_id: str) -> list[dict] | None:
        """The items a response's successor continues: along the ``previous_response_id`` chain, oldest
        first, each response's input items and then its output items.

        Returns:
          None when the response is absent (or another owner's). A chain whose older links were
          evicted starts at the oldest response still stored.
        """
        chain = """WITH RECURSIVE chain(id, prev, depth) AS (
                       SELECT id, previous_response_id, 0 FROM responses WHERE id = ? AND owner = ?
                       UNION ALL SELECT r.id, r.previous_response_id, c.depth + 1
                       FROM responses r JOIN chain c ON r.id = c.prev AND r.owner = ?)
                   SELECT r.id, r.body FROM chain c JOIN responses r ON r.id = c.id ORDER BY c.depth DESC"""
        with self._read() as db:
            rows = db.execute(chain, (response_id, owner, owner)).fetchall()
            if not rows:
                return None
            out: list[dict] = []
            for rid, body in rows:
                out += [json.loads(b) for (b,) in db.execute(
                    "SELECT body FROM items WHERE parent = ? ORDER BY position", (rid,))]
                out += json.loads(body).get("output", [])
        return out

    def response_input_items(self, owner: str, response_id: str, *, after: str | None = None, limit: int = 20,
                             order: str = "desc") -> tuple[list[dict], bool] | None:
        """A page of a response's input items: ``(items, has_more)``, or None when it is absent."""
        with self._read() as db:
            found = db.execute("SELECT 1 FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).fetchone()
            if found is None:
                return None
            return self._page(db, response_id, after, limit, order)

    # -- conversations ------------------------------------------------------------------

    def create_conversation(self, owner: str, conversation: dict, items: Sequence[dict] = ()) -> None:
        """Store a new conversation object (``conversation["id"]``) and its first items."""
        body = _dump(conversation)
        with self._write(keep=conversation["id"]) as db:
            now = self.clock()
            db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?)",
                       (conversation["id"], owner, conversation.get("created_at", now), now, body, len(body)))
            self._add_items(db, conversation["id"], items)

    def get_conversation(self, owner: str, conversation_id: str) -> dict | None:
        with self._read() as db:
            row = db.execute("SELECT body FROM conversations WHERE id = ? AND owner = ?",
                             (conversation_id, owner)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_conversation(self, owner: str, conversation_id: str) -> bool:
        with self._write() as db:
            return db.execute("DELETE FROM conversations WHERE id = ? AND owner = ?",
                              (conversation_id, owner)).rowcount > 0

    def conversation_items(self, owner: str, conversation_id: str, *, after: str | None = None,
                           limit: int | None = None, order: str = "asc") -> tuple[list[dict], bool] | None:
        """A page of a conversation's items (all of them without ``limit``), or None when it is absent."""
        with self._read() as db:
            if db.execute("SELECT 1 FROM conversations WHERE id = ? AND owner = ?",
                          (conversation_id, owner)).fetchone() is None:
                return None
            return self._page(db, conversation_id, after, limit, order)

    def update_conversation(self, owner: str, conversation_id: str, metadata: dict) -> dict | None:
        """Replace a conversation's metadata; returns the conversation as it now is, or None when it is absent."""
        with self._write(keep=conversation_id) as db:
            row = db.execute("SELECT body FROM conversations WHERE id = ? AND owner = ?",
                             (conversation_id, owner)).fetchone()
            if row is None:
                return None
            conversation = {**json.loads(row[0]), "metadata": metadata}
            body = _dump(conversation)
            db.execute("UPDATE conversations SET body = ?, bytes = ?, used_at = ? WHERE id = ?",
                       (body, len(body), self.clock(), conversation_id))
        return conversation

    def conversation_item(self, owner: str, conversation_id: str, item_id: str) -> dict | None:
        """One item of a conversation, or None when it (or the conversation) is absent. The API refuses
        a repeated id (``check_new_items``); should the store hold one anyway (items added before that
        check, or by two requests at once), the first such item is the one named."""
        with self._read() as db:
            row = db.execute("SELECT i.body FROM items i JOIN conversations c ON c.id = i.parent "
                             "WHERE c.id = ? AND c.owner = ? AND i.id = ? ORDER BY i.position LIMIT 1",
                             (conversation_id, owner, item_id)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_conversation_item(self, owner: str, conversation_id: str, item_id: str) -> dict | None:
        """Remove an item from a conversation (every item of that id): the history a later turn reads
        no longer holds it. Returns the conversation, or None when it or the item is absent."""
        with self._write(keep=conversation_id) as db:
            row = db.execute("SELECT body FROM conversations WHERE id = ? AND owner = ?",
                             (conversation_id, owner)).fetchone()
            if row is None or db.execute("DELETE FROM items WHERE parent = ? AND id = ?",
                                         (conversation_id, item_id)).rowcount == 0:
                return None
            db.execute("UPDATE conversations SET used_at = ? WHERE id = ?", (self.clock(), conversation_id))
        return json.loads(row[0])

    def append_conversation_items(self, owner: str, conversation_id: str, items: Sequence[dict]) -> bool:
        """Add items at the end of a conversation; False when it is absent (deleted or evicted meanwhile)."""
        with self._write(keep=conversation_id) as db:
            found = db.execute("UPDATE conversations SET used_at = ? WHERE id = ? AND owner = ?",
                               (self.clock(), conversation_id, owner)).rowcount > 0
            if found:
                self._add_items(db, conversation_id, items)
            return found

    # -- accounting -------------------------------------------------------------------

    def total_bytes(self) -> int:
        with self._read() as db:
            return db.execute("SELECT bytes FROM total").fetchone()[0]

    # -- internals -------------------------------------------------------------------

    def _read(self):
        return _Locked(self._lock, self._db, None)

    def _write(self, keep: str | None = None):
        return _Locked(self._lock, self._db, functools.partial(self._evict, keep=keep))

    @staticmethod
    def _add_items(db: sqlite3.Connection, parent: str, items: Sequence[dict]) -> None:
        (start,) = db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM items WHERE parent = ?", (parent,)).fetchone()
        rows = []
        for i, item in enumerate(items):
            body = _dump(item)
            rows.append((parent, start + i, item["id"], body, len(body)))
        db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", rows)

    @staticmethod
    def _page(db: sqlite3.Connection, parent: str, after: str | None, limit: int | None,
              order: str) -> tuple[list[dict], bool]:
        desc = order == "desc"
        where, args = "parent = ?", [parent]
        if after is not None:
            row = db.execute("SELECT position FROM items WHERE parent = ? AND id = ?", (parent, after)).fetchone()
            if row is not None:  # an unknown cursor lists from the start, as a fresh page would
                where += " AND position < ?" if desc else " AND position > ?"
                args.append(row[0])
        sql = f"SELECT body FROM items WHERE {where} ORDER BY position {'DESC' if desc else 'ASC'}"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit + 1)  # one more tells whether there are more
        rows = [json.loads(b) for (b,) in db.execute(sql, args)]
        has_more = limit is not None and len(rows) > limit
        return rows[:limit] if limit is not None else rows, has_more

    def _evict(self, db: sqlite3.Connection, *, keep: str | None) -> None:
        """Drop what is too old, then the oldest rows while the total is over budget (never ``keep``)."""
        cutoff = self.clock() - self.max_age_s
        db.execute("DELETE FROM responses WHERE created_at < ? AND id IS NOT ?", (cutoff, keep))
        db.execute("DELETE FROM conversations WHERE used_at < ? AND id IS NOT ?", (cutoff, keep))
        while db.execute("SELECT bytes FROM total").fetchone()[0] > self.max_bytes:
            oldest = db.execute(
                "SELECT 'responses', id, created_at FROM responses WHERE id IS NOT ? "
                "UNION ALL SELECT 'conversations', id, used_at FROM conversations WHERE id IS NOT ? "
                "ORDER BY 3 LIMIT 1", (keep, keep)).fetchone()
            if oldest is None:
                break  # only `keep` is left: a single row over budget stays until the next write
            db.execute(f"DELETE FROM {oldest[0]} WHERE id = ?", (oldest[1],))


class _Locked:
    """The store's lock held around one transaction; a write commits (after eviction) or rolls back."""

    def __init__(self, lock: threading.Lock, db: sqlite3.Connection, before_commit):
        self._lock, self._db, self._before_commit = lock, db, before_commit

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN IMMEDIATE" if self._before_commit else "BEGIN")
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is None:
                if self._before_commit is not None:
                    self._before_commit(self._db)
                self._db.execute("COMMIT")
        finally:
            if self._db.in_transaction:  # an error above, or in the block
                self._db.execute("ROLLBACK")
            self._lock.release()


class AsyncStore:
    """``Store``'s methods as coroutines that run in a worker thread (SQLite blocks on fsync)."""

    def __init__(self, store: Store):
        self.sync = store

    def __getattr__(self, name: str):
        method = getattr(self.sync, name)

        async def call(*args, **kwargs):
            return await trio.to_thread.run_sync(functools.partial(method, *args, **kwargs))

        return call
