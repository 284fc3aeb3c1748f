"""Crash durability: what the server acknowledged survives ``kill -9``, byte for byte.

What it proves: ``--workers`` clients loop over stored writes against a server with a SQLite state
file (``SPARK_STATE_PATH``): ``POST /v1/responses`` with ``store: true`` and a tiny
``max_output_tokens``, ``POST /v1/conversations`` with items, and ``POST /v1/conversations/{id}/items``
(each client appends to the conversations it created, in every round). After each acknowledged
(200) write the client reads the object back (``GET /v1/responses/{id}``; ``GET /v1/conversations/{id}``
and every page of its items) and keeps the raw bodies. At a random moment (once ``--min-acked``
writes are acknowledged, then ``--max-kill-s`` at most; every ``--aim-every``-th round instead 0-3 ms
after an items write went out, so that one is in flight) the server's whole session gets SIGKILL;
it restarts on the same state file and every object is read again. ``--rounds`` kill rounds; each
restart checks everything of every earlier round.

Pass criteria, after every restart:
  * every response acknowledged before any kill is readable (200) and its GET body is byte-identical
    to the one read before the kill (or, when the kill came between the write and that read, its
    JSON equals the POST's);
  * every acknowledged conversation's GET body is byte-identical;
  * its items listing is byte-identical, unless a write to it was in flight at the kill; then every
    acknowledged item is there, unchanged, and what was listed before is its prefix.

Run: ``python scripts/accept/crash_durability.py [--rounds 3] [--workers 3]``; prints one JSON summary
and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import threading
import time

import attrs
import httpx

from harness import SparkServer, round3, verdict

MODEL = "sparky"
KEY = "sk-durable-" + secrets.token_hex(8)


@attrs.define(eq=False)
class Conversation:
    id: str
    owner: int  # the worker that writes to it
    created: dict  # the POST's body
    body: bytes = b""  # GET /v1/conversations/{id}, as last read
    items: list[bytes] | None = None  # the pages of GET .../items?order=asc, as last read
    created_texts: list[str] = attrs.Factory(list)  # the texts of the items it was created with
    acked_items: dict[str, dict] = attrs.Factory(dict)  # item id -> the item, from each acknowledged POST
    dirty: bool = False  # a write went out after ``items`` was read (in flight or not read back yet)


@attrs.define(eq=False)
class Ledger:
    """What the server acknowledged, and what it answered when read back."""

    responses: dict[str, dict] = attrs.Factory(dict)  # id -> the POST's body
    response_bodies: dict[str, bytes] = attrs.Factory(dict)  # id -> GET body, read before the kill
    conversations: dict[str, Conversation] = attrs.Factory(dict)
    writes: int = 0
    failed_writes: list[str] = attrs.Factory(list)  # non-200 answers while the server was up
    lock: threading.Lock = attrs.Factory(threading.Lock)
    aim: threading.Event = attrs.Factory(threading.Event)  # set: the next conversation write sets ``aimed``
    aimed: threading.Event = attrs.Factory(threading.Event)


def item_pages(http: httpx.Client, cid: str) -> list[bytes]:
    pages, after = [], None
    while True:
        r = http.get(f"/v1/conversations/{cid}/items", params={"order": "asc", "limit": 100, **({"after": after} if after else {})})
        r.raise_for_status()
        pages.append(r.content)
        page = r.json()
        if not page["has_more"]:
            return pages
        after = page["last_id"]


def items_of(pages: list[bytes]) -> list[dict]:
    return [item for page in pages for item in json.loads(page)["data"]]


def text_of(item: dict) -> str:
    content = item.get("content")
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content or [])


def dumped(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def message(rng: random.Random, role: str = "user") -> dict:
    return {"type": "message", "role": role, "content": f"note {secrets.token_hex(4)} " + "x" * rng.randint(1, 300)}


def worker(index: int, url: str, ledger: Ledger, stop: threading.Event, rng: random.Random) -> None:
    mine = [c for c in ledger.conversations.values() if c.owner == index]
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        while not stop.is_set():
            op = rng.choice(("response", "response", "conversation", "items", "items"))
            if op == "items" and not mine:
                op = "conversation"
            try:
                if op == "response":
                    r = http.post("/v1/responses", json={"model": MODEL, "input": f"Say {rng.randint(0, 999)}.",
                                                         "store": True, "max_output_tokens": rng.randint(1, 4)})
                    if r.status_code != 200:
                        ledger.failed_writes.append(f"responses {r.status_code} {r.text[:200]}")
                        continue
                    rid = r.json()["id"]
                    with ledger.lock:
                        ledger.responses[rid] = r.json()
                        ledger.writes += 1
                    ledger.response_bodies[rid] = http.get(f"/v1/responses/{rid}").raise_for_status().content
                elif op == "conversation":
                    items = [message(rng), message(rng, "assistant")]
                    r = http.post("/v1/conversations", json={"items": items, "metadata": {"n": str(len(mine))}})
                    if r.status_code != 200:
                        ledger.failed_writes.append(f"conversations {r.status_code} {r.text[:200]}")
                        continue
                    conv = Conversation(r.json()["id"], index, r.json(), created_texts=[i["content"] for i in items],
                                        dirty=True)
                    with ledger.lock:
                        ledger.conversations[conv.id] = conv
                        ledger.writes += 1
                    mine.append(conv)
                    conv.body = http.get(f"/v1/conversations/{conv.id}").raise_for_status().content
                    conv.items, conv.dirty = item_pages(http, conv.id), False
                else:
                    conv = rng.choice(mine)
                    conv.dirty = True
                    if ledger.aim.is_set():
                        ledger.aimed.set()
                    r = http.post(f"/v1/conversations/{conv.id}/items",
                                  json={"items": [message(rng) for _ in range(rng.randint(1, 3))]})
                    if r.status_code != 200:
                        ledger.failed_writes.append(f"items {r.status_code} {r.text[:200]}")
                        continue
                    conv.acked_items.update((item["id"], item) for item in r.json()["data"])
                    with ledger.lock:
                        ledger.writes += 1
                    conv.items, conv.dirty = item_pages(http, conv.id), False
            except httpx.HTTPError:
                return  # the server is gone


def verify(url: str, ledger: Ledger) -> dict:
    """Read everything the ledger holds; the problems found. Objects whose state was uncertain at the
    kill (a write in flight) are read again as the new baseline for the next round."""
    problems: list[str] = []
    identical = {"responses": 0, "responses_by_post_json": 0, "conversations": 0, "item_listings": 0,
                 "item_listings_with_write_in_flight": 0}
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for rid, posted in ledger.responses.items():
            r = http.get(f"/v1/responses/{rid}")
            if r.status_code != 200:
                problems.append(f"response {rid}: {r.status_code}")
            elif rid in ledger.response_bodies:
                if r.content == ledger.response_bodies[rid]:
                    identical["responses"] += 1
                else:
                    problems.append(f"response {rid}: body differs: {ledger.response_bodies[rid][:300]!r} -> {r.content[:300]!r}")
            elif r.json() == posted:
                identical["responses_by_post_json"] += 1
                ledger.response_bodies[rid] = r.content
            else:
                problems.append(f"response {rid}: JSON differs from the POST's: {dumped(posted)[:300]} -> {r.text[:300]}")
        for conv in ledger.conversations.values():
            r = http.get(f"/v1/conversations/{conv.id}")
            if r.status_code != 200:
                problems.append(f"conversation {conv.id}: {r.status_code}")
                continue
            if conv.body and r.content != conv.body:
                problems.append(f"conversation {conv.id}: body differs: {conv.body[:300]!r} -> {r.content[:300]!r}")
            elif not conv.body and r.json() != conv.created:
                problems.append(f"conversation {conv.id}: JSON differs from the POST's")
            else:
                identical["conversations"] += 1
            conv.body = r.content
            pages = item_pages(http, conv.id)
            if not conv.dirty:
                if pages == conv.items:
                    identical["item_listings"] += 1
                else:
                    problems.append(f"items of {conv.id}: listing differs: {conv.items!r:.300} -> {pages!r:.300}")
            else:
                now = items_of(pages)
                before = [dumped(i) for i in items_of(conv.items or [])]
                by_id = {i["id"]: i for i in now}
                lost = [iid for iid, item in conv.acked_items.items() if iid not in by_id or by_id[iid] != item]
                if lost:
                    problems.append(f"items of {conv.id}: acknowledged items lost or changed: {lost}")
                elif [text_of(i) for i in now[:len(conv.created_texts)]] != conv.created_texts:
                    problems.append(f"items of {conv.id}: the items it was created with are not its first")
                elif [dumped(i) for i in now[:len(before)]] != before:
                    problems.append(f"items of {conv.id}: what was listed before the kill is not a prefix now")
                else:
                    identical["item_listings_with_write_in_flight"] += 1
            conv.items, conv.dirty = pages, False
    return {"problems": problems, "checked": identical}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="kill -9 rounds")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--min-acked", type=int, default=20, help="writes acknowledged in a round before the kill")
    parser.add_argument("--max-kill-s", type=float, default=8.0, help="then the kill comes after up to this long")
    parser.add_argument("--aim-every", type=int, default=3,
                        help="every this many rounds, the kill comes 0-3 ms after an items write is sent (0: never)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    ledger = Ledger()
    rounds = []
    server = SparkServer({"SPARK_API_KEYS": KEY}, log_level="WARNING")
    try:
        server.start()
        for n in range(args.rounds):
            stop = threading.Event()
            threads = [threading.Thread(target=worker, args=(i, server.url, ledger, stop, random.Random(rng.random())))
                       for i in range(args.workers)]
            writes0, t0 = ledger.writes, time.monotonic()
            for t in threads:
                t.start()
            while ledger.writes - writes0 < args.min_acked and time.monotonic() - t0 < 300:
                time.sleep(0.05)
            aimed = args.aim_every and (n + 1) % args.aim_every == 0
            if aimed:  # kill within milliseconds of an items write going out: while SQLite commits it
                ledger.aimed.clear()
                ledger.aim.set()
                ledger.aimed.wait(timeout=60)
                ledger.aim.clear()
                time.sleep(rng.uniform(0, 0.003))
            else:
                time.sleep(rng.uniform(0, args.max_kill_s))
            server.kill()  # SIGKILL, mid-loop
            killed_after = time.monotonic() - t0
            stop.set()
            for t in threads:
                t.join(timeout=60)
            server.start()  # the same state file
            result = verify(server.url, ledger)
            rounds.append({"round": n + 1, "kill": "at an items write" if aimed else "at random", "killed_after_s": round3(killed_after), "writes": ledger.writes - writes0,
                           "restart_s": round3(server.ready_s), **result})
        alive = server.proc.poll() is None
        log_errors = [line for line in server.log_text().splitlines() if "Traceback" in line or " ERROR " in line]
    finally:
        server.close()

    problems = [p for r in rounds for p in r["problems"]]
    summary = {
        "script": "crash_durability", "seed": seed, "rounds": len(rounds), "workers": args.workers,
        "acknowledged": {"writes": ledger.writes, "responses": len(ledger.responses),
                         "conversations": len(ledger.conversations),
                         "items": sum(len(c.acked_items) for c in ledger.conversations.values())},
        "per_round": [{**r, "problems": r["problems"][:5], "problem_count": len(r["problems"])} for r in rounds],
        "failed_writes": ledger.failed_writes[:5], "failed_write_count": len(ledger.failed_writes),
        "server_log_errors": log_errors[:5],
    }
    checks = {
        "nothing_lost_or_changed": not problems,
        "every_round_wrote": all(r["writes"] >= args.min_acked for r in rounds),
        "no_failed_writes": not ledger.failed_writes,
        "server_alive_at_end": alive,
    }
    return verdict(summary, checks)


if __name__ == "__main__":
    sys.exit(main())
