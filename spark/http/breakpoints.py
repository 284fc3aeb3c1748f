"""Anthropic ``cache_control`` breakpoints: where in the rendered prompt each one ends, as prefix pins.

A breakpoint on a tool, a system block or a message's content block asks that the prompt up to
and including that block stay cached for its ``ttl`` ("5m" by default, or "1h"). The chat
template decides where a block lands in the prompt, so it is found by rendering the request once
more with a marker after each breakpoint's text: the marker's place in that text is the block's
end, and the prompt tokens that the text before it encodes to are the prefix to pin. A block
without text of its own (``tool_use``, ``thinking``) marks nothing; a request whose prompt had to
be compacted pins nothing (what it would pin is not what the client sends next).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import attrs

from spark.core.scheduler import PrefixPin
from spark.http.errors import ApiError

TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # as Anthropic's API allows
_MARK = "@@spark-cache-breakpoint-{}@@"


@attrs.frozen
class CacheControl:
    type: str = "ephemeral"
    ttl: str | None = None  # "5m" | "1h"


def ttl_of(control: CacheControl | dict, param: str) -> float:
    """A breakpoint's TTL in seconds; 400 for another type or ttl."""
    kind, ttl = (control.get("type"), control.get("ttl")) if isinstance(control, dict) else (control.type, control.ttl)
    if kind != "ephemeral":
        raise ApiError(400, f"cache_control type must be ephemeral, got {kind!r}", param=f"{param}.type")
    if ttl is not None and ttl not in TTLS:
        raise ApiError(400, f"cache_control ttl must be 5m or 1h, got {ttl!r}", param=f"{param}.ttl")
    return TTLS[ttl or "5m"]


def mark(req) -> tuple[Any, list[float]]:
    """``req`` (an Anthropic Messages request) with a marker after each breakpoint's text, and their TTLs
    in prompt order (tools, system, messages). Raises ``ApiError`` 400 for a bad ``cache_control``."""
    ttls: list[float] = []

    def marked(text: str | None, control, param: str) -> str | None:
        ttls.append(ttl_of(control, f"{param}.cache_control"))
        return f"{text or ''}{_MARK.format(len(ttls) - 1)}"

    tools = req.tools
    if tools:
        tools = [attrs.evolve(t, description=marked(t.description, t.cache_control, f"tools[{i}]"))
                 if t.cache_control is not None else t for i, t in enumerate(tools)]
    system = req.system
    if isinstance(system, list):
        system = [_marked_block(b, marked, f"system[{j}]") for j, b in enumerate(system)]
    messages = []
    for i, m in enumerate(req.messages):
        if not isinstance(m.content, str):
            m = attrs.evolve(m, content=[_marked_block(b, marked, f"messages[{i}].content[{j}]")
                                         for j, b in enumerate(m.content)])
        messages.append(m)
    return attrs.evolve(req, tools=tools, system=system, messages=messages), ttls


def _marked_block(block, marked, param: str):
    if block.cache_control is not None:
        if block.type == "text":
            return attrs.evolve(block, text=marked(block.text, block.cache_control, param))
        if block.type == "tool_result" and isinstance(block.content, (str, type(None))):
            return attrs.evolve(block, content=marked(block.content, block.cache_control, param))
        ttl_of(block.cache_control, f"{param}.cache_control")  # checked, but it has no text to mark
    if block.type == "tool_result" and isinstance(block.content, list):
        content = [dict(b, text=marked(b.get("text"), b["cache_control"], f"{param}.content[{k}]"))
                   if isinstance(b, dict) and b.get("cache_control") is not None and b.get("type") == "text" else b
                   for k, b in enumerate(block.content)]
        return attrs.evolve(block, content=content)
    return block


def pins(tokenizer, prompt_ids: Sequence[int], text: str, marked_text: str, ttls: Sequence[float]
         ) -> tuple[tuple[PrefixPin, ...], int]:
    """The pins of the breakpoints marked in ``marked_text`` (the prompt ``text`` rendered with markers),
    the last ``MAX_BREAKPOINTS`` of them, and the tokens up to the last one (0 when none is found).

    A pin's key is its prefix's digest, so that requests sharing a prefix refresh one pin."""
    ends, plain, at = [], [], 0
    for i in range(len(ttls)):
        mark_ = _MARK.format(i)
        found = marked_text.find(mark_, at)
        if found < 0:
            continue
        plain.append(marked_text[at:found])
        at = found + len(mark_)
        ends.append((sum(map(len, plain)), ttls[i]))
    plain.append(marked_text[at:])
    if not ends or "".join(plain) != text:  # the template moved what it was given: nothing is sure
        return (), 0
    result, last = [], 0
    bos = getattr(tokenizer, "bos_token_id", None)
    for end, ttl in ends[-MAX_BREAKPOINTS:]:
        ids = tokenizer.encode(text[:end])
        if prompt_ids[:1] == (bos,) and ids[:1] != [bos]:
            ids.insert(0, bos)
        n = _common_prefix(ids, prompt_ids)
        if n:
            digest = hashlib.blake2b(array("q", prompt_ids[:n]).tobytes(), digest_size=16).hexdigest()
            result.append(PrefixPin(f"cache_control-{digest}", ttl, tokens=n))
            last = max(last, n)
    return tuple(result), last


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
