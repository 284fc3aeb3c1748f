"""Isolation: what one API key stored, another cannot see or touch, and no key is written anywhere.

What it proves: on a server with keys A and B (``SPARK_API_KEYS``), a state file, an activity log and
a usage file, A stores responses (plain, streamed, chained by ``previous_response_id``, in a
conversation) and conversations with items, and A and B use chat, completions and Anthropic
messages (Bearer and ``x-api-key``); a wrong key W is tried too. Then B, for each of A's objects:
``GET`` / ``DELETE /v1/responses/{id}``, ``GET .../input_items``, ``POST /v1/responses`` with
``previous_response_id`` (plain and streamed) and with ``conversation``, ``GET`` / ``DELETE
/v1/conversations/{id}``, ``GET`` / ``POST .../items``.

Pass criteria:
  * every one of B's calls is 404, and its body is the one an id that exists nowhere gets (B cannot
    even learn that the id exists);
  * afterwards every body A reads back is byte-identical to what A read before B's attempts;
  * no key (A, B, W: the whole key, its random part, or 12 characters of it) and no
    ``Authorization`` value is in the server's stdout and stderr (``--log-level``, DEBUG by default),
    in any file of its state directory (the SQLite file with its -wal and -shm, read raw, while it
    runs and after it stopped), in the activity log or the usage file, or in /metrics.

Run: ``python scripts/accept/isolation.py [--log-level DEBUG] [--rounds 2]``; prints one JSON summary and
exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import secrets
import sys

import httpx

from harness import SparkServer, verdict

MODEL = "sparky"


def new_key(name: str) -> tuple[str, str]:
    """A key and its random part."""
    secret = secrets.token_hex(16)
    return f"sk-iso-{name}-{secret}", secret


KEYS = {name: new_key(name) for name in "ABW"}
A, B, W = (KEYS[n][0] for n in "ABW")


def needles() -> dict[str, bytes]:
    """What must appear nowhere: each key whole, its random part, the first and last 12 characters
    of that part, and the Authorization values that carried it."""
    out = {}
    for name, (key, secret) in KEYS.items():
        out.update({f"{name}:key": key, f"{name}:secret": secret, f"{name}:head12": secret[:12],
                    f"{name}:tail12": secret[-12:], f"{name}:authorization": f"Bearer {key}"})
    return {label: value.encode() for label, value in out.items()}


def leaks(label: str, data: bytes) -> list[str]:
    found = []
    for what, needle in needles().items():
        for encoded in (needle, needle.decode().encode("utf-16-le")):
            if encoded.lower() in data.lower():
                found.append(f"{what} in {label}")
    return found


def scan_files(directory: pathlib.Path, logs: bool) -> tuple[list[str], dict[str, int]]:
    """Every file of the server's directory, read raw (the logs only when ``logs``)."""
    found, sizes = [], {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and (logs or not path.name.startswith("server-")):
            data = path.read_bytes()
            sizes[path.name] = len(data)
            found += leaks(path.name, data)
    return found, sizes


def stored_by_a(http: httpx.Client) -> dict[str, str]:
    """A's objects; returns their ids."""
    a = {"Authorization": f"Bearer {A}"}
    r1 = http.post("/v1/responses", headers=a, json={"model": MODEL, "input": "A's secret note", "max_output_tokens": 8})
    r1.raise_for_status()
    rid1 = r1.json()["id"]
    rid2 = None
    with http.stream("POST", "/v1/responses", headers=a,
                     json={"model": MODEL, "input": "and more", "max_output_tokens": 8, "stream": True,
                           "previous_response_id": rid1}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and rid2 is None:
                rid2 = json.loads(line[6:])["response"]["id"]
    conv = http.post("/v1/conversations", headers=a, json={"items": [
        {"type": "message", "role": "user", "content": "A's conversation"}], "metadata": {"owner": "A"}})
    conv.raise_for_status()
    cid = conv.json()["id"]
    http.post(f"/v1/conversations/{cid}/items", headers=a, json={"items": [
        {"type": "message", "role": "assistant", "content": "noted"}]}).raise_for_status()
    r3 = http.post("/v1/responses", headers=a, json={"model": MODEL, "input": "in the conversation",
                                                     "max_output_tokens": 8, "conversation": cid})
    r3.raise_for_status()
    return {"response": rid1, "chained": rid2, "in_conversation": r3.json()["id"], "conversation": cid}


def other_traffic(http: httpx.Client) -> dict[str, int]:
    """Chat, completions and Anthropic messages by A and B (so that the activity log and the usage file
    have lines of both), and W's refused tries."""
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    statuses = {}
    for name, key in (("A", A), ("B", B), ("W", W)):
        bearer = {"Authorization": f"Bearer {key}"}
        statuses[f"{name} chat"] = http.post("/v1/chat/completions", headers=bearer, json=chat).status_code
        statuses[f"{name} stream"] = http.post("/v1/chat/completions", headers=bearer,
                                               json={**chat, "stream": True}).status_code
        statuses[f"{name} completions"] = http.post("/v1/completions", headers=bearer, json={
            "model": MODEL, "max_tokens": 4, "prompt": "The"}).status_code
        statuses[f"{name} messages"] = http.post("/v1/messages", headers={"x-api-key": key,
                                                 "anthropic-version": "2023-06-01"}, json=anthropic).status_code
        statuses[f"{name} models"] = http.get("/v1/models", headers=bearer).status_code
    return statuses


def a_view(http: httpx.Client, ids: dict[str, str]) -> dict[str, bytes]:
    """Every body A can read of its objects."""
    a = {"Authorization": f"Bearer {A}"}
    view = {}
    for label in ("response", "chained", "in_conversation"):
        rid = ids[label]
        view[f"GET {label}"] = http.get(f"/v1/responses/{rid}", headers=a).content
        view[f"GET {label} input_items"] = http.get(f"/v1/responses/{rid}/input_items", headers=a).content
    cid = ids["conversation"]
    view["GET conversation"] = http.get(f"/v1/conversations/{cid}", headers=a).content
    view["GET conversation items"] = http.get(f"/v1/conversations/{cid}/items", headers=a).content
    return view


def b_attempts(http: httpx.Client, ids: dict[str, str], fake: dict[str, str]) -> list[dict]:
    """B's calls on A's ids and on ids that exist nowhere: their statuses and bodies."""
    b = {"Authorization": f"Bearer {B}"}
    out = []

    def call(label: str, method: str, path: str, body: dict | None = None) -> dict:
        r = http.request(method, path, headers=b, json=body)
        return {"call": label, "status": r.status_code, "body": r.text}

    def both(label: str, method: str, path: str, body=None, kind: str = "response") -> None:
        real = ids[kind] if kind == "conversation" else ids[label.split()[0]]
        fake_id = fake[kind]
        mine = call(label, method, path.format(real), body and json.loads(json.dumps(body).replace("{id}", real)))
        nowhere = call(label, method, path.format(fake_id),
                       body and json.loads(json.dumps(body).replace("{id}", fake_id)))
        mine["nowhere_status"] = nowhere["status"]
        mine["same_as_nowhere"] = mine["body"].replace(real, "{id}") == nowhere["body"].replace(fake_id, "{id}")
        out.append(mine)

    for label in ("response", "chained", "in_conversation"):
        both(f"{label} GET", "GET", "/v1/responses/{}")
        both(f"{label} input_items", "GET", "/v1/responses/{}/input_items")
        both(f"{label} previous_response_id", "POST", "/v1/responses",
             {"model": MODEL, "input": "x", "max_output_tokens": 4, "previous_response_id": "{id}"})
        both(f"{label} previous_response_id streamed", "POST", "/v1/responses",
             {"model": MODEL, "input": "x", "max_output_tokens": 4, "previous_response_id": "{id}", "stream": True})
        both(f"{label} DELETE", "DELETE", "/v1/responses/{}")
    both("conversation GET", "GET", "/v1/conversations/{}", kind="conversation")
    both("conversation items GET", "GET", "/v1/conversations/{}/items", kind="conversation")
    both("conversation items POST", "POST", "/v1/conversations/{}/items",
         {"items": [{"type": "message", "role": "user", "content": "B was here"}]}, kind="conversation")
    both("conversation in a response", "POST", "/v1/responses",
         {"model": MODEL, "input": "x", "max_output_tokens": 4, "conversation": "{id}"}, kind="conversation")
    both("conversation DELETE", "DELETE", "/v1/conversations/{}", kind="conversation")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="DEBUG", help="spark --log-level of the server")
    parser.add_argument("--rounds", type=int, default=2, help="B's attempts are made this many times")
    args = parser.parse_args()
    fake = {"response": "resp_" + secrets.token_hex(24), "conversation": "conv_" + secrets.token_hex(24)}
    server = SparkServer({"SPARK_API_KEYS": f"{A},{B}"}, log_level=args.log_level)
    try:
        server.start()
        with httpx.Client(base_url=server.url, timeout=120) as http:
            ids = stored_by_a(http)
            traffic = other_traffic(http)
            before = a_view(http, ids)
            attempts = [a for _ in range(args.rounds) for a in b_attempts(http, ids, fake)]
            after = a_view(http, ids)
            anonymous = {"GET response": http.get(f"/v1/responses/{ids['response']}").status_code,
                         "GET conversation": http.get(f"/v1/conversations/{ids['conversation']}").status_code}
            metrics = http.get("/metrics").content
        running_leaks, running_sizes = scan_files(server.dir, logs=False)
        server.stop()
        stopped_leaks, sizes = scan_files(server.dir, logs=False)
        log = server.log_text().encode()
        log_leaks = leaks("the server's stdout and stderr", log)
        activity_lines = pathlib.Path(server.activity_path).read_text().splitlines() \
            if pathlib.Path(server.activity_path).exists() else []
    finally:
        server.close()

    not_404 = [{k: a[k] for k in ("call", "status", "body")} for a in attempts if a["status"] != 404]
    telling = [a["call"] for a in attempts if a["status"] == 404 and not a["same_as_nowhere"]]
    changed = [label for label in before if before[label] != after[label]]
    all_leaks = sorted(set(running_leaks + stopped_leaks + log_leaks + leaks("/metrics", metrics)))
    key_ids = sorted({json.loads(line).get("key_id") for line in activity_lines} - {None})
    summary = {
        "script": "isolation", "log_level": args.log_level, "ids": ids, "traffic": traffic,
        "b_calls": len(attempts), "b_calls_404": sum(a["status"] == 404 for a in attempts),
        "b_calls_not_404": not_404[:10], "b_404s_that_differ_from_a_missing_id": telling,
        "a_bodies_checked": len(before), "a_bodies_changed": changed,
        "a_bodies_ok": all(json.loads(body).get("object") for body in after.values()),
        "anonymous": anonymous, "leaks": all_leaks,
        "scanned": {"files_running": running_sizes, "files_stopped": sizes, "log_bytes": len(log), "activity_lines": len(activity_lines),
                    "activity_key_ids": key_ids, "metrics_bytes": len(metrics)},
    }
    checks = {
        "b_always_404": not not_404,
        "b_learns_nothing": not telling,
        "a_intact": not changed and summary["a_bodies_ok"],
        "anonymous_refused": all(s == 401 for s in anonymous.values()),
        "traffic_as_expected": all(s == (401 if k.startswith("W") else 200) for k, s in traffic.items()),
        "no_key_anywhere": not all_leaks,
        "scan_finds_a_planted_key": all(leaks("a control", b"..." + key.encode() + b"...") for key in (A, B, W)),
        "something_was_scanned": bool(activity_lines) and sizes.get("state.sqlite3", 0) > 0 and len(log) > 0,
    }
    return verdict(summary, checks)


if __name__ == "__main__":
    sys.exit(main())
