"""The prompt side of a chat turn: the model's output format, tools, tool choice, thinking, and
the chat template. ``spark.http.turn`` re-exports all of it; read its docstring first.

Messages are OpenAI chat messages: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``,
an assistant's ``tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]``
(content may be None), a tool result's ``tool_call_id``. Tools are OpenAI function tools
``{"type": "function", "function": {"name", "description", "parameters"}}``, passed to the
template as given. Before rendering (``template_messages``):
- an assistant call's ``arguments`` given as a JSON string is parsed into a dict: templates
  (Qwen's, Llama's, ...) write ``arguments | tojson`` or iterate ``arguments | items``, which
  would print a quoted string or fail. A string that is not a JSON object is kept as is, and
  missing arguments become ``{}``.
- a tool message without ``name`` gets the name of the call its ``tool_call_id`` answers.

Thinking: ``chat_format`` turns reasoning parsing on for models that write ``<think>``.
A request's thinking switch is ``chat_template_kwargs["enable_thinking"]`` if given, else
``enable_thinking`` (an API's own switch), else on; the server's ``disable_thinking`` is a
kill-switch that turns it off whatever the request says. It is passed to the template as
``enable_thinking``. Thinking off gives the engine a budget
of 0 (a block the model opens anyway is closed at once); on, the budget is the request's
(``thinking_budget``, or ``EFFORT_BUDGETS[reasoning_effort]``) capped by the server's
``max_thinking_budget``, which is also the default. The engine enforces a budget only for
vocabularies with ``<think>``/``</think>`` tokens. Reasoning is parsed whenever the format has
it, so a model that thinks against instructions never leaks reasoning into the content.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from spark.engine.chat_template import ChatTemplateError
from spark.http.errors import ApiError
from spark.http.tool_prompt import template_shows_tools, with_tool_prompt
from spark.parsers import detect_tool_parser, prompt_ends_in_thinking
from spark.parsers.refusal import DEFAULT_PATTERNS as DEFAULT_REFUSAL_PATTERNS

EFFORT_BUDGETS = {"minimal": 128, "low": 512, "medium": 2048, "high": 8192}  # reasoning_effort -> tokens
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template"})


# -- configuration ----------------------------------------------------------------------


@attrs.frozen
class ChatFormat:
    """What the served model writes; from ``chat_format``."""

    tool_parser: str | None  # "hermes" | "qwen3_coder" | "minimax"; None: calls are not parsed
    reasoning: bool  # split <think> blocks off as reasoning
    thinking_allowed: bool = True  # False (the server's disable_thinking): off, whatever a request says
    max_thinking_budget: int | None = None  # reasoning tokens at most per request; None: unlimited
    refusal_patterns: tuple[str, ...] = ()  # openings that make an answer a refusal (spark.parsers.refusal); (): off
    citations: bool = False  # extract the answer's links as citations (spark.parsers.citations)
    tool_prompt: bool = False  # the template shows no tools: Spark writes them in the messages (http/tool_prompt.py)


def chat_format(config, tokenizer) -> ChatFormat:
    """Resolve the server's parser settings against its model.

    Args:
      config: the ``ServeConfig`` (``tool_call_parser``, ``reasoning_parser``, ``max_thinking_budget``,
        ``disable_thinking``, ``refusal_filter``, ``refusal_patterns``, ``citations``).
      tokenizer: the model's tokenizer (its chat template and vocabulary), or None.

    Returns:
      The ``ChatFormat``: tool parser "auto" is detected from the template's tags, and is hermes,
      with the tools written into the messages, for a template that shows no tools; reasoning
      "auto" is on when the template or the vocabulary has ``<think>``.
    """
    template = _template_text(tokenizer)
    name = config.tool_call_parser
    tool_parser = detect_tool_parser(template) if name in (None, "auto") else None if name == "none" else name
    tool_prompt = (name in (None, "auto") and tool_parser is None and bool(template)
                   and not template_shows_tools(tokenizer, template))
    if tool_prompt:
        tool_parser = "hermes"  # the format spark.http.tool_prompt describes
    mode = config.reasoning_parser
    has_think = "<think>" in template or (tokenizer is not None and tokenizer.token_to_id("<think>") is not None)
    refusals = (tuple(config.refusal_patterns) or DEFAULT_REFUSAL_PATTERNS) if config.refusal_filter else ()
    return ChatFormat(tool_parser, mode == "think" or (mode == "auto" and has_think),
                      not config.disable_thinking, config.max_thinking_budget, refusals, config.citations, tool_prompt)


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        return "\n".join(str(t) for t in template.values())
    return template or ""


@attrs.frozen
class ToolChoice:
    """Whether the model may, must, or must not call tools.

    ``mode`` is "none", "auto" or "required"; ``name`` (with "required") is the one function
    it must call.
    """

    mode: str = attrs.field(default="auto", validator=attrs.validators.in_(("none", "auto", "required")))
    name: str | None = None

    @classmethod
    def named(cls, name: str) -> "ToolChoice":
        return cls("required", name)


def effort_thinking(effort: str | None, *, param: str = "reasoning_effort") -> tuple[bool | None, int | None]:
    """Map a reasoning effort to ``(enable_thinking, thinking_budget)`` for ``prepare_turn``.

    Args:
      effort: None (no opinion), "none" (thinking off), or a key of ``EFFORT_BUDGETS``.
      param: the request field, for the error.

    Returns:
      ``(None, None)``, ``(False, None)``, or ``(True, EFFORT_BUDGETS[effort])``.

    Raises:
      ApiError: 400, an unknown effort.
    """
    if effort is None:
        return None, None
    if effort == "none":
        return False, None
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:  # Responses' reasoning is untyped JSON
        raise ApiError(400, f"{param} must be one of none, {', '.join(EFFORT_BUDGETS)}; got {effort!r}", param=param)
    return True, EFFORT_BUDGETS[effort]


def check_tools(tools: Sequence[Mapping[str, Any]] | None, *, param: str = "tools") -> list[dict] | None:
    """Validate OpenAI function tools: type "function", a non-empty unique name, object parameters.

    Returns:
      The tools as a list (None for None or empty).

    Raises:
      ApiError: 400 naming the bad field, e.g. ``tools[1].function.name``.
    """
    if not tools:
        return None
    seen = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ApiError(400, f"only function tools are supported, got type {_get(tool, 'type')!r}",
                           param=f"{param}[{i}].type")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ApiError(400, "a function tool needs a function object", param=f"{param}[{i}].function")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ApiError(400, "a function tool needs a name", param=f"{param}[{i}].function.name")
        if name in seen:
            raise ApiError(400, f"two tools are named {name!r}", param=f"{param}[{i}].function.name")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ApiError(400, "parameters must be a JSON schema object", param=f"{param}[{i}].function.parameters")
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ApiError(400, f"parameters must describe an object (the call's arguments), got type "
                                f"{parameters.get('type')!r}", param=f"{param}[{i}].function.parameters.type")
    return [_with_object_parameters(t) for t in tools]


def _with_object_parameters(tool: Mapping[str, Any]) -> dict:
    """The tool with ``{"type": "object", "properties": {}}`` for parameters it leaves out (a function
    called without arguments, as OpenAI takes it), and "type": "object" where its schema leaves the type
    out: a forced call's grammar then writes an object, the only arguments a call parser reads."""
    parameters = dict(tool["function"].get("parameters") or {"properties": {}})
    return {**tool, "function": {**tool["function"], "parameters": {"type": "object", **parameters}}}


def _get(obj: object, key: str) -> object:
    return obj.get(key) if isinstance(obj, Mapping) else None


# -- rendering ----------------------------------------------------------------------------


@attrs.frozen
class RenderedPrompt:
    """A conversation rendered by the chat template and encoded."""

    prompt_ids: tuple[int, ...]
    text: str
    prompt_ends_in_thinking: bool  # the template left <think> open: the output starts as reasoning
    thinking_enabled: bool  # the format has reasoning and this request did not turn thinking off


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates read them (the rules are in the module docstring)."""
    names_by_id: dict[str, str] = {}
    out = []
    for message in messages:
        m = dict(message)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                function["arguments"] = _arguments_mapping(function.get("arguments"))
                calls.append({**call, "function": function})
                if call.get("id") and function.get("name"):
                    names_by_id[call["id"]] = function["name"]
            m["tool_calls"] = calls
        if m.get("role") == "tool" and not m.get("name") and m.get("tool_call_id") in names_by_id:
            m["name"] = names_by_id[m["tool_call_id"]]
        out.append(m)
    return out


def _arguments_mapping(arguments: object) -> object:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *, fmt: ChatFormat,
                tools: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                enable_thinking: bool | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> RenderedPrompt:
    """Render a conversation with the model's chat template and encode it.

    Only the template writes control tokens: a control token's text inside the messages or the
    tools (a user typing ``<|im_end|>``) is encoded as plain text (``literal_texts``), so that no
    client text can close a turn or open another role's.

    Args:
      tokenizer: the model's ``Tokenizer``.
      messages: OpenAI chat messages (roles already normalized to system/user/assistant/tool).
      fmt: the server's ``ChatFormat``.
      tools: the tools to show the template, or None.
      chat_template_kwargs: more template variables from the request.
      enable_thinking: the API's thinking switch, or None (see the module docstring).
      add_generation_prompt: end with the assistant's header (False: the conversation as is, ``/tokenize``).
      continue_final_message: the last message is the start of the assistant's answer (a prefill):
        the prompt ends with its text, which the model continues, not with a closed turn.

    Returns:
      The ``RenderedPrompt``.

    Raises:
      ApiError: 400, reserved template variables, a final message that cannot be continued, or the
        template failed to render.
    """
    kwargs = dict(chat_template_kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    if not isinstance(kwargs.get("enable_thinking", False), bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs.enable_thinking")
    thinking = kwargs.get("enable_thinking", True if enable_thinking is None else enable_thinking)
    thinking = thinking and fmt.thinking_allowed  # the server's kill-switch wins over every request
    if fmt.reasoning:
        kwargs["enable_thinking"] = thinking
    messages = template_messages(messages)
    if fmt.tool_prompt:  # the template would drop them: the messages carry tools, calls and results as text
        messages, tools = with_tool_prompt(messages, tools), None
    literals = LiteralTexts(tokenizer.control_texts)
    shown = literals.hide(messages)
    try:
        text = tokenizer.apply_chat_template(shown, tools=literals.hide(list(tools)) if tools else None,
                                             add_generation_prompt=add_generation_prompt and not continue_final_message,
                                             **kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, f"cannot render the chat template: {exc}", param="messages") from None
    if continue_final_message:
        text = _cut_after_final_message(text, shown)
    ids = literals.encode(tokenizer, text)
    if tokenizer.add_bos_token and ids[:1] != [tokenizer.bos_token_id]:  # as Tokenizer.encode_chat does
        ids.insert(0, tokenizer.bos_token_id)
    text = literals.restore(text)
    return RenderedPrompt(tuple(ids), text, fmt.reasoning and prompt_ends_in_thinking(text), fmt.reasoning and thinking)


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` (rendered without a generation prompt) up to the end of the last message's content, as
    transformers' ``continue_final_message`` cuts it (templates may trim the content: its stripped text)."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise ApiError(400, "only a final assistant message with text can be continued", param="messages")
    at = text.rfind(content.strip())
    if at < 0:
        raise ApiError(400, "the chat template does not write the final assistant message as given, "
                            "so it cannot be continued", param="messages")
    return text[:at + len(content.strip())]


class LiteralTexts:
    """Client texts that spell a control token, kept out of the template's reach.

    ``hide`` swaps each such spelling in every string of the messages (or tools) for a marker that
    no template touches (private-use characters around a number); ``encode`` encodes the rendered
    text, the template's own control tokens as such and each marked spelling as plain text
    (``Tokenizer.encode_literal``); ``restore`` puts the spellings back in the text. With no such
    spelling (nearly always) the text is encoded as one piece, as before.
    """

    def __init__(self, control_texts: Sequence[str]):
        self._pattern = re.compile("|".join(map(re.escape, control_texts))) if control_texts else None
        self._nonce = secrets.randbelow(10**9)
        self._hidden: dict[str, str] = {}

    def hide(self, value: Any) -> Any:
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(self._mark, value)
        if isinstance(value, Mapping):
            return {k: self.hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hide(v) for v in value]
        return value

    def _mark(self, match: re.Match) -> str:
        marker = f"\ue000{self._nonce}.{len(self._hidden)}\ue001"
        self._hidden[marker] = match.group(0)
        return marker

    def _split(self, text: str) -> list[str]:
        """Template text and markers, alternating (markers at the odd places)."""
        return re.split(f"(\ue000{self._nonce}\\.\\d+\ue001)", text)

    def encode(self, tokenizer, text: str) -> list[int]:
        if not self._hidden:
            return tokenizer.encode(text)
        ids: list[int] = []
        for i, piece in enumerate(self._split(text)):
            if i % 2 == 0:
                ids += tokenizer.encode(piece) if piece else []
            else:
                ids += tokenizer.encode_literal(self._hidden.get(piece, piece))
        return ids

    def restore(self, text: str) -> str:
        if not self._hidden:
            return text
        return "".join(self._hidden.get(piece, piece) if i % 2 else piece for i, piece in enumerate(self._split(text)))


def engine_thinking_budget(fmt: ChatFormat, thinking_enabled: bool, requested: int | None) -> int | None:
    """``SamplingParams.thinking_budget`` for a request: 0 when thinking is off, else capped.

    Raises:
      ApiError: 400, a negative budget.
    """
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 0):
        raise ApiError(400, f"thinking_budget must be a non-negative integer, got {requested!r}",
                       param="thinking_budget")
    if not fmt.reasoning:
        return None
    if not thinking_enabled:
        return 0
    cap = fmt.max_thinking_budget
    if requested is None:
        return cap
    return requested if cap is None else min(requested, cap)
