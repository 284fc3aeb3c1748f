"""From a parsed request to the ``GenerateRequest``s that serve it: checks, prompts, sampling.

Everything here is synchronous and testable without a server: ``Limits`` carries
what the checks need to know about the served model.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping, Sequence

import attrs

from spark.actors.messages import GenerateRequest
from spark.control.served import ServedModel
from spark.core.grammar import GrammarSpec
from spark.core.scheduler import PrefixPin
from spark.engine.sampling import MAX_LOGPROBS, SamplingParams
from spark.http.errors import ApiError
from spark.http.response_items import OUTPUT_TEXT_LOGPROBS, ResponsesRequest
from spark.http.structured import output_schema
from spark.http.schemas import ChatRequest, CompletionRequest, MessageToolCall, SamplingFields
from spark.http.turn import ToolChoice, effort_thinking

MAX_N = 16
MAX_STOP = 16
MODEL_ALIAS = "sparky"
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@attrs.frozen
class Limits:
    """What the checks need to know about the served model."""

    served_name: str
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    sampling_defaults: tuple[tuple[str, float], ...] = ()  # the recipe's, for fields a request leaves out

    @classmethod
    def of(cls, model: ServedModel) -> Limits:
        return cls(model.served_name, model.max_model_len, model.vocab_size, model.config.default_max_tokens,
                   tuple(model.sampling_defaults.items()))


@attrs.frozen
class Job:
    """A request turned into generations: choice ``i`` of the response is ``requests[i]``."""

    requests: tuple[GenerateRequest, ...]
    prompt_tokens: int  # over distinct prompts (n copies of a prompt count once)
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # each streamed chunk carries its choice's usage so far (vLLM's option)


def sampling_params(limits: Limits, given: Mapping[str, object], *, max_tokens: int | None,
                    param: str = "max_tokens", logprobs: int | None = None) -> SamplingParams:
    """A request's sampling: the fields it gives (None: left out) over the recipe's defaults, validated.

    ``max_tokens`` None takes the server's default; it is capped to each prompt's room later (``room_left``).

    Raises:
        ApiError: 400 naming the bad field (``param`` for max_tokens).
    """
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{param} must be at least 1, got {max_tokens}", param=param)
    fields = {**dict(limits.sampling_defaults), **{k: v for k, v in given.items() if v is not None}}
    try:
        return SamplingParams(**fields, logprobs=logprobs, max_tokens=max_tokens or limits.default_max_tokens)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None


def base_params(req: SamplingFields, limits: Limits, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The sampling parameters of an OpenAI chat or completion request (``sampling_params`` of its fields).

    Raises:
        ApiError: 400 naming the bad field.
    """
    for token in (req.logit_bias or {}):  # isdigit() alone takes "²", and int() refuses 5000 digits: both were a 500
        if not (token.isascii() and token.isdigit() and len(token) <= 12 and int(token) < limits.vocab_size):
            raise ApiError(400, f"logit_bias key {token!r} is not a token id below {limits.vocab_size}",
                           param="logit_bias")
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "logit_bias", "ignore_eos")}
    return sampling_params(limits, given, max_tokens=max_tokens, logprobs=logprobs)


def room_left(params: SamplingParams, prompt: Sequence[int], limits: Limits, *,
              param: str = "messages") -> SamplingParams:
    """``params`` with ``max_tokens`` capped to the context ``prompt`` leaves.

    Raises:
        ApiError: 400 ``context_length_exceeded`` when the prompt leaves no room to generate.
    """
    room = limits.max_model_len - len(prompt)
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens, the context holds {limits.max_model_len}: "
                            "no room left to generate", param=param, code="context_length_exceeded")
    return params if params.max_tokens <= room else attrs.evolve(params, max_tokens=room)


def stop_strings(stop: str | list[str] | None, *, param: str = "stop") -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"{param} holds {len(stops)} strings, at most {MAX_STOP} are allowed", param=param)
    if any(not s for s in stops):
        raise ApiError(400, f"{param} must not hold an empty string", param=param)
    return stops


def num_choices(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    return n


def chat_messages(req: ChatRequest) -> list[dict]:
    """The conversation as OpenAI-shaped dicts (``spark.http.turn`` reads them): roles normalized,
    text parts joined, assistant ``tool_calls`` and tool results kept."""
    if not req.messages:
        raise ApiError(400, "messages must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise ApiError(400, f"unsupported role {m.role!r}; use system, developer, user, assistant or tool",
                           param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"unsupported content part type {part.type!r}; only text parts are",
                                   param=f"messages[{i}].content[{j}]")
            content = "\n".join(part.text for part in content)
        elif content is None:
            if role != "assistant":
                raise ApiError(400, f"a {m.role} message needs content", param=f"messages[{i}].content")
            content = ""
        message = {"role": role, "content": content} | ({"name": m.name} if m.name else {})
        if role == "tool":
            if not m.tool_call_id:
                raise ApiError(400, "a tool message needs the tool_call_id it answers",
                               param=f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m.tool_call_id
        if role == "assistant" and m.tool_calls:
            message["tool_calls"] = [_message_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                     for j, call in enumerate(m.tool_calls)]
        if role == "assistant" and m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def _message_tool_call(call: MessageToolCall, param: str) -> dict:
    if call.type != "function":
        raise ApiError(400, f"only function tool calls are supported, got {call.type!r}", param=f"{param}.type")
    arguments = call.function.arguments
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)  # as OpenAI sends them: a JSON string
    return {"id": call.id or f"call_{secrets.token_hex(8)}", "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def chat_tools(req: ChatRequest) -> list[dict] | None:
    """The request's tools as OpenAI dicts (``spark.http.turn.check_tools`` checks them)."""
    if not req.tools:
        return None
    return [{"type": tool.type} | ({} if tool.function is None else
                                   {"function": {k: v for k, v in attrs.asdict(tool.function).items() if v is not None}})
            for tool in req.tools]


def tool_choice(req: ChatRequest) -> ToolChoice:
    """``tool_choice``: "none", "auto" (the default), "required", or ``{"type": "function", "function": {"name"}}``."""
    choice = req.tool_choice
    if choice is None:
        return ToolChoice("auto")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                           param="tool_choice")
        return ToolChoice(choice)
    if choice.type != "function":
        raise ApiError(400, f"tool_choice type must be function, got {choice.type!r}", param="tool_choice.type")
    return ToolChoice.named(choice.function.name)


def chat_turn(req: ChatRequest) -> dict:
    """The keyword arguments of ``spark.http.turn.prepare_turn`` for a chat completion request.

    Thinking: ``thinking_budget`` (Spark's field) wins over ``reasoning_effort``, which maps
    through ``EFFORT_BUDGETS``; ``reasoning_effort: "none"`` turns thinking off.
    """
    enable_thinking, budget = effort_thinking(req.reasoning_effort)
    if req.thinking_budget is not None:
        budget = req.thinking_budget
    return {"messages": chat_messages(req), "tools": chat_tools(req), "tool_choice": tool_choice(req),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "chat_template_kwargs": req.chat_template_kwargs or {}, "enable_thinking": enable_thinking,
            "thinking_budget": budget, "output_schema": output_schema(req.response_format, param="response_format"),
            "continue_final_message": bool(req.continue_final_message)}


def encode_prompts(tokenizer, req: CompletionRequest, vocab_size: int) -> list[list[int]]:
    """Completion prompts as token ids: texts are encoded, ids are checked against the vocabulary."""
    out = []
    for i, prompt in enumerate(req.prompt):
        ids = tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, "prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", param="prompt")
        out.append(ids)
    return out


@attrs.frozen
class Echo:
    """A completion prompt as ``echo`` writes it before the choice's text: the prompt's own text (a token-id
    prompt decoded), and its tokens' texts for ``logprobs`` (their logprobs come from the engine, with the
    first generated token: ``SamplingParams.prompt_logprobs``)."""

    text: str
    tokens: tuple[str, ...] = ()


def echoes(tokenizer, req: CompletionRequest, prompts: Sequence[Sequence[int]]) -> list[Echo]:
    """Per choice (``build_job``'s order: each prompt ``n`` times), what ``echo`` writes first."""
    n = num_choices(req.n)
    out = []
    for prompt, ids in zip(req.prompt, prompts):
        text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
        tokens = tuple(tokenizer.token_text(t) for t in ids) if req.logprobs is not None else ()
        out += [Echo(text, tokens)] * n
    return out


def scores_only(req: CompletionRequest) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt scored, nothing generated (lm-evaluation-harness's
    loglikelihood). The engine stops at one token, which the response leaves out (``max_tokens`` 0
    without echo stays a 400: it would return nothing at all)."""
    return bool(req.echo) and req.max_tokens == 0


def completion_params(req: CompletionRequest, limits: Limits) -> SamplingParams:
    """A completion's sampling parameters; with ``echo`` and ``logprobs``, its prompt is scored too."""
    params = base_params(req, limits, max_tokens=1 if scores_only(req) else req.max_tokens, logprobs=logprobs_k(req))
    return attrs.evolve(params, prompt_logprobs=params.logprobs) if req.echo and params.logprobs is not None else params


def build_job(request_id: str, req: SamplingFields, prompts: Sequence[Sequence[int]], params: SamplingParams,
              limits: Limits, *, api_key: str | None, grammar: GrammarSpec | None = None) -> Job:
    """One ``GenerateRequest`` per prompt and choice, ``max_tokens`` capped to the context left.

    With a seed, choice ``i`` of a prompt uses ``seed + i``: the choices differ but reproduce.

    Raises:
        ApiError: 400 ``context_length_exceeded`` when a prompt leaves no room to generate.
    """
    n = num_choices(req.n)
    stop = stop_strings(req.stop)
    tbt_s = tbt_target(req.tbt_ms)
    requests = []
    for p, prompt in enumerate(prompts):
        capped = room_left(params, prompt, limits, param="messages" if isinstance(req, ChatRequest) else "prompt")
        for i in range(n):
            seed = None if params.seed is None else params.seed + i
            requests.append(GenerateRequest(
                request_id=f"{request_id}-{p * n + i}", prompt_ids=tuple(prompt),
                params=attrs.evolve(capped, seed=seed), stop=stop, api_key=api_key,
                skip_special_tokens=req.skip_special_tokens is not False, grammar=grammar,
                speculative=req.speculative is not False, tbt_s=tbt_s))
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    return Job(tuple(requests), sum(len(p) for p in prompts), bool(req.stream), include_usage, continuous)


def tbt_target(tbt_ms: float | None) -> float | None:
    """``tbt_ms`` in seconds, or a 400 naming it when it is no positive finite number."""
    if tbt_ms is None:
        return None
    if not 0 < tbt_ms < math.inf:
        raise ApiError(400, f"tbt_ms must be a positive number of milliseconds, got {tbt_ms}", param="tbt_ms")
    return tbt_ms / 1000.0


def single_job(request_id: str, prompt: Sequence[int], params: SamplingParams, limits: Limits, *, stream: bool,
               stop: tuple[str, ...] = (), api_key: str | None, pins: tuple[PrefixPin, ...] = (),
               grammar: GrammarSpec | None = None, speculative: bool | None = None,
               tbt_ms: float | None = None, param: str = "messages") -> Job:
    """The one generation of a request that has no choices (Anthropic Messages, Responses); ``pins``:
    prefixes of it the next turn will extend (``GenerateRequest.pins``); ``speculative``, ``tbt_ms``:
    Spark's own request fields, as ``build_job`` takes them; ``param``: the field a prompt too long is blamed on.

    Raises:
        ApiError: 400 ``context_length_exceeded`` when the prompt leaves no room to generate.
    """
    request = GenerateRequest(request_id, tuple(prompt), room_left(params, prompt, limits, param=param),
                              stop=stop, api_key=api_key,
                              pins=pins, grammar=grammar, speculative=speculative is not False,
                              tbt_s=tbt_target(tbt_ms))
    return Job((request,), len(prompt), stream, include_usage=False)


def logprobs_k(req: ChatRequest | CompletionRequest | ResponsesRequest) -> int | None:
    """``SamplingParams.logprobs``: for chat, None unless ``logprobs`` is true, then ``top_logprobs``
    alternatives; for Responses, None unless ``include`` names the output text's logprobs, then
    ``top_logprobs`` alternatives (checked either way, as OpenAI's); for completions, the ``logprobs`` count."""
    if isinstance(req, CompletionRequest):
        k, param = req.logprobs, "logprobs"
    elif isinstance(req, ResponsesRequest):
        _check_logprobs_k(req.top_logprobs, "top_logprobs")
        return (req.top_logprobs or 0) if OUTPUT_TEXT_LOGPROBS in (req.include or ()) else None
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        k, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    _check_logprobs_k(k, param)
    return k


def _check_logprobs_k(k: int | None, param: str) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {k}", param=param)
