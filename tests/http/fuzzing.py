"""Hypothesis strategies for fuzzing Spark's HTTP API from its own ``/openapi.json``, and the checks of
what it answers; ``tests/http/test_fuzz.py`` and ``scripts/fuzz.py`` share them.

A ``Call`` is one raw HTTP request. ``Fuzzer(doc).rounds()`` draws one for every operation of
the document, and one the router answers (an unknown path, a wrong method): valid bodies
(generated from the schema, or a hand-written seed), mutated ones (a value of the wrong type, a
field dropped or added, a body that is no object) and hostile ones (JSON nested 5000 deep, a
5000-digit integer, ``NaN``, a lone surrogate, bytes that are not UTF-8, truncated JSON).
``problems`` says what is wrong with an answer: a 5xx, a 4xx body not in its API's error shape,
a traceback. Generated lengths are tiny (``CAPS``) so that the valid bodies' generations are cheap.
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any
from urllib.parse import quote, urlencode

import attrs
import jsonschema
from hypothesis import strategies as st

ANTHROPIC_PREFIX = "/v1/messages"
MARK = "\x00spark-fuzz-mark\x00"  # a string in a body that json.dumps writes as one token, swapped for raw text
MARK_JSON = json.dumps(MARK)
DEEP = "[" * 5000 + "]" * 5000
HUGE_INT = "1" * 5000  # past Python's digit limit: the decoder refuses it
PAST_FLOAT = "9" * 400  # an integer no float holds
NOT_JSON = ["NaN", "Infinity", "-Infinity", "1e999"]  # Python's decoder takes these; JSON has no such numbers

# Tiny generations: the fields that size one are drawn small, and always given (the server's default is larger).
CAPS = {"max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
        "max_output_tokens": st.integers(1, 4)}
SMALL = {"n": st.integers(1, 2), "top_logprobs": st.integers(0, 3), "logprobs": st.integers(0, 3),
         "thinking_budget": st.integers(0, 4), "budget_tokens": st.integers(0, 4), "grace_s": st.floats(0, 1)}
# Plausible values of free-text fields, so that generated bodies get past the checks of meaning too.
WORDS = {
    "role": ["user", "assistant", "system", "developer", "tool"],
    "type": ["text", "function", "message", "tool_use", "tool_result", "thinking", "auto", "enabled", "disabled",
             "function_call", "function_call_output", "input_text", "any", "tool", "none"],
    "tool_choice": ["none", "auto", "required"],
    "reasoning_effort": ["none", "minimal", "low", "medium", "high"],
    "effort": ["low", "medium", "high", "max"],
    "order": ["asc", "desc"],
}
# Hand-written bodies that reach generation (or the store), for mutations to start from.
SEEDS: dict[str, list[dict]] = {
    "POST /v1/chat/completions": [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            {"type": "text", "text": "hello"}]}], "max_tokens": 3, "stream": True, "n": 2, "seed": 1,
         "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "stop": ["\n"]},
        {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "max_tokens": 2,
         "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
         "tool_choice": "auto", "temperature": 0.5, "top_p": 0.9, "logit_bias": {"1": 1.5}},
    ],
    "POST /v1/completions": [
        {"prompt": "Once", "max_tokens": 2},
        {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "logprobs": 2, "stream": True, "n": 2},
        {"prompt": ["a", "b"], "max_tokens": 1, "temperature": 0, "stop": "x", "ignore_eos": True},
    ],
    "POST /v1/messages": [
        {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        {"max_tokens": 3, "system": "Be brief.", "stream": True, "stop_sequences": ["\n"], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"max_tokens": 2, "tools": [{"name": "w", "input_schema": {"type": "object"}}],
         "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]},
    ],
    "POST /v1/messages/count_tokens": [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"system": [{"type": "text", "text": "x"}], "messages": [{"role": "user", "content": "hi"}],
         "output_config": {"effort": "low"}},
    ],
    "POST /v1/responses": [
        {"input": "hi", "max_output_tokens": 2},
        {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2, "store": False, "stream": True,
         "instructions": "Be brief.", "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"],
         "top_logprobs": 2},
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                   {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
         "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}], "max_output_tokens": 2,
         "metadata": {"k": "v"}, "tool_choice": "auto"},
        {"input": [{"role": "user", "content": "hi"},
                   {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                   {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
                   {"role": "user", "content": "and?"}], "max_output_tokens": 2, "reasoning": {"effort": "none"},
         "tool_choice": "none", "tools": [{"type": "function", "name": "w"}]},
    ],
    "POST /v1/responses/input_tokens": [{"input": "hi"}, {"input": [{"role": "user", "content": "hi"}],
                                          "instructions": "Be brief.", "tools": [{"type": "function", "name": "w"}]}],
    "POST /v1/responses/{rid}/cancel": [{}],  # the SDK sends none; an object is read and ignored
    "POST /v1/conversations": [{}, {"items": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}},
                               {"items": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                                           "content": [{"type": "reasoning_text", "text": "r"}]},
                                          {"type": "message", "role": "assistant", "content": "ok"}]}],
    "POST /v1/conversations/{cid}": [{"metadata": {"k": "v"}}, {"metadata": None}],
    "POST /v1/conversations/{cid}/items": [{"items": [{"role": "assistant", "content": "hello"}]}],
    "POST /tokenize": [{"prompt": "Hello"}, {"messages": [{"role": "user", "content": "hi"}],
                                            "add_generation_prompt": False, "return_token_strs": True}],
    "POST /detokenize": [{"tokens": [1, 2, 3]}],
    "POST /v1/embeddings": [{"input": "hello"}, {"input": ["a", "b"], "encoding_format": "float", "model": "sparky"}],
    "POST /api/inference/up": [{"id": "no-such-recipe"}],
    "POST /api/inference/down": [{"grace_s": 0}],
}
# Keys a mutation adds besides made-up ones: the fields of untyped objects (Responses items, reasoning).
KEYS = ["type", "role", "content", "text", "id", "name", "summary", "output", "call_id", "arguments", "effort",
        "parameters", "function", "input", "tool_use_id", "items", "model", "stream"]
# Operations whose valid bodies would take the shared server's model down: only refusable bodies go there.
DANGEROUS = {"POST /api/inference/up", "POST /api/inference/down"}
# Operations only an upstream recipe's server answers (spark.http.gateway.UPSTREAM_ONLY): 400 on a local model.
UPSTREAM_ONLY = {"POST /v1/embeddings"}
ROUTING_METHODS = ["PATCH", "PUT", "DELETE", "POST", "GET"]


@attrs.frozen
class Call:
    """One HTTP request: what a fuzzer sends, and what a failure report names."""

    operation: str  # "POST /v1/chat/completions": the document's method and path template
    kind: str  # valid | mutated | hostile | routing
    method: str
    path: str  # with the query string
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()


def error_shape_problem(path: str, status: int, body: bytes) -> str | None:
    """Why a 4xx/5xx body is not in its API's error shape (None: it is). Anthropic routes
    (``/v1/messages*``) answer ``{"type": "error", "error": {"type", "message"}}``, the rest
    OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} body is not JSON: {body[:200]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return f"{status} body has no error object: {body[:200]!r}"
    if path.startswith(ANTHROPIC_PREFIX):
        if payload.get("type") != "error" or not isinstance(error.get("type"), str):
            return f"{status} body is not Anthropic's error shape: {body[:200]!r}"
    elif not {"message", "type", "param", "code"} <= error.keys():
        return f"{status} body is not OpenAI's error shape: {body[:200]!r}"
    return None


def problems(call: Call, status: int, body: bytes) -> list[str]:
    """What is wrong with the answer ``status, body`` to ``call``: empty when nothing is."""
    out = []
    if status >= 500:
        out.append(f"5xx: {status} {body[:300]!r}")
    if status >= 400:
        shape = error_shape_problem(call.path.partition("?")[0], status, body)
        if shape is not None:
            out.append(shape)
    if b"Traceback" in body:
        out.append(f"a traceback in the body: {body[:300]!r}")
    elif b"internal error" in body and status < 500:  # a stream that failed after its 200
        out.append(f"an internal error in a {status} body: {body[-300:]!r}")
    return out


def body_schema(doc: dict, schema: dict) -> dict:
    """``schema`` (of the document's) made self-contained, for ``jsonschema``: its $refs resolve in it."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "components": doc["components"]}


def validator(doc: dict, schema: dict) -> jsonschema.protocols.Validator:
    """A validator of ``schema`` that reads an integer as the converter does: ``1.0`` is none
    (JSON Schema says it is; the document says where they differ)."""
    full = body_schema(doc, schema)
    cls = jsonschema.validators.validator_for(full)
    checker = cls.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(cls, type_checker=checker)(full)


def operations(doc: dict) -> dict[str, dict]:
    """Every operation of the document, by ``"METHOD /path/{param}"``."""
    return {f"{method.upper()} {path}": op for path, ops in doc["paths"].items() for method, op in ops.items()}


def body_of(operation: dict) -> dict | None:
    """An operation's request body schema (None: it takes none)."""
    body = operation.get("requestBody")
    return None if body is None else body["content"]["application/json"]["schema"]


# -- JSON values ------------------------------------------------------------------------------

_TEXT = st.text(max_size=12)
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT
ANY_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                        max_leaves=6)
_BY_TYPE = {"null": st.none(), "boolean": st.booleans(), "integer": st.integers(),
            "number": st.floats(allow_nan=False, allow_infinity=False), "string": _TEXT,
            "array": st.lists(_SCALARS, max_size=2), "object": st.dictionaries(_TEXT, _SCALARS, max_size=2)}


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """The paths (tuples of keys and indexes) of every value in a JSON tree, the root ``()`` first."""
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out += nodes(item, path + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += nodes(item, path + (i,))
    return out


def replaced(value: Any, path: tuple, new: Any) -> Any:
    """A copy of the JSON tree ``value`` with the node at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = replaced(value[head], rest, new)
    return copy


def string_paths(value: Any) -> list[tuple]:
    return [p for p in nodes(value) if isinstance(_at(value, p), str)]


def _at(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


def with_raw(body: Any, path: tuple, raw: str) -> bytes:
    """``body`` as JSON with the node at ``path`` written as the raw text ``raw`` (not valid JSON maybe)."""
    return json.dumps(replaced(body, path, MARK)).replace(MARK_JSON, raw, 1).encode()


def surrogate_bodies(body: dict) -> list[tuple[tuple, bytes]]:
    """``body`` once per string in it (keys included), that string a lone UTF-16 surrogate."""
    out = [(path, with_raw(body, path, '"\\ud800"')) for path in string_paths(body)]
    for path in nodes(body):
        node = _at(body, path)
        if isinstance(node, dict):
            for key in node:
                renamed = {("\ud800" if k == key else k): v for k, v in node.items()}
                out.append((path + (key,), json.dumps(replaced(body, path, renamed)).encode()))
    return out


# -- from schemas to strategies -------------------------------------------------------------


class Fuzzer:
    """Strategies of requests for the operations of one OpenAPI document (Spark's ``/openapi.json``)."""

    def __init__(self, doc: dict, *, ids: dict[str, list[str]] | None = None, api_key: str | None = None,
                 admin_key: str | None = None):
        """
        Args:
          ids: real values of path parameters (``{"cid": [...]}``), drawn besides made-up ones.
          api_key: sent as ``Authorization: Bearer`` (now and then not, or a wrong one).
          admin_key: sent instead to the admin API (/api/*), when given.
        """
        self.doc, self.ops, self.ids, self.api_key = doc, operations(doc), ids or {}, api_key
        self.admin_key = admin_key
        self._refs: dict[str, st.SearchStrategy] = {}

    # valid values

    def valid(self, schema: dict, name: str | None = None) -> st.SearchStrategy:
        """Values ``schema`` accepts; ``name`` is the property they are for (``CAPS``, ``WORDS``)."""
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref not in self._refs:
                target = self.doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
                self._refs[ref] = st.deferred(lambda: self.valid(target))
            return self._refs[ref]
        if "anyOf" in schema:
            return st.one_of([self.valid(m, name) for m in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "const" in schema:
            return st.just(schema["const"])
        kind = schema.get("type")
        if kind is None:
            return ANY_JSON
        if kind == "string":
            return st.sampled_from(WORDS[name]) | _TEXT if name in WORDS else _TEXT
        if kind == "integer":
            small = SMALL.get(name)
            if small is not None:
                return small
            return st.integers(schema.get("minimum"), schema.get("maximum"))
        if kind == "number":
            small = SMALL.get(name)
            return small if small is not None else st.floats(allow_nan=False, allow_infinity=False) | st.integers(-3, 3)
        if kind == "array":
            return st.lists(self.valid(schema["items"]), min_size=schema.get("minItems", 0), max_size=3)
        if kind == "object":
            return self._object(schema)
        return _BY_TYPE[kind]

    def _object(self, schema: dict) -> st.SearchStrategy:
        if "properties" not in schema:
            extra = schema.get("additionalProperties", {})
            return st.dictionaries(_TEXT, self.valid(extra) if extra is not True else ANY_JSON, max_size=3)
        required = set(schema.get("required", ()))
        given, optional = {}, {}
        for name, prop in schema["properties"].items():
            if name in CAPS:
                given[name] = CAPS[name]
            else:
                (given if name in required else optional)[name] = self.valid(prop, name)
        return st.fixed_dictionaries(given, optional=optional)

    def body(self, operation: str) -> st.SearchStrategy:
        """Valid bodies of ``operation``: generated from its schema, or a seed."""
        generated = self.valid(body_of(self.ops[operation]))
        seeds = SEEDS.get(operation)
        return st.sampled_from(seeds) | generated if seeds else generated

    # invalid values

    def mutated(self, operation: str) -> st.SearchStrategy:
        """A valid body of ``operation`` with one to three things wrong: a value of another JSON type,
        a field dropped or added, or the body no object at all."""

        def once(draw, body):
            path = draw(st.sampled_from(nodes(body)))
            node = _at(body, path)
            how = draw(st.sampled_from(["retype", "drop", "add", "retype"]))
            if how == "drop" and path and isinstance(_at(body, path[:-1]), dict):
                parent = dict(_at(body, path[:-1]))
                del parent[path[-1]]
                return replaced(body, path[:-1], parent)
            if how == "add" and isinstance(node, dict):
                return replaced(body, path, {**node, draw(st.sampled_from(KEYS) | _TEXT): draw(ANY_JSON)})
            other = draw(st.sampled_from([t for t in _BY_TYPE if t != json_type(node)]))
            return replaced(body, path, draw(_BY_TYPE[other]))

        @st.composite
        def mutate(draw):
            body = draw(self.body(operation))
            for _ in range(draw(st.integers(1, 3))):
                body = once(draw, body)
            return body

        return mutate()

    def hostile(self, operation: str) -> st.SearchStrategy:
        """Bodies no later stage can take, as bytes: deep nesting, a 5000-digit integer, a lone surrogate,
        a non-JSON number, bytes that are not UTF-8, truncated JSON."""

        @st.composite
        def hostile(draw):
            body = draw(self.body(operation))
            path = draw(st.sampled_from(nodes(body)))
            raws = [DEEP, HUGE_INT, PAST_FLOAT, '"\\ud800"', '"a\\udfffb"', *NOT_JSON]
            raw = draw(st.sampled_from(raws))
            choice = draw(st.integers(0, 9))
            if choice == 0:
                return json.dumps(body).encode()[:-1]  # truncated
            if choice == 1:  # not UTF-8
                return json.dumps(replaced(body, path, MARK)).encode().replace(MARK_JSON.encode(), b'"\xff\xfe"', 1)
            return with_raw(body, path, raw)

        return hostile()

    # whole requests

    def _path(self, template: str) -> st.SearchStrategy:
        names = re.findall(r"{(\w+)}", template)
        if not names:
            return st.just(template)
        made_up = st.text(min_size=1, max_size=10).map(lambda s: quote(s, safe="")) | st.sampled_from(
            ["%FF", "%ED%A0%80", "x" * 300, "..", "%2F"])
        values = {n: (st.sampled_from(self.ids[n]) | made_up) if self.ids.get(n) else made_up for n in names}
        return st.fixed_dictionaries(values).map(lambda v: re.sub(r"{(\w+)}", lambda m: v[m.group(1)], template))

    def _query(self, operation: dict) -> st.SearchStrategy:
        params = [p for p in operation.get("parameters", ()) if p["in"] == "query"]
        if not params:
            return st.just("")
        odd = st.sampled_from(["", "0", "-1", "²", "٣", "1e2", HUGE_INT, "\x00"]) | _TEXT
        values = {p["name"]: self.valid(p["schema"], p["name"]).map(str) | odd for p in params}
        return st.fixed_dictionaries({}, optional=values).map(lambda q: "?" + urlencode(q) if q else "")

    def _headers(self, path: str) -> st.SearchStrategy:
        json_type_header = ("Content-Type", "application/json")
        if self.api_key is None or not path.startswith(("/v1/", "/api/")):
            return st.just((json_type_header,))
        key = self.admin_key if self.admin_key and path.startswith("/api/") else self.api_key
        good = ("Authorization", f"Bearer {key}")
        auth = st.sampled_from([good] * 8 + [None, ("Authorization", "Bearer wrong")])
        if path.startswith(ANTHROPIC_PREFIX):
            auth |= st.just(("x-api-key", self.api_key))
        return auth.map(lambda a: (json_type_header,) + ((a,) if a else ()))

    def call(self, operation: str) -> st.SearchStrategy[Call]:
        """Requests of one operation: valid, mutated and hostile bodies, real and made-up path parameters."""
        method, template = operation.split(" ", 1)
        op = self.ops[operation]
        bodies: list[st.SearchStrategy] = [st.just(("valid", None))]
        if body_of(op) is not None:
            valid = self.body(operation)
            if operation in DANGEROUS:
                check = validator(self.doc, body_of(op))
                valid = st.nothing()
                mutated = self.mutated(operation).filter(lambda b: not check.is_valid(b))
            else:
                mutated = self.mutated(operation)
            bodies = [valid.map(lambda b: ("valid", json.dumps(b).encode())),
                      mutated.map(lambda b: ("mutated", json.dumps(b).encode())),
                      self.hostile(operation).map(lambda b: ("hostile", b))]

        @st.composite
        def request(draw):
            kind, body = draw(st.one_of(bodies))
            path = draw(self._path(template)) + draw(self._query(op))
            return Call(operation, kind, method, path, body, draw(self._headers(path)))

        return request()

    def routing(self) -> st.SearchStrategy[Call]:
        """Requests the router answers: an unknown path, or a method a known path does not take."""
        wrong = [(re.sub(r"{\w+}", "x", path), m) for path, ops in self.doc["paths"].items()
                 for m in ROUTING_METHODS if m.lower() not in ops]
        unknown = [(path, m) for path in ("/v1/nope", "/v1/messages/nope", "/api/inference/nope", "/v2/models")
                   for m in ROUTING_METHODS]

        @st.composite
        def request(draw):
            path, method = draw(st.sampled_from(wrong + unknown))
            body = b'{"model": "m"}' if method in ("POST", "PUT", "PATCH") else None
            return Call("routing", "routing", method, path, body, draw(self._headers(path)))

        return request()

    def rounds(self, *, exclude: frozenset[str] = frozenset()) -> st.SearchStrategy[tuple[Call, ...]]:
        """One request of every operation (less ``exclude``) and one routing request: every route as often."""
        return st.tuples(*[self.call(name) for name in self.ops if name not in exclude], self.routing())


# -- raw sockets, for what an HTTP client would hide (keep-alive after early answers) ----------


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 answer read off a raw socket, by its Content-Length: its head and its body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return head, body[:length]


def closes(sock: socket.socket) -> bool:
    """Whether the server closes the connection within 2 s."""
    sock.settimeout(2)
    try:
        while sock.recv(65536):
            pass
        return True
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True
