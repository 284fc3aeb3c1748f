"""The Responses API's items and events, as pure functions: request bodies, input items (stored
with ids), items -> OpenAI chat messages for ``spark.http.turn``, and turn events -> output
items plus the streamed ``response.*`` events that build them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from spark.actors.messages import TokenLogprob
from spark.http.errors import ApiError
from spark.http.output_tokens import OutputTokens
from spark.http.turn import ContentDelta, ReasoningDelta, RefusalDelta, ToolCallDelta
from spark.parsers.citations import extract_citations

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": ...}} (spark.http.structured)
    user: str | None = None
    truncation: str | None = None  # auto | disabled; None: auto (Spark compacts what outgrows the context)
    include: list[str] | None = None  # INCLUDABLE; OUTPUT_TEXT_LOGPROBS is the one that adds anything
    top_logprobs: int | None = None  # alternatives per token, with OUTPUT_TEXT_LOGPROBS included
    speculative: bool | None = None  # Spark's own (extra_body), as on chat completions
    tbt_ms: float | None = None  # Spark's own (extra_body): this stream's time-between-tokens target for SLAI
    background: bool | None = None  # answer at once and generate on (spark.http.background)


@attrs.frozen(kw_only=True)
class CancelRequest:
    """``POST /v1/responses/{id}/cancel``: no fields (the SDK sends no body; an object is read and ignored)."""


@attrs.frozen(kw_only=True)
class ConversationRequest:
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class ConversationUpdate:
    metadata: dict[str, Any] | None  # replaces the conversation's; null clears it (the SDK always sends the key)


@attrs.frozen(kw_only=True)
class ItemsRequest:
    items: list[dict[str, Any]]


# OpenAI's bounds on the metadata of an object: a client that keeps within them here is served there too
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: dict[str, Any] | None, *, param: str = "metadata") -> dict[str, str]:
    """An object's metadata, checked as OpenAI checks it: at most 16 keys of at most 64 characters, each
    with a string value of at most 512. None is no metadata.

    Raises:
      ApiError: 400 naming the key at fault (``metadata.topic``), or ``metadata`` for too many keys.
    """
    if metadata is None:
        return {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise ApiError(400, f"metadata holds at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param=param)
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ApiError(400, f"a metadata key has at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)}",
                           param=f"{param}.{key}")
        if not isinstance(value, str):
            raise ApiError(400, f"metadata values are strings, got {type(value).__name__}", param=f"{param}.{key}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ApiError(400, f"a metadata value has at most {MAX_METADATA_VALUE_CHARS} characters, "
                                f"got {len(value)}", param=f"{param}.{key}")
    return metadata


OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"
# What OpenAI's ``include`` may name (the SDK's ``ResponseIncludable``). Spark hosts no tools and reads no images,
# and its reasoning items hold their text in the clear, so the others have nothing to add here: they are
# accepted and change nothing (clients such as Codex always send ``reasoning.encrypted_content``).
INCLUDABLE = frozenset({
    OUTPUT_TEXT_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})


def check_include(include: list[str] | None) -> None:
    """Refuse an ``include`` value that OpenAI does not define either, as OpenAI does.

    Raises:
      ApiError: 400 naming the value (``include[1]``).
    """
    for i, value in enumerate(include or ()):
        if value not in INCLUDABLE:
            raise ApiError(400, f"unknown include value {value!r}; the values are {', '.join(sorted(INCLUDABLE))}",
                           param=f"include[{i}]")


# -- input items -------------------------------------------------------------------------


def _text(content: object, param: str) -> str:
    """A message's (or tool output's) content as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, "content must be a string or a list of parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise ApiError(400, f"this model reads text only: {kind} parts are not supported", param=f"{param}[{j}]")
        if kind == "refusal" and isinstance(part.get("refusal"), str):  # an earlier answer that refused
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"unsupported content part {kind!r}", param=f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _required_str(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{item.get('type')} items need a string {key}", param=f"{param}.{key}")
    return value


def _text_parts(item: dict, key: str, param: str) -> list[dict]:
    """A reasoning item's summary or content: a list of parts, each an object with a string text.
    Checked here, since ``chat_messages`` joins their texts when the item is read back."""
    parts = item.get(key)
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise ApiError(400, f"reasoning items' {key} is a list of parts", param=f"{param}.{key}")
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
            raise ApiError(400, f"a reasoning {key} part is an object with a string text", param=f"{param}.{key}[{j}]")
    return parts


def message_item(role: str, text: str, item_id: str | None = None, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []} if role == "assistant" else \
        {"type": "input_text", "text": text}
    return {"type": "message", "id": item_id or new_id("msg"), "role": role, "content": [part], "status": status}


def input_items(value: str | list[dict] | None, *, param: str = "input") -> list[dict]:
    """The request's input as stored items, each with an id: messages, function calls and their outputs.

    Raises:
      ApiError: 400 naming the bad item (``input[2].call_id``); image and file parts are refused.
    """
    if value is None:
        return []
    if isinstance(value, str):
        return [message_item("user", value)]
    out = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"an input item is an object, got {type(item).__name__}", param=where)
        if not isinstance(item.get("id"), (str, type(None))):
            raise ApiError(400, f"an item id is a string, got {type(item['id']).__name__}", param=f"{where}.id")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise ApiError(400, f"unsupported role {role!r}; use user, system, developer or assistant",
                               param=f"{where}.role")
            out.append(message_item(role, _text(item.get("content"), f"{where}.content"), item.get("id")))
        elif kind == "function_call":
            out.append({"type": "function_call", "id": item.get("id") or new_id("fc"),
                        "call_id": _required_str(item, "call_id", where), "name": _required_str(item, "name", where),
                        "arguments": _required_str(item, "arguments", where), "status": "completed"})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "id": item.get("id") or new_id("fco"),
                        "call_id": _required_str(item, "call_id", where),
                        "output": _text(item.get("output"), f"{where}.output"), "status": "completed"})
        elif kind == "reasoning":
            out.append({"type": "reasoning", "id": item.get("id") or new_id("rs"),
                        "summary": _text_parts(item, "summary", where), "content": _text_parts(item, "content", where)})
        else:
            raise ApiError(400, f"unsupported input item type {kind!r}", param=f"{where}.type")
    return out


def check_new_items(history: Sequence[dict], items: Sequence[dict], *, param: str = "input") -> None:
    """Refuse new items that do not fit after ``history``, as OpenAI refuses them: an id that the
    history or an earlier new item already holds (a client re-sending what a previous response or
    the conversation already keeps would put it before the model twice), and a function call
    output whose call is nowhere before it (a mistyped call_id would reach the model as a tool
    result answering nothing). Outputs already in the history are not judged again: deleting a
    conversation's call item, or eviction, may have left them without their call.

    Raises:
      ApiError: 400 naming the item (``input[2].id``, ``input[0].call_id``).
    """
    stored = {item.get("id") for item in history}
    sent: set[str] = set()
    calls = {item.get("call_id") for item in history if item.get("type") == "function_call"}
    for i, item in enumerate(items):
        if item["id"] in stored or item["id"] in sent:
            holder = "the history this turn continues" if item["id"] in stored else "an earlier item of this request"
            raise ApiError(400, f"duplicate item id {item['id']!r}: {holder} holds it already; send each item once",
                           param=f"{param}[{i}].id")
        sent.add(item["id"])
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise ApiError(400, f"no function_call with call_id {item['call_id']!r} comes before this output; "
                                "send the call first (or continue the response that made it)",
                           param=f"{param}[{i}].call_id")


def check_calls_answered(history: Sequence[dict], items: Sequence[dict], *, param: str = "input") -> None:
    """Refuse a turn that leaves a function call of its model unanswered, as OpenAI refuses it ("No
    tool output found for function call"): each call since the history's last user-side message, and
    each call among the new items, needs a function_call_output among the new items. Otherwise the
    model would read its own call followed by no result, and an agent's lost tool output would go
    unnoticed. Calls before that message are not judged: a conversation's items may have been
    deleted since, and the turn that made them was judged then. Nor is a call the output was cut off
    in (status incomplete): it cannot be run.

    Raises:
      ApiError: 400 naming the first unanswered call (``input[1]`` when it is a new item).
    """
    last_user = max((i for i, item in enumerate(history)
                     if item.get("type") == "message" and item.get("role") != "assistant"), default=-1)
    pending = {item["call_id"]: (item.get("name"), None) for item in history[last_user + 1:]
               if item.get("type") == "function_call" and item.get("status") != "incomplete"}  # cut off: not run
    for item in history[last_user + 1:]:
        if item.get("type") == "function_call_output":
            pending.pop(item.get("call_id"), None)
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            pending[item["call_id"]] = (item["name"], i)
        elif item["type"] == "function_call_output":
            pending.pop(item["call_id"], None)
    if pending:
        call_id, (name, index) = next(iter(pending.items()))
        made = f"{param}[{index}]" if index is not None else "the history this turn continues"
        raise ApiError(400, f"no function_call_output answers function call {call_id!r} ({name}, in {made}); "
                            "send an output for each call before continuing",
                       param=f"{param}[{index}]" if index is not None else param)


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """Stored items (history, then the new input) as OpenAI chat messages, ``instructions`` first.

    Consecutive function calls join the assistant message before them; a reasoning item becomes
    the next assistant message's ``reasoning_content``.
    """
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: list[str] = []
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += [p.get("text", "") for p in item.get("content") or item.get("summary") or ()]
            continue
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            continue
        if kind == "message" and item["role"] != "assistant":
            out.append({"role": _ROLES[item["role"]], "content": _text(item["content"], "input")})
            continue
        if kind == "message" or not (out and out[-1]["role"] == "assistant"):
            out.append({"role": "assistant", "content": _text(item["content"], "input") if kind == "message" else ""})
        if reasoning:
            out[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
        if kind == "function_call":
            out[-1].setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools (flat: ``{"type", "name", "parameters"}``) as OpenAI chat tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ApiError(400, f"only function tools are supported, got {tool.get('type')!r}",
                           param=f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


# -- output items and their events ---------------------------------------------------------


class OutputBuilder:
    """Turn events into output items and the ``response.*`` events that stream them.

    One item per run of a kind: reasoning, a message, or a function call. Whitespace before a
    message's first visible character is held back (the newlines between tool calls make no item).
    A refusal is a message whose part is ``{"type": "refusal"}``. With ``citations``, a message's
    links become its text's ``url_citation`` annotations when it ends. Tokens given to ``add_tokens``
    become the ``logprobs`` of the message text they write.
    ``output`` holds the items, final once ``close`` was called.
    """

    def __init__(self, *, citations: bool = False):
        self.output: list[dict] = []
        self._open: dict | None = None
        self._blank = ""
        self._citations = citations
        self._tokens = OutputTokens()

    def add_tokens(self, logprobs: Sequence[TokenLogprob]) -> None:
        """Tokens just generated (a piece's ``logprobs``), given before their piece's events.

        The message text they write takes them as its logprobs; the reasoning, refusal or call they write
        drops them, as OpenAI shows the logprobs of output text only.
        """
        self._tokens.add(logprobs)

    def feed(self, event) -> list[dict]:
        out: list[dict] = []
        if isinstance(event, ReasoningDelta) and event.text:
            self._tokens.take(event.text)
            if not self._is_open("reasoning"):
                out += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []},
                                 {"type": "reasoning_text", "text": ""})
            out.append(self._text_delta("response.reasoning_text.delta", event.text))
        elif isinstance(event, ContentDelta) and event.text:
            text = event.text
            if not self._is_open("message"):
                if not (self._blank + text).strip():
                    self._blank += text
                    return out
                text, self._blank = self._blank + text, ""
                out += self._add({**message_item("assistant", "", status="in_progress"), "content": []},
                                 {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            tokens = self._tokens.take(text)
            part = self._open["content"][0]
            part["logprobs"].extend(tokens)  # the part's added event holds a copy
            out.append(self._text_delta("response.output_text.delta", text, logprobs=tokens))
        elif isinstance(event, RefusalDelta) and event.text:
            self._tokens.take(event.text)
            if not self._is_open("message") or self._open["content"][0]["type"] != "refusal":
                out += self._add({**message_item("assistant", "", status="in_progress"), "content": []},
                                 {"type": "refusal", "refusal": ""})
            self._open["content"][0]["refusal"] += event.text
            out.append({"type": "response.refusal.delta", "item_id": self._open["id"],
                        "output_index": len(self.output) - 1, "content_index": 0, "delta": event.text})
        elif isinstance(event, ToolCallDelta):
            self._tokens.drop()  # its arguments are JSON written anew, not the tokens' text
            if event.id is not None:
                out += self._add({"type": "function_call", "id": new_id("fc"), "call_id": event.id,
                                  "name": event.name, "arguments": "", "status": "in_progress"})
            if event.arguments:
                self._open["arguments"] += event.arguments
                out.append({"type": "response.function_call_arguments.delta", "item_id": self._open["id"],
                            "output_index": len(self.output) - 1, "delta": event.arguments})
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item (or, if the reply made none, add an empty message); ``status`` is the items'."""
        if not self.output:
            self.output.append(message_item("assistant", "", status=status))
            return self._done(status)
        return self._done(status) if self._open is not None else []

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _add(self, item: dict, part: dict | None = None) -> list[dict]:
        out = self._done("completed") if self._open is not None else []
        self._blank = ""
        self._open = item
        index = len(self.output)
        self.output.append(item)
        added = {**item, "content": []} if "content" in item else dict(item)  # a snapshot: item changes later
        out.append({"type": "response.output_item.added", "output_index": index, "item": added})
        if part is not None:
            item["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": {**part, "logprobs": []} if "logprobs" in part else dict(part)})
        return out

    def _text_delta(self, kind: str, text: str, **extra) -> dict:
        self._open["content"][0]["text"] += text
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.output) - 1,
                "content_index": 0, "delta": text, **extra}

    def _done(self, status: str) -> list[dict]:
        item, self._open = self.output[-1], None
        index, out = len(self.output) - 1, []
        if item["type"] == "function_call":
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                        "name": item["name"], "arguments": item["arguments"]})
        elif item["content"]:
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if part["type"] == "refusal":
                out.append({"type": "response.refusal.done", **where, "refusal": part["refusal"]})
            else:
                if part["type"] == "output_text" and self._citations:
                    for n, c in enumerate(extract_citations(part["text"])):
                        part["annotations"].append({"type": "url_citation", "start_index": c.start,
                                                    "end_index": c.end, "url": c.url, "title": c.title})
                        out.append({"type": "response.output_text.annotation.added", **where, "annotation_index": n,
                                    "annotation": part["annotations"][-1]})
                kind = "response.output_text.done" if part["type"] == "output_text" else "response.reasoning_text.done"
                extra = {"logprobs": part["logprobs"]} if part["type"] == "output_text" else {}
                out.append({"type": kind, **where, "text": part["text"], **extra})
            out.append({"type": "response.content_part.done", **where, "part": dict(part)})
        if item["type"] != "reasoning":
            item["status"] = status
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return out


def usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0) -> dict:
    """The Responses usage object. ``cache_write_tokens`` (required by the SDK's types) is 0: Spark's prefix
    cache keeps every prompt's full pages without a write a client asks for or pays for."""
    details = {"cached_tokens": min(cached_tokens, prompt_tokens), "cache_write_tokens": 0}
    return {"input_tokens": prompt_tokens, "input_tokens_details": details,
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def reasoning_text(output: list[dict]) -> str:
    """The text of a response's reasoning items."""
    return "".join(p.get("text", "") for item in output if item.get("type") == "reasoning"
                   for p in item.get("content") or ())
