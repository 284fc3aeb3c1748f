"""Anthropic's Messages API: ``POST /v1/messages`` (streamed or not) and ``/v1/messages/count_tokens``.

A request is converted into the OpenAI-shaped messages and tools that ``spark.http.turn``
renders (``tool_use`` blocks become an assistant's ``tool_calls``, ``tool_result`` blocks
tool messages, ``thinking`` blocks its ``reasoning_content``), and the turn's events become
content blocks: thinking, text, tool_use. Every error on ``/v1/messages*`` (401, 404, 413,
malformed JSON, ...) has Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``:
``install`` rewrites the app's OpenAI-shaped error bodies on these paths.
"""

from __future__ import annotations

import json
import logging
import secrets
from contextlib import aclosing
from typing import Any

import attrs
from quart import Blueprint, Response, g, request

from spark.actors.ingress import OVERLOADED
from spark.actors.messages import RequestOutput
from spark.http import breakpoints, spine
from spark.http.breakpoints import CacheControl
from spark.http.chat_prompt import chat_format
from spark.http.errors import ApiError
from spark.http.fanin import FanIn
from spark.http.gateway import generates
from spark.http.params import sampling_params, single_job, stop_strings
from spark.http.spine import Serving, request_body
from spark.http.turn import (EFFORT_BUDGETS, ContentDelta, ReasoningDelta, RefusalDelta, ToolCallDelta, ToolChoice,
                             TurnDone, TurnParser, Usage, collect_turn, prepare_turn, turn_steps)
from spark.parsers.citations import extract_citations

bp = Blueprint("anthropic", __name__)
log = logging.getLogger("spark.http")
PREFIX = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


# -- request bodies ---------------------------------------------------------------------


@attrs.frozen
class Block:
    """A content block of any type; the fields its type uses are set."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    cache_control: CacheControl | None = None  # keep the prompt up to here cached (spark.http.breakpoints)


@attrs.frozen
class Message:
    role: str
    content: str | list[Block]


@attrs.frozen
class Tool:
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools are not supported
    cache_control: CacheControl | None = None


@attrs.frozen
class ToolChoiceBody:
    type: str  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


@attrs.frozen
class Thinking:
    type: str  # enabled | disabled | adaptive | between_tools
    budget_tokens: int | None = None


@attrs.frozen
class OutputConfig:
    effort: str | None = None  # low | medium | high | xhigh | max: a thinking budget unless one is given


@attrs.frozen(kw_only=True)
class CountTokensRequest:
    model: str | None = None
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceBody | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


@attrs.frozen(kw_only=True)
class MessagesRequest(CountTokensRequest):
    max_tokens: int
    temperature: float | None = None  # (newer SDKs send these three only through extra_body)
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = None
    speculative: bool | None = None  # Spark's own (extra_body), as on chat completions
    tbt_ms: float | None = None  # Spark's own (extra_body): this stream's time-between-tokens target for SLAI


# -- conversion to a chat turn ------------------------------------------------------------


def _text_of(content: str | list[dict] | None, param: str) -> str:
    """A tool result's content as text: a string, or text blocks joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"tool_result content blocks must be text for this model, got {block.get('type')!r}",
                           param=f"{param}[{j}]")
        texts.append(block["text"])
    return "\n".join(texts)


def _unsupported(block: Block, param: str) -> ApiError:
    if block.type in ("image", "document"):
        return ApiError(400, f"this model reads text only: {block.type} blocks are not supported", param=param)
    return ApiError(400, f"unsupported content block type {block.type!r}", param=param)


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The conversation as OpenAI-shaped messages (``spark.http.turn`` renders them)."""
    out: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(
            b.text or "" for b in req.system if b.type == "text")
        out.append({"role": "system", "content": system})
    if not req.messages:
        raise ApiError(400, "messages must hold at least one message", param="messages")
    for i, m in enumerate(req.messages):
        param = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise ApiError(400, f"unsupported role {m.role!r}; use user or assistant", param=f"{param}.role")
        blocks = [Block("text", text=m.content)] if isinstance(m.content, str) else m.content
        texts, calls, reasoning = [], [], []
        for j, b in enumerate(blocks):
            where = f"{param}.content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_result" and m.role == "user":
                text = _text_of(b.content, f"{where}.content")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content":
                            f"Error: {text}" if b.is_error else text})
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append({"id": b.id or f"toolu_{secrets.token_hex(8)}", "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
            elif b.type == "thinking" and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type != "redacted_thinking":
                raise _unsupported(b, where)
        if m.role == "user":
            if texts or not blocks:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        out.append(message)
    return out


def turn_kwargs(req: CountTokensRequest) -> dict:
    """The keyword arguments of ``prepare_turn`` (messages, tools, tool choice, thinking)."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise ApiError(400, f"server tool {t.type!r} is not supported", param=f"tools[{i}].type")
            tools.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                            "parameters": t.input_schema or {"type": "object"}}})
    choice, parallel = ToolChoice("auto"), True
    if req.tool_choice is not None:
        kind = req.tool_choice.type
        if kind == "tool":
            if not req.tool_choice.name:
                raise ApiError(400, "tool_choice of type tool needs a name", param="tool_choice.name")
            choice = ToolChoice.named(req.tool_choice.name)
        elif kind in ("auto", "any", "none"):
            choice = ToolChoice({"any": "required"}.get(kind, kind))
        else:
            raise ApiError(400, f"tool_choice type must be auto, any, tool or none, got {kind!r}",
                           param="tool_choice.type")
        parallel = not req.tool_choice.disable_parallel_tool_use
    enable, budget = None, None
    if req.thinking is not None:
        if req.thinking.type not in _THINKING_TYPES:
            raise ApiError(400, f"thinking type must be one of {', '.join(_THINKING_TYPES)}, got {req.thinking.type!r}",
                           param="thinking.type")
        enable = req.thinking.type != "disabled"
        budget = req.thinking.budget_tokens if enable else None
    effort = req.output_config.effort if req.output_config else None
    if budget is None and enable is not False and effort is not None:
        if effort not in EFFORT_BUDGETS and effort not in ("xhigh", "max"):
            raise ApiError(400, f"output_config.effort must be low, medium, high, xhigh or max, got {effort!r}",
                           param="output_config.effort")
        budget = EFFORT_BUDGETS.get(effort)  # xhigh and max: the server's cap
    messages = chat_messages(req)
    if len(messages) > 1 and messages[-1] == {"role": "assistant", "content": ""}:
        messages.pop()  # an empty final assistant message prefills nothing (Anthropic allows it there)
    return {"messages": messages, "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "enable_thinking": enable, "thinking_budget": budget, "continue_final_message": _prefilled(messages)}


def _prefilled(messages: list[dict]) -> bool:
    """Whether the conversation ends with the start of the answer (Anthropic's prefill): a final
    assistant message with text and no tool call, which the reply continues.

    Raises:
      ApiError: 400, a prefill ending in whitespace (as Anthropic's API refuses it).
    """
    final = messages[-1]
    if final["role"] != "assistant" or final.get("tool_calls") or not final["content"]:
        return False
    if final["content"] != final["content"].rstrip():
        raise ApiError(400, "final assistant content cannot end with trailing whitespace", param="messages")
    return True


# -- routes ----------------------------------------------------------------------------


@generates(bp, PREFIX + "/count_tokens", logged=False)  # names a model, generates nothing
async def count_tokens(serving: Serving):
    req = await request_body(CountTokensRequest)
    # The prompt as rendered, not compacted: a client counts to learn whether it must shorten the
    # conversation itself, and counting generates nothing, so no length is refused here.
    turn = await spine.render_turn(serving, **await spine.off_loop(turn_kwargs, req))
    return {"input_tokens": len(turn.prompt.prompt_ids)}


@generates(bp, PREFIX)
async def create_message(serving: Serving):
    req = await request_body(MessagesRequest)
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k")}
    if req.temperature is not None and not 0 <= req.temperature <= 1:  # Anthropic's range (OpenAI's is 0 to 2)
        raise ApiError(400, f"temperature must be between 0 and 1, got {req.temperature}", param="temperature")
    params = sampling_params(serving.limits, given, max_tokens=req.max_tokens)
    stops = stop_strings(req.stop_sequences, param="stop_sequences")
    marked, ttls = await spine.off_loop(breakpoints.mark, req)
    turn, stage = await spine.fit_turn(serving, max_tokens=req.max_tokens, **await spine.off_loop(turn_kwargs, req))
    prompt, mid = turn.prompt.prompt_ids, f"msg_{secrets.token_hex(12)}"
    pins, written = (), 0
    if ttls and stage is None and serving.model.config.prefix_caching:
        pins, written = await spine.off_loop(_breakpoint_pins, serving, turn, marked, ttls)
    job = single_job(mid, prompt, turn.sampling(params), serving.limits, stream=bool(req.stream), stop=stops,
                     api_key=g.api_key, pins=pins, grammar=turn.grammar, speculative=req.speculative,
                     tbt_ms=req.tbt_ms)
    parser = turn.parser(id_prefix=f"toolu_{secrets.token_hex(8)}")
    fanin = await spine.submit(serving, job)
    head = {"id": mid, "type": "message", "role": "assistant", "model": serving.model.served_name}
    if job.stream:
        return spine.sse(_stream(head, len(prompt), fanin, parser, written), stage)
    done = await collect_turn(fanin, parser)
    if done.error is not None:
        raise done.error
    return spine.answer({**head, "content": content_blocks(done, citations=parser.citations), **stop_fields(done),
                         "usage": message_usage(len(prompt), done.usage, written)}, stage)


def _breakpoint_pins(serving: Serving, turn, marked: MessagesRequest, ttls: list[float]):
    """The pins of ``marked``'s breakpoints in ``turn``'s prompt (renders the template once more)."""
    model = serving.model
    again = prepare_turn(model.tokenizer, chat_format(model.config, model.tokenizer), **turn_kwargs(marked))
    return breakpoints.pins(model.tokenizer, turn.prompt.prompt_ids, turn.prompt.text, again.prompt.text, ttls)


# -- responses -----------------------------------------------------------------------------


def stop_fields(done: TurnDone) -> dict:
    """``stop_reason`` (end_turn, max_tokens, stop_sequence, tool_use, refusal) and the ``stop_sequence`` matched."""
    if done.result.refusal:
        return {"stop_reason": "refusal", "stop_sequence": None}
    if done.stop_string is not None and done.finish_reason == "stop":
        return {"stop_reason": "stop_sequence", "stop_sequence": done.stop_string}
    return {"stop_reason": _STOP_REASONS.get(done.finish_reason, "end_turn"), "stop_sequence": None}


def content_blocks(done: TurnDone, *, citations: bool = False) -> list[dict]:
    """The whole reply as blocks: thinking, text (a refusal's too; with ``citations``, the links it cites),
    then tool_use (an empty text block if nothing else)."""
    result, blocks = done.result, []
    if result.reasoning:
        blocks.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    text = result.refusal or result.content
    if text.strip() or not (blocks or result.tool_calls):
        cited = text_citations(text) if citations and not result.refusal else []
        blocks.append({"type": "text", "text": text} | ({"citations": cited} if cited else {}))
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in result.tool_calls]
    return blocks


def text_citations(text: str) -> list[dict]:
    """The links ``text`` cites as Anthropic text-block citations (of the URL-bearing kind)."""
    return [{"type": "web_search_result_location", "cited_text": text[c.start:c.end], "url": c.url,
             "title": c.title, "encrypted_index": ""} for c in extract_citations(text)]


def sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class BlockStream:
    """Turn events into content_block_start / _delta / _stop events, one block per run of a kind.

    Whitespace before a text block's first visible character is held back, so the newlines
    a model writes between tool calls do not become blocks of their own. A refusal is text; with
    ``citations``, a text block's links go out as ``citations_delta``s before it stops.
    """

    def __init__(self, *, citations: bool = False):
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self._blank = ""
        self._citations = citations
        self._text: list[str] = []  # the open text block's (for its citations)
        self._refusal = False  # the open text block is a refusal (it cites nothing)

    def feed(self, event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta) and event.text:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, (ContentDelta, RefusalDelta)) and event.text:
            text = event.text
            if self.open != "text":
                if not (self._blank + text).strip():
                    self._blank += text
                    return out
                text, self._blank = self._blank + text, ""
                out += self._start({"type": "text", "text": ""})
            self._refusal = isinstance(event, RefusalDelta)
            self._text.append(text)
            out.append(self._delta({"type": "text_delta", "text": text}))
        elif isinstance(event, ToolCallDelta):
            if event.id is not None:
                out += self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
            if event.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
        return out

    def close(self) -> list[bytes]:
        """End the open block (or, if the reply made none, send an empty text block)."""
        if self.index < 0:
            return self._start({"type": "text", "text": ""}) + self.close()
        if self.open is None:
            return []
        out = []
        if self.open == "text" and self._citations and not self._refusal:
            out = [self._delta({"type": "citations_delta", "citation": c}) for c in text_citations("".join(self._text))]
        self.open, self._text = None, []
        return out + [sse("content_block_stop", {"index": self.index})]

    def _start(self, block: dict) -> list[bytes]:
        out = self.close() if self.index >= 0 else []
        self.index += 1
        self.open = block["type"]
        self._blank = ""
        return out + [sse("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"index": self.index, "delta": delta})


def message_usage(prompt_tokens: int, used, breakpoint_tokens: int = 0) -> dict:
    """Anthropic's usage: of the input tokens, those read from the (prefix) cache, those computed up to
    the last ``cache_control`` breakpoint (written to the cache for later turns), and the rest."""
    cached = min(used.cached_tokens, prompt_tokens)
    written = max(0, min(breakpoint_tokens, prompt_tokens) - cached)
    return {"input_tokens": prompt_tokens - cached - written, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": written, "output_tokens": used.completion_tokens}


def _message_start(head: dict, prompt_tokens: int, first: RequestOutput | None, breakpoint_tokens: int) -> bytes:
    """``message_start`` (and a ping), its usage split as the last one's will be: ``first``, the generation's
    first piece (None: it failed before one), knows the prompt tokens its prefill found cached."""
    cached = first.num_cached_tokens if first is not None else 0
    usage = message_usage(prompt_tokens, Usage(prompt_tokens, 0, cached), breakpoint_tokens)
    return sse("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                             "usage": usage}}) + sse("ping", {})


async def _stream(head: dict, prompt_tokens: int, fanin: FanIn, parser: TurnParser, breakpoint_tokens: int):
    """The Messages stream; ``message_start`` goes out with the first piece, which brings the prefix-cache hit."""
    blocks = BlockStream(citations=parser.citations)
    started = False
    try:
        async with aclosing(turn_steps(fanin, [parser])) as steps:
            async for _, piece, events in steps:  # the SSE events of one piece go out in one write
                out = [] if started else [_message_start(head, prompt_tokens, piece, breakpoint_tokens)]
                started = True
                for event in events:
                    if not isinstance(event, TurnDone):
                        out += blocks.feed(event)
                    elif event.error is not None:
                        yield b"".join(out) + sse("error", anthropic_error(event.error.status, event.error.message))
                        return
                    else:
                        usage = message_usage(prompt_tokens, event.usage, breakpoint_tokens)
                        out += blocks.close() + [sse("message_delta", {"delta": stop_fields(event), "usage": usage}),
                                                 sse("message_stop", {})]
                if out:
                    yield b"".join(out)
    except Exception as exc:  # the server failed mid-stream: say so rather than cut the stream
        log.exception("message %s failed", head["id"])
        yield sse("error", anthropic_error(500, f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        fanin.close()


# -- errors and auth ----------------------------------------------------------------------


def anthropic_error(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"error": {"type": kind, "message": message}}


async def _reshape_error(response: Response) -> Response:
    """On /v1/messages*, an OpenAI error body becomes Anthropic's."""
    if response.status_code < 400 or not request.path.startswith(PREFIX) or response.mimetype != "application/json":
        return response
    try:
        body = json.loads(await response.get_data())
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response
    if body["error"].get("code") == OVERLOADED:  # Anthropic's own status for an overloaded server
        response.status_code = 529
    response.set_data(json.dumps({"type": "error", **anthropic_error(response.status_code, message)}))
    return response


def install(app) -> None:
    """Serve the Messages API on ``app`` with Anthropic-shaped errors."""
    app.register_blueprint(bp)
    app.after_request(_reshape_error)
