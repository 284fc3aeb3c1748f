"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

    POST /tokenize    {"model", "prompt": "text"}                -> {"count", "max_model_len", "tokens", "token_strs"}
                      {"model", "messages": [...], "add_generation_prompt": true}
    POST /detokenize  {"model", "tokens": [ids]}                 -> {"prompt": "text"}

A prompt is encoded as ``/v1/completions`` encodes it (``add_special_tokens`` true by default);
messages are rendered as ``/v1/chat/completions`` renders them (``add_special_tokens`` false by
default: the chat template writes them), so ``count`` is what a request would cost. Like vLLM
these paths sit outside ``/v1``; like every route that names a model they go through the
gateway (an upstream recipe's server answers for it). Bad input is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import trio
from quart import Blueprint

from spark.http.chat_prompt import chat_format, check_tools, render_chat
from spark.http.errors import ApiError
from spark.http.gateway import generates
from spark.http.params import chat_messages, chat_tools
from spark.http.schemas import ChatMessage, Tool
from spark.http.spine import Serving, request_body

bp = Blueprint("tokenize", __name__)


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    """A prompt or messages, as vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # messages: end with the assistant's header (default true)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None  # also each token's text


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    model: str | None = None
    tokens: list[int]


@generates(bp, "/tokenize", logged=False)
async def tokenize(serving: Serving):
    req = await request_body(TokenizeRequest)
    tokenizer = _tokenizer(serving)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give either prompt (a text) or messages (a chat), not both or neither", param="prompt")
    if req.prompt is not None:
        ids = await trio.to_thread.run_sync(functools.partial(
            tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens is not False))
    else:
        ids = await trio.to_thread.run_sync(_chat_ids, serving, req)
    body = {"count": len(ids), "max_model_len": serving.limits.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = [tokenizer.token_text(i) for i in ids]
    return body


def _chat_ids(serving: Serving, req: TokenizeRequest) -> list[int]:
    """The messages' prompt ids, rendered as a chat completion renders them."""
    model = serving.model
    tools = check_tools(chat_tools(req))
    prompt = render_chat(model.tokenizer, chat_messages(req), fmt=chat_format(model.config, model.tokenizer),
                         tools=tools, chat_template_kwargs=req.chat_template_kwargs,
                         add_generation_prompt=req.add_generation_prompt is not False)
    if req.add_special_tokens:  # the tokenizer's own BOS/EOS on top of what the template wrote
        return model.tokenizer.encode(prompt.text, add_special_tokens=True)
    return list(prompt.prompt_ids)


@generates(bp, "/detokenize", logged=False)
async def detokenize(serving: Serving):
    req = await request_body(DetokenizeRequest)
    tokenizer = _tokenizer(serving)
    vocab = serving.limits.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise ApiError(400, f"token id {token} is outside the vocabulary (size {vocab})", param=f"tokens[{i}]")
    return {"prompt": await trio.to_thread.run_sync(tokenizer.decode, req.tokens)}


def _tokenizer(serving: Serving):
    tokenizer = serving.model.tokenizer
    if tokenizer is None:
        raise ApiError(400, f"model {serving.limits.served_name!r} has no tokenizer", param="model",
                       code="no_tokenizer")
    return tokenizer
