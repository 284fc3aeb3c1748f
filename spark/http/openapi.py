"""``GET /openapi.json``: every route of the app, and the JSON Schema of each request body.

The schemas are generated from the attrs classes that the strict converter of
``spark.http.schemas`` structures bodies into, type hint by type hint, stating what that
converter accepts (not what the OpenAI or Anthropic documents say): a number is never a
string, a boolean never a number, unknown fields are allowed (they are ignored), a field
without a default is required. The routes come from the app's ``url_map``, so a new route
is listed the moment it exists; ``BODIES`` names the class of each route that reads a
body, and the tests fail for a body-taking route missing from it.

Where JSON Schema and the converter cannot agree exactly: an integer field refuses
``1.0`` (JSON Schema calls it an integer), and ``NaN`` / ``Infinity``, which Python's
decoder accepts, are not JSON at all.
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from typing import Any

import attrs
from cattrs._compat import is_union_type
from quart import Blueprint, Quart, current_app

from spark.http.admin import DownRequest, UpRequest
from spark.http.anthropic import PREFIX as ANTHROPIC_PREFIX
from spark.http.anthropic import CountTokensRequest, MessagesRequest
from spark.http.gateway import UPSTREAM_ONLY
from spark.http.response_items import (INCLUDABLE, CancelRequest, ConversationRequest, ConversationUpdate,
                                       ItemsRequest, ResponsesRequest)
from spark.http.schemas import ChatRequest, CompletionRequest, Prompt
from spark.http.tokenize import DetokenizeRequest, TokenizeRequest

bp = Blueprint("openapi", __name__)

# The request class of every route that reads a body, by endpoint (blueprint.view), as its view parses it.
BODIES: dict[str, type] = {
    "openai.chat_completions": ChatRequest,
    "openai.completions": CompletionRequest,
    "anthropic.create_message": MessagesRequest,
    "anthropic.count_tokens": CountTokensRequest,
    "responses.create_response": ResponsesRequest,
    "responses.create_conversation": ConversationRequest,
    "responses.cancel_response": CancelRequest,
    "responses.count_input_tokens": ResponsesRequest,
    "responses.update_conversation": ConversationUpdate,
    "responses.add_conversation_items": ItemsRequest,
    "inference_admin.up": UpRequest,
    "inference_admin.down": DownRequest,
    "tokenize.tokenize": TokenizeRequest,
    "tokenize.detokenize": DetokenizeRequest,
    **{endpoint: cls for endpoint, cls in UPSTREAM_ONLY.values()},  # proxied to an upstream recipe
}
EMPTY_BODY_ALLOWED = {"responses.create_conversation", "responses.cancel_response", "inference_admin.down"}  # as {}
BODY_METHODS = ("POST", "PUT", "PATCH")
_AUTOMATIC = {"HEAD", "OPTIONS"}  # every route answers these; they are not operations of their own

_INCLUDE = {"include[]": {"enum": sorted(INCLUDABLE)}}  # repeatable, as the SDKs send it; checked
_PAGE = {"after": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
         "order": {"enum": ["asc", "desc"], "default": "desc"}, **_INCLUDE}  # a list's include adds nothing
QUERIES: dict[str, dict[str, dict]] = {  # the query strings the views read (request.args)
    "responses.get_response": {**_INCLUDE,  # message.output_text.logprobs: the stored logprobs shown
                               # a background response's events again, after a sequence number
                               "stream": {"type": "boolean", "default": False},
                               "starting_after": {"type": "integer", "default": -1}},
    "responses.list_input_items": _PAGE,
    "responses.list_conversation_items": _PAGE,
    "inference_admin.logs": {"n": {"type": "integer", "minimum": 1, "default": 50}},
}

# What _prompt_hook accepts: a string, token ids, or a non-empty list of strings or of token id lists.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, _TOKEN_IDS,
                           {"type": "array", "items": {"type": "string"}, "minItems": 1},
                           {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]}
_CUSTOM = {tuple[Prompt, ...]: PROMPT_SCHEMA}  # the types the converter has a hook of its own for
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}


class SchemaBuilder:
    """JSON Schemas of request types; each attrs class once, in ``components``, named by its class."""

    def __init__(self):
        self.components: dict[str, dict] = {}
        self._names: dict[type, str] = {}

    def of(self, tp: Any) -> dict:
        """The JSON Schema of the values the converter structures into ``tp``.

        Raises:
            TypeError: a type the converter has no rule for here (add one, as it is added there).
        """
        if tp is Any:
            return {}
        if tp in _CUSTOM:
            return _CUSTOM[tp]
        if tp is float:  # an integer past the largest float is refused: float() cannot convert it
            return {"type": "number", "minimum": -sys.float_info.max, "maximum": sys.float_info.max}
        if tp in _SCALARS:
            return {"type": _SCALARS[tp]}
        if is_union_type(tp):
            return {"anyOf": [self.of(m) for m in _reachable_members(typing.get_args(tp))]}
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            return {"type": "array", "items": self.of(args[0])}
        if origin is dict and args[0] is str:
            return {"type": "object", "additionalProperties": self.of(args[1])}
        if attrs.has(tp):
            return {"$ref": f"#/components/schemas/{self._component(tp)}"}
        raise TypeError(f"no JSON Schema for {tp!r}")

    def _component(self, cls: type) -> str:
        if cls in self._names:
            return self._names[cls]
        name = cls.__name__
        if name in self.components:  # two classes of one name (schemas.Tool, anthropic.Tool)
            name = f"{cls.__module__.rsplit('.', 1)[-1]}.{name}"
        self._names[cls] = name
        self.components[name] = {}  # taken before its fields are walked, should a class hold itself
        hints = typing.get_type_hints(cls)
        properties, required = {}, []
        for field in attrs.fields(cls):
            schema = self.of(hints[field.name])
            if field.default is attrs.NOTHING:
                required.append(field.name)
            elif field.default is not None and not isinstance(field.default, attrs.Factory):
                schema = {**schema, "default": field.default}
            properties[field.name] = schema
        schema = {"type": "object", "properties": properties} | ({"required": required} if required else {})
        if cls.__doc__:
            schema["description"] = inspect.cleandoc(cls.__doc__).split("\n\n")[0]
        self.components[name] = schema
        return name


def _json_kinds(tp: Any) -> set[str]:
    """The JSON types of the values the converter's union hook hands to member ``tp``."""
    if tp in _SCALARS:
        return {"integer", "number"} if tp is float else {_SCALARS[tp]}
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return {"array"}
    if origin is dict or attrs.has(tp):
        return {"object"}
    raise TypeError(f"no union rule for member {tp!r}")


def _reachable_members(members: tuple) -> list:
    """A union's members in order, less those whose every JSON type an earlier member takes first
    (the converter tries only the first member that takes a value's JSON type)."""
    taken: set[str] = set()
    out = []
    for member in members:
        kinds = _json_kinds(member)
        if not kinds <= taken:
            out.append(member)
        taken |= kinds
    return out


def _openapi_path(rule: str) -> tuple[str, list[str]]:
    """``/v1/models/<path:name>`` as ``/v1/models/{name}``, and its parameters' names."""
    names = []

    def placeholder(match: re.Match) -> str:
        names.append(match.group(1))
        return "{" + match.group(1) + "}"

    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", placeholder, rule), names


def _operation(app: Quart, rule, method: str, builder: SchemaBuilder) -> dict:
    view = app.view_functions[rule.endpoint]
    operation: dict[str, Any] = {"operationId": f"{rule.endpoint}.{method.lower()}",
                                 "tags": [rule.endpoint.partition(".")[0]]}
    if view.__doc__:
        operation["summary"] = inspect.cleandoc(view.__doc__).split("\n")[0]
    path, names = _openapi_path(rule.rule)
    parameters = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
    parameters += [{"name": n, "in": "query", "schema": s} for n, s in QUERIES.get(rule.endpoint, {}).items()]
    if parameters:
        operation["parameters"] = parameters
    if method in BODY_METHODS:
        cls = BODIES.get(rule.endpoint)
        if cls is None:
            operation["x-spark-body-undescribed"] = True  # the tests fail on this: add the route to BODIES
        else:
            operation["requestBody"] = {"required": rule.endpoint not in EMPTY_BODY_ALLOWED,
                                        "content": {"application/json": {"schema": builder.of(cls)}}}
    error = "AnthropicError" if path.startswith(ANTHROPIC_PREFIX) else "Error"
    operation["responses"] = {"200": {"description": "success"}, "default": {"$ref": f"#/components/responses/{error}"}}
    if path.startswith(("/v1/", "/api/")):
        operation["security"] = [{"bearer": []}]  # once the server has keys
    return operation


def document(app: Quart) -> dict:
    """The OpenAPI 3.1 document of ``app``: its routes, with their methods, path parameters and bodies."""
    builder = SchemaBuilder()
    paths: dict[str, dict] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        path, _ = _openapi_path(rule.rule)
        for method in sorted(rule.methods - _AUTOMATIC):
            paths.setdefault(path, {})[method.lower()] = _operation(app, rule, method, builder)
    schemas = {**builder.components, "Error": OPENAI_ERROR, "AnthropicError": ANTHROPIC_ERROR}
    return {"openapi": "3.1.0",
            "info": {"title": "Spark", "version": "1",
                     "description": "OpenAI chat/completions/models, Responses and conversations, Anthropic "
                                    "Messages, and the admin API of the control plane."},
            "paths": paths,
            "components": {"schemas": schemas,
                           "responses": {name: {"description": "an error", "content": {"application/json": {
                               "schema": {"$ref": f"#/components/schemas/{name}"}}}} for name in ("Error",
                                                                                                  "AnthropicError")},
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                          "description": "an API key (the admin key for "
                                                                         "switching); Anthropic routes also "
                                                                         "take x-api-key"}}}}


@bp.get("/openapi.json")
async def openapi():
    """This document."""
    cached = current_app.extensions.get("openapi")
    if cached is None:  # the routes are fixed once the app serves
        cached = current_app.extensions["openapi"] = document(current_app)
    return cached
