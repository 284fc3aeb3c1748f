"""Structured output on the default model (issue 21): every answer parses and validates.

  * 50 chat completions over 5 JSON schemas of our own (nested objects, arrays, enums, required
    fields, bounded numbers, strings with patterns), ``response_format`` json_schema, temperature 0.7:
    each answer is JSON that ``jsonschema`` validates;
  * 30 streamed chat completions with 3 tools (their strings bounded: a 135M model at 0.7 can repeat a
    syllable in an unbounded one until its max_tokens) and ``tool_choice: "required"`` (one call each,
    ``parallel_tool_calls: false``): each stream's first delta is a ``tool_calls`` delta, no content
    delta comes, and the call's arguments validate against its tool's schema.

Run: ``python scripts/accept/structured_output.py [--concurrency 4]``; prints one JSON summary and
exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from harness import SparkServer, verdict

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["pilot", "crane operator", "clerk", "engineer"]}},
        "required": ["name", "age", "role"], "additionalProperties": False},
    "ship": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 30},
        "flag": {"type": "string", "pattern": "^[A-Z]{2}$"},
        "dimensions": {"type": "object", "properties": {
            "length_m": {"type": "number", "minimum": 10, "maximum": 400},
            "beam_m": {"type": "number", "minimum": 2, "maximum": 60}}, "required": ["length_m", "beam_m"]}},
        "required": ["name", "flag", "dimensions"]},
    "manifest": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "count": {"type": "integer", "minimum": 1, "maximum": 500}}, "required": ["sku", "count"]}},
        "hazardous": {"type": "boolean"}}, "required": ["items", "hazardous"]},
    "tide": {"type": "object", "properties": {
        "port": {"type": "string", "maxLength": 24},
        "highs": {"type": "array", "items": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                  "minItems": 1, "maxItems": 2},
        "range_m": {"type": "number", "minimum": 0, "maximum": 15}}, "required": ["port", "highs", "range_m"]},
    "ticket": {"type": "object", "properties": {
        "priority": {"enum": ["low", "medium", "high"]},
        "summary": {"type": "string", "maxLength": 60},
        "labels": {"type": "array", "items": {"enum": ["berth", "crane", "customs", "weather"]}, "maxItems": 3},
        "eta_hours": {"type": "integer", "minimum": 0, "maximum": 72}},
        "required": ["priority", "summary", "labels"]},
}
ASKS = {"person": "Describe a harbour worker.", "ship": "Describe a cargo ship.",
        "manifest": "List a small cargo manifest.", "tide": "Give today's tides for a port.",
        "ticket": "File a ticket about a broken crane."}
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": params}}
         for name, desc, params in (
             ("get_tide", "High and low tide at a port", {"type": "object", "properties": {
                 "port": {"type": "string", "maxLength": 40}, "day": {"type": "integer", "minimum": 1, "maximum": 31}},
                 "required": ["port"]}),
             ("book_berth", "Book a berth for a ship", {"type": "object", "properties": {
                 "ship": {"type": "string", "maxLength": 40}, "hours": {"type": "integer", "minimum": 1, "maximum": 72}},
                 "required": ["ship", "hours"]}),
             ("weather", "The weather at sea", {"type": "object", "properties": {
                 "area": {"type": "string", "enum": ["north sea", "channel", "biscay"]}}, "required": ["area"]}))]
TOOL_ASKS = ["I need a berth for the Aurora for 10 hours.", "When is high tide in Dover on the 3rd?",
             "Is it stormy in Biscay?", "Help me plan tomorrow's arrival."]


def json_answer(client, model: str, kind: str, seed: int) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind], "strict": True}}
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASKS[kind]}],
                                            max_tokens=200, temperature=0.7, seed=seed, response_format=fmt)
    text = answer.choices[0].message.content
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[kind])
        return {"ok": True}
    except (ValueError, jsonschema.ValidationError) as exc:
        return {"ok": False, "schema": kind, "text": text, "why": str(exc)[:200]}


def forced_call(client, model: str, seed: int) -> dict:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": TOOL_ASKS[seed % len(TOOL_ASKS)]}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, max_tokens=160, temperature=0.7, seed=seed, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    first = next((d for d in deltas if d.content or d.tool_calls), None)
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    name = "".join(tc.function.name or "" for tc in calls if tc.index == 0)
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.index == 0)
    problem = None
    if first is None or not first.tool_calls:
        problem = "the first delta is not a tool call"
    elif any(d.content for d in deltas):
        problem = "content came with the call"
    else:
        try:
            jsonschema.validate(json.loads(arguments), {t["function"]["name"]: t["function"]["parameters"]
                                                        for t in TOOLS}[name])
        except (KeyError, ValueError, jsonschema.ValidationError) as exc:
            problem = f"{type(exc).__name__}: {exc}"[:200]
    return {"ok": problem is None, "name": name, "arguments": arguments, "why": problem}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    with SparkServer(cpu_threads=2) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        t0 = time.time()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda i: json_answer(client, model, list(SCHEMAS)[i % 5], i), range(50)))
            json_s = time.time() - t0
            calls = list(pool.map(lambda i: forced_call(client, model, i), range(30)))
        summary = {"json_requests": 50, "json_valid": sum(a["ok"] for a in answers), "json_s": round(json_s, 1),
                   "json_failures": [a for a in answers if not a["ok"]][:5],
                   "tool_requests": 30, "tool_valid": sum(c["ok"] for c in calls),
                   "tool_s": round(time.time() - t0 - json_s, 1),
                   "tool_names": sorted({c["name"] for c in calls}),
                   "tool_failures": [c for c in calls if not c["ok"]][:5]}
    return verdict(summary, {"all_json_valid": summary["json_valid"] == 50,
                             "all_calls_valid": summary["tool_valid"] == 30})


if __name__ == "__main__":
    sys.exit(main())
