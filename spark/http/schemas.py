"""Request bodies of the OpenAI API as attrs classes, structured by one strict cattrs converter.

JSON types are checked, not coerced: ``"temperature": "0.5"`` and ``"n": 1.5`` are
errors (cattrs would otherwise call ``float("0.5")`` and ``int(1.5)``). Unknown
fields are ignored, because the OpenAI SDK sends fields we do not implement.
Ranges are checked later by ``SamplingParams`` and ``spark.http.params``.
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any

import attrs
import cattrs
from cattrs._compat import is_union_type
from cattrs.cols import list_structure_factory, mapping_structure_factory

from spark.http.errors import ApiError

Prompt = str | tuple[int, ...]  # one completion prompt: text or token ids


@attrs.frozen
class ContentPart:
    type: str
    text: str | None = None


@attrs.frozen
class FunctionCall:
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON string (OpenAI); an object is accepted too


@attrs.frozen
class MessageToolCall:
    """A call an earlier assistant message made."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"


@attrs.frozen
class ChatMessage:
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that show it


@attrs.frozen
class FunctionSpec:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class Tool:
    type: str
    function: FunctionSpec | None = None


@attrs.frozen
class NamedFunction:
    name: str


@attrs.frozen
class NamedToolChoice:
    type: str
    function: NamedFunction


@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far


@attrs.frozen(kw_only=True)
class SamplingFields:
    """The fields that chat and completion requests share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    speculative: bool | None = None  # Spark's own: false opts the request out of speculative decoding
    tbt_ms: float | None = None  # Spark's own: this stream's time-between-tokens target for SLAI, in ms


@attrs.frozen(kw_only=True)
class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None  # vLLM's: the last (assistant) message is a prefill the reply continues
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none" | "auto" | "required" | a named function
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # "none" | "minimal" | "low" | "medium" | "high"
    thinking_budget: int | None = None  # Spark's own: reasoning tokens at most
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema (spark.http.structured)


@attrs.frozen(kw_only=True)
class CompletionRequest(SamplingFields):
    prompt: tuple[Prompt, ...]  # a batch: one or more prompts
    echo: bool | None = None
    logprobs: int | None = None


# -- the converter ------------------------------------------------------------


class _Expected(ValueError):
    """A JSON value of the wrong type; the message is ``expected <type names>``."""


_NAMES = {int: "int", float: "float", str: "string", bool: "bool", list: "array", dict: "object"}


def _json_kind(tp: Any) -> type | tuple[type, ...]:
    """The Python type(s) of the JSON values that may become ``tp``."""
    origin = typing.get_origin(tp) or tp
    if tp is type(None):
        return type(None)
    if origin in (list, tuple):
        return list
    if origin is dict or attrs.has(tp):
        return dict
    if tp is float:
        return (int, float)
    return tp


def _accepts(tp: Any, value: object) -> bool:
    if isinstance(value, bool) and tp in (int, float):  # JSON true is not a number
        return False
    return isinstance(value, _json_kind(tp))


def _type_name(tp: Any) -> str:
    kind = _json_kind(tp)
    return "float" if kind == (int, float) else _NAMES.get(kind, getattr(tp, "__name__", str(tp)))


def _scalar_hook(tp: type):
    def structure(value: object, _: type) -> object:
        if not _accepts(tp, value):
            raise _Expected(f"expected {_type_name(tp)}")
        if tp is not float:
            return value
        try:
            return float(value)
        except OverflowError:  # an integer literal past the largest float
            raise _Expected("expected float, got an integer too large for one") from None

    return structure


def _union_hook(tp: Any):
    members = typing.get_args(tp)
    names = " or ".join(_type_name(m) for m in members if m is not type(None))

    def structure(value: object, _: type) -> object:
        for member in members:  # dispatch on the JSON type, the first member that takes it wins
            if _accepts(member, value):
                return None if value is None else converter.structure(value, member)
        raise _Expected(f"expected {names}")

    return structure


def _container_hook(tp: Any):
    kind = _json_kind(tp)
    make = list_structure_factory if kind is list else mapping_structure_factory
    inner = make(tp, converter)  # cattrs' own, which reports the index or key of a bad item

    def structure(value: object, _: type) -> object:
        if not isinstance(value, kind):  # cattrs would iterate a string into a list of characters
            raise _Expected(f"expected {_NAMES[kind]}")
        return inner(value, tp)

    return structure


def _prompt_hook(value: object, _: type) -> tuple[Prompt, ...]:
    """A string, token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if all(_accepts(int, v) for v in value):
            return (tuple(value),)
        if all(isinstance(v, str) for v in value):
            return tuple(value)
        if all(isinstance(v, list) and v and all(_accepts(int, t) for t in v) for v in value):
            return tuple(tuple(v) for v in value)
    raise _Expected("expected string, array of int, or array of those")


converter = cattrs.Converter(forbid_extra_keys=False)
for _tp in (int, float, str, bool):
    converter.register_structure_hook(_tp, _scalar_hook(_tp))
converter.register_structure_hook_factory(is_union_type, _union_hook)
converter.register_structure_hook_factory(lambda t: typing.get_origin(t) in (list, dict), _container_hook)
converter.register_structure_hook_func(lambda t: t == tuple[Prompt, ...], _prompt_hook)


def _format(exc: BaseException, tp: type | None) -> str:
    if isinstance(exc, _Expected):
        return f"invalid value for type, {exc}"
    return cattrs.v.format_exception(exc, tp)


MAX_JSON_DEPTH = 64  # far deeper than any API body; deeper ones are refused before anything recurses


def read_json(raw: bytes) -> Any:
    """A request body's JSON, refused with one 400 when it is not JSON any later stage can take:
    invalid, nested past ``MAX_JSON_DEPTH``, an integer too long to convert, or a string holding
    a lone surrogate (which no tokenizer, log or database can encode).

    Raises:
        ApiError: 400 ``invalid_json``, naming where the problem is as ``param`` when it can.
    """
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") \
            from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, and integers past Python's digit limit
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    _check_tree(body)
    return body


def _refuse_constant(name: str) -> float:
    # Python's json takes NaN and Infinity, which are not JSON: nothing downstream can store them.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _check_tree(body: Any) -> None:
    """Depth and lone surrogates, walked without recursion."""
    stack = [(body, "$", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, f"{path}.{key}", depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        param = path.removeprefix("$").lstrip(".") or None
        raise ApiError(400, f"{path} holds a lone UTF-16 surrogate, which is not text", param=param,
                       code="invalid_json") from None


def parse_body(raw: bytes, cls: type) -> Any:
    """Decode a JSON request body into ``cls``.

    Raises:
        ApiError: 400, naming the first bad field as ``param``.
    """
    return structure_body(read_json(raw), cls)


def structure_body(body: Any, cls: type) -> Any:
    """A request body's JSON (``read_json``'s) as ``cls``.

    Raises:
        ApiError: 400, naming the first bad field as ``param``.
    """
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    try:
        return converter.structure(body, cls)
    except cattrs.BaseValidationError as exc:
        lines = cattrs.transform_error(exc, path="$", format_exception=_format)
        param = lines[0].rpartition(" @ $")[2].lstrip(".") or None
        raise ApiError(400, "; ".join(lines), param=param) from None
