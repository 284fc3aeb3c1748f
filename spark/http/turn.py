"""One chat turn: a conversation rendered into a prompt, generated, and parsed into content,
reasoning and tool calls. Every chat API (OpenAI chat completions, Anthropic Messages,
Responses) converts its request into OpenAI-shaped messages and tools, and builds its
response from the events below; nothing here knows a wire format.

    fmt = chat_format(system.config, system.tokenizer)       # what the served model writes (cheap)
    turn = prepare_turn(system.tokenizer, fmt, messages, tools=tools, tool_choice=ToolChoice("auto"),
                        chat_template_kwargs={}, enable_thinking=None, thinking_budget=None)
    # ^ renders the chat template: call it off the event loop (trio.to_thread.run_sync)
    request = GenerateRequest(rid, turn.prompt.prompt_ids, turn.sampling(params), stop=stops)
    async for choice, piece, events in turn_steps(fanin, parsers):   # what the HTTP routes read
        ...  # ContentDelta(text) | ReasoningDelta(text) | RefusalDelta(text) | ToolCallDelta(index, id, name, arguments)
             # then exactly one TurnDone(result, finish_reason, usage, stop_string, error) per choice, last

The routes submit through ``spark.http.spine`` (a ``FanIn`` of the request's choices, one parser
each); ``turn_events`` flattens one choice's events. Outside HTTP, ``run_turn`` submits one
generation and reads it the same way:

    async with run_turn(system, request, turn.parser()) as events:   # ApiError at once if refused
        async for event in events:
            ...
    done = await run_turn(system, request, turn.parser()).collect()   # not streamed: the same TurnDone

Messages, tools and thinking (how the prompt is rendered, how the thinking switch and budget
are settled) are in ``spark.http.chat_prompt``, whose names this module re-exports.

Tool choice (``ToolChoice``): "none" renders without tools and parses no calls; "auto" lets the
model choose; "required" (or a function name) needs at least one call (to that function). Until
constrained decoding exists, a reply that breaks it ends the turn with ``TurnDone.error``:
422 ``tool_choice_not_satisfied``. A call to another name ends the turn at once, before any of
its deltas; a missing call is known at the end (a reply cut off by max_tokens ends "length"). With
``parallel_tool_calls=False`` only the first call is kept. Calls to tools that were not offered are
returned with ``unknown=True``; they do not satisfy "required".

Refusals and citations (the server's ``ChatFormat``): an answer that opens with one of the refusal
patterns streams as ``RefusalDelta``s and ends in ``TurnResult.refusal`` (``spark.parsers.refusal``);
the links of an answer are ``TurnResult.citations`` (``spark.parsers.citations``). Each API writes
them in its own fields.

Finish reasons: "tool_calls" when calls were made and the model stopped; else the engine's
"stop" or "length" ("length" wins over calls); "error" with ``TurnDone.error`` set (the error
piece's, a stream that failed, or one that ended early). A call the output was cut off in is
``ToolCall.incomplete`` (its arguments as far as they went) if its name was whole, else not
there at all: its markup never becomes content (``spark.parsers``).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import attrs

from spark.actors.messages import GenerateRequest, RequestOutput
from spark.actors.ingress import SubmitError
from spark.engine.sampling import SamplingParams
from spark.http.chat_prompt import (EFFORT_BUDGETS, ChatFormat, RenderedPrompt, ToolChoice, chat_format, check_tools,
                                    effort_thinking, engine_thinking_budget, render_chat, template_messages)
from spark.control.served import GenerationStream, ServedModel
from spark.core.grammar import GrammarSpec
from spark.http import structured
from spark.http.errors import ApiError
from spark.http.fanin import StreamFailed, tagged
from spark.parsers import (ChatOutputParser, ContentDelta, ReasoningDelta, ToolCall, ToolCallDelta,
                           to_openai_tool_calls)
from spark.parsers.citations import Citation, extract_citations
from spark.parsers.refusal import RefusalDelta, RefusalFilter

__all__ = [
    "EFFORT_BUDGETS", "ChatFormat", "Citation", "ContentDelta", "PreparedTurn", "ReasoningDelta", "RefusalDelta",
    "RenderedPrompt", "ToolCall",
    "ToolCallDelta", "ToolChoice", "TurnDone", "TurnEvent", "TurnParser", "TurnResult", "TurnStream", "Usage",
    "chat_format", "check_tools", "effort_thinking", "engine_thinking_budget", "prepare_turn", "render_chat",
    "collect_turn", "run_turn", "template_messages", "turn_events", "turn_steps",
]

TOOL_CHOICE_NOT_SATISFIED = "tool_choice_not_satisfied"


# -- parsing ------------------------------------------------------------------------------


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, found in the prefix cache


@attrs.frozen
class TurnResult:
    """The whole reply: what the streamed deltas add up to."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...] = ()  # .id, .name, .arguments (a dict), .unknown, .incomplete
    refusal: str = ""  # the answer, when it refused (content is then empty)
    citations: tuple[Citation, ...] = ()  # the links in content, when the server extracts them

    def openai_tool_calls(self) -> list[dict[str, Any]]:
        """``[{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}]``."""
        return to_openai_tool_calls(self.tool_calls)


@attrs.frozen
class TurnDone:
    """The last event of a turn."""

    result: TurnResult
    finish_reason: str  # "stop" | "length" | "tool_calls" | "error"
    usage: Usage
    stop_string: str | None = None  # the stop string that ended the output, if one did
    error: ApiError | None = attrs.field(default=None, eq=False)  # set when finish_reason == "error":
    # 500 generation_failed, or 422 tool_choice_not_satisfied (``.status``, ``.code``, ``.message``)


TurnEvent = ContentDelta | ReasoningDelta | RefusalDelta | ToolCallDelta | TurnDone


class TurnParser:
    """Parse one reply as it streams: reasoning, content and tool calls, with the tool choice enforced.

    Args:
      tool_parser: a ``spark.parsers.TOOL_PARSERS`` name, or None for no tool-call parsing.
      reasoning: split ``<think>`` blocks off as reasoning.
      tools: the offered tools (they type XML-format arguments and flag unknown names), or None.
      prompt_ends_in_thinking: the output starts inside ``<think>``.
      tool_choice: checked against the calls (see the module docstring).
      parallel_tool_calls: False keeps only the first call.
      id_prefix: call ids are this plus 8 hex digits (default: random).
      refusal_patterns: an answer that opens with one is a refusal (``RefusalDelta``s, ``TurnResult.refusal``).
      citations: extract the links of the answer (``TurnResult.citations``).
    """

    def __init__(self, tool_parser: str | None, reasoning: bool, tools: Sequence[Mapping[str, Any]] | None = None,
                 prompt_ends_in_thinking: bool = False, *, tool_choice: ToolChoice = ToolChoice(),
                 parallel_tool_calls: bool = True, id_prefix: str | None = None,
                 refusal_patterns: Sequence[str] = (), citations: bool = False):
        self.reasoning = reasoning  # whether a response should show a reasoning field
        self.citations = citations
        self._refusals = RefusalFilter(refusal_patterns)
        self.tool_choice = tool_choice
        self.parallel_tool_calls = parallel_tool_calls
        self._stream = ChatOutputParser(tool_parser, reasoning, tools, prompt_ends_in_thinking, id_prefix=id_prefix)
        self._violation: str | None = None
        self._done: TurnDone | None = None
        # Under "required", content waits for the first call: a reply that makes none ends in an
        # error, and a stream must not have sent content it then disowns.
        self._held: list[ContentDelta] = []
        self._called = False

    def feed(self, text: str) -> list[TurnEvent]:
        """Add output text; returns the content, reasoning and tool-call deltas now certain."""
        return self._keep(self._stream.feed(text))

    def flush(self) -> list[TurnEvent]:
        """Mark the end of the output; returns the deltas held back until now."""
        events = self._keep(self._stream.flush())
        return events + (self._refusals.flush() if self._violation is None else [])

    def finish(self) -> TurnResult:
        """The whole reply (call ``flush`` first to get the last deltas)."""
        out = self._stream.finish()
        calls = tuple(out.tool_calls if self.parallel_tool_calls else out.tool_calls[:1])
        if self._refusals.refused:
            return TurnResult("", out.reasoning, calls, refusal=out.content.lstrip())
        return TurnResult(out.content, out.reasoning, calls,
                          citations=extract_citations(out.content) if self.citations else ())

    def step(self, piece: RequestOutput) -> list[TurnEvent]:
        """Turn one engine piece into events; the last piece's events end with a ``TurnDone``.

        Returns nothing once a ``TurnDone`` was returned (after an error, stop reading).
        """
        if self._done is not None:
            return []
        if piece.finish_reason == "error":
            return [self._end(piece, "error", ApiError.generation_failed(piece.error or "unknown error"))]
        events = self.feed(piece.text) if piece.text else []
        if piece.finish_reason is None and self._violation is None:
            return events
        if self._violation is None:
            events += self.flush()
        done = self._end(piece, piece.finish_reason)
        if done.error is None:
            events += self._held  # cut off before any call ("length"): the text before it was the reply after all
        self._held = []
        return events + [done]

    def fail(self, message: str) -> TurnDone:
        """End the turn with a generation error (the stream broke off)."""
        return self._end(RequestOutput("", "", ()), "error", ApiError.generation_failed(message))

    @property
    def done(self) -> TurnDone | None:
        return self._done

    def _end(self, piece: RequestOutput, reason: str | None, error: ApiError | None = None) -> TurnDone:
        result = self.finish()
        if (reason == "stop" and self._violation is None and self.tool_choice.mode == "required"
                and not any(not call.unknown for call in result.tool_calls)):  # cut off ("length"): say so instead
            wanted = f"a call to {self.tool_choice.name!r}" if self.tool_choice.name else "a tool call"
            self._violation = f"tool_choice requires {wanted}, and the model made none"
        if error is None and self._violation is not None:
            error = ApiError(422, self._violation, param="tool_choice", code=TOOL_CHOICE_NOT_SATISFIED)
        if error is not None:
            reason = "error"
        elif result.tool_calls and reason == "stop":
            reason = "tool_calls"
        self._done = TurnDone(result, reason or "stop", Usage(piece.num_prompt_tokens, piece.num_output_tokens, piece.num_cached_tokens),
                              piece.stop_string, error)
        return self._done

    def _keep(self, events: list) -> list[TurnEvent]:
        if self._violation is not None:
            return []
        out = []
        for event in events:
            if isinstance(event, ToolCallDelta):
                if event.index > 0 and not self.parallel_tool_calls:
                    continue
                wanted = self.tool_choice.name
                if event.name is not None and wanted is not None and event.name != wanted:
                    self._violation = f"tool_choice requires a call to {wanted!r}, the model called {event.name!r}"
                    break
                if not self._called:
                    self._called = True
                    out += self._held
                    self._held = []
            elif isinstance(event, ContentDelta) and self.tool_choice.mode == "required" and not self._called:
                self._held.append(event)
                continue
            out.append(event)
        return self._refusals.feed(out)


# -- a turn end to end ----------------------------------------------------------------------


@attrs.frozen
class PreparedTurn:
    """A rendered prompt plus what its generation and parsing need; from ``prepare_turn``."""

    prompt: RenderedPrompt
    fmt: ChatFormat
    tools: tuple[dict, ...] | None  # the offered tools (None with tool_choice "none")
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    thinking_budget: int | None  # for the engine; None: unlimited
    grammar: GrammarSpec | None = None  # what decoding follows (spark.http.structured); None: free
    tool_parser: str | None = None  # the format calls are read in (the model's, or the one a grammar forces)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` with this turn's thinking budget and start state."""
        return attrs.evolve(params, thinking_budget=self.thinking_budget,
                            starts_in_thinking=self.prompt.prompt_ends_in_thinking)

    def parser(self, *, id_prefix: str | None = None) -> TurnParser:
        """A fresh parser for one reply (one per choice)."""
        return TurnParser(self.tool_parser if self.tools else None, self.fmt.reasoning, self.tools,
                          self.prompt.prompt_ends_in_thinking, tool_choice=self.tool_choice,
                          parallel_tool_calls=self.parallel_tool_calls, id_prefix=id_prefix,
                          refusal_patterns=self.fmt.refusal_patterns, citations=self.fmt.citations)


def prepare_turn(tokenizer, fmt: ChatFormat, messages: Sequence[Mapping[str, Any]], *,
                 tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: ToolChoice = ToolChoice(),
                 parallel_tool_calls: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None,
                 enable_thinking: bool | None = None, thinking_budget: int | None = None,
                 output_schema: str | None = None, continue_final_message: bool = False) -> PreparedTurn:
    """Check the tools and the tool choice, render the prompt, and settle thinking.

    Renders the chat template: call it off the event loop.

    Args:
      tokenizer: the model's ``Tokenizer``.
      fmt: from ``chat_format``.
      messages: OpenAI chat messages.
      tools: OpenAI function tools, or None.
      tool_choice: see ``ToolChoice``.
      parallel_tool_calls: False keeps only the first call.
      chat_template_kwargs: more template variables (``enable_thinking`` among them).
      enable_thinking: the API's thinking switch, or None.
      thinking_budget: reasoning tokens asked for, or None (capped by the server's maximum).
      output_schema: the JSON schema (text) the answer must follow, or None (``structured.output_schema``).
      continue_final_message: the last (assistant) message is a prefill the answer continues (``render_chat``).

    Returns:
      The ``PreparedTurn``.

    Raises:
      ApiError: 400 naming the bad field.
    """
    tools = check_tools(tools)
    if tool_choice.mode == "required" and not tools:
        raise ApiError(400, "tool_choice requires a tool call, but no tools were given", param="tool_choice")
    names = {t["function"]["name"] for t in tools or ()}
    if tool_choice.name is not None and tool_choice.name not in names:
        raise ApiError(400, f"tool_choice names {tool_choice.name!r}, which is not among the tools",
                       param="tool_choice")
    offered = tuple(tools) if tools and tool_choice.mode != "none" else None
    prompt = render_chat(tokenizer, messages, fmt=fmt, tools=offered, chat_template_kwargs=chat_template_kwargs,
                         enable_thinking=enable_thinking, continue_final_message=continue_final_message)
    budget = engine_thinking_budget(fmt, prompt.thinking_enabled, thinking_budget)
    reasoning = structured.reasoning_mode(fmt.reasoning, prompt.thinking_enabled, prompt.prompt_ends_in_thinking)
    grammar = structured.turn_grammar(tool_parser=fmt.tool_parser, tools=offered, tool_choice=tool_choice,
                                      parallel_tool_calls=parallel_tool_calls, schema=output_schema, reasoning=reasoning)
    parser = fmt.tool_parser
    if parser is None and grammar is not None and structured.constrains_calls(offered, tool_choice):
        parser = structured.FORCED_DEFAULT_PARSER  # the format the grammar wrote the calls in
    return PreparedTurn(prompt, fmt, offered, tool_choice, parallel_tool_calls, budget, grammar, parser)


async def turn_steps(pieces: AsyncIterable[tuple[int, RequestOutput]], parsers: Sequence[TurnParser]
                     ) -> AsyncIterator[tuple[int, RequestOutput | None, list[TurnEvent]]]:
    """How every chat API reads its generations: each piece of each choice, with the events it makes.

    Args:
      pieces: ``(choice, piece)`` in arrival order (a ``FanIn``).
      parsers: one fresh ``TurnParser`` per choice.

    Returns:
      ``(choice, piece, events)``; a choice's last events end with its ``TurnDone``. Pieces that
      fail (``StreamFailed``) or end before a choice's last piece end that choice with a ``TurnDone``
      error (500 generation_failed), given with piece None.
    """
    left = len(parsers)
    try:
        async for i, piece in pieces:
            events = parsers[i].step(piece)
            yield i, piece, events
            if events and isinstance(events[-1], TurnDone):
                left -= 1
                if not left:  # a turn may end before its stream (a broken tool choice): read no further
                    return
        why = "the stream ended early (is the server shutting down?)"
    except StreamFailed as exc:
        why = str(exc)
    for i, parser in enumerate(parsers):
        if parser.done is None:
            yield i, None, [parser.fail(why)]


async def turn_events(pieces: AsyncIterable[tuple[int, RequestOutput]], parser: TurnParser
                      ) -> AsyncIterator[TurnEvent]:
    """The events of one choice, one by one (``turn_steps`` with one parser)."""
    async with aclosing(turn_steps(pieces, [parser])) as steps:
        async for _, _, events in steps:
            for event in events:
                yield event


async def collect_turn(pieces: AsyncIterable[tuple[int, RequestOutput]], parser: TurnParser) -> TurnDone:
    """Read one choice to its end; returns its ``TurnDone`` (the deltas are in its result)."""
    async with aclosing(turn_steps(pieces, [parser])) as steps:
        async for _ in steps:
            pass
    return parser.done


class TurnStream:
    """The events of one generation (``run_turn``); ``async with`` it: leaving before ``TurnDone`` cancels it."""

    def __init__(self, stream: GenerationStream, parser: TurnParser):
        self._stream = stream
        self.parser = parser
        self._events = turn_events(tagged(stream), parser)

    async def __aenter__(self) -> TurnStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._events.aclose()
        await self._stream.aclose()

    def __aiter__(self) -> AsyncIterator[TurnEvent]:
        return self._events

    async def collect(self) -> TurnDone:
        """Read the whole turn; returns its ``TurnDone`` (the deltas are in its result)."""
        async with self:
            return await collect_turn(tagged(self._stream), self.parser)


def run_turn(system: ServedModel, request: GenerateRequest, parser: TurnParser) -> TurnStream:
    """Submit one generation and parse it as it streams (outside HTTP: the routes go through ``spark.http.spine``).

    Args:
      system: the ``SparkSystem`` (or any ``ServedModel``).
      request: the generation (its params from ``PreparedTurn.sampling``).
      parser: a fresh ``TurnParser`` (``PreparedTurn.parser()``).

    Returns:
      A ``TurnStream``: ``async with`` it and iterate ``TurnEvent``s, or ``await .collect()``.

    Raises:
      ApiError: the system refused the request (429 rate limited, 503 queue full, 400 too long).
    """
    try:
        stream = system.submit(request)
    except SubmitError as exc:
        raise ApiError.refused(exc) from None
    return TurnStream(stream, parser)
