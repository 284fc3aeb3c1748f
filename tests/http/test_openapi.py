"""/openapi.json: every route of the app is in it, its body schemas are valid JSON Schema, and they
agree with the converter that validates the bodies (what one accepts, the other does)."""

from __future__ import annotations

import json

import attrs
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark.http import create_app
from spark.http.errors import ApiError
from spark.http.openapi import BODIES, BODY_METHODS, SchemaBuilder, document
from spark.http.schemas import parse_body
from tests.http import fuzzing

APP = create_app()
DOC = document(APP)
OPERATIONS = fuzzing.operations(DOC)
WITH_BODY = sorted(name for name, op in OPERATIONS.items() if fuzzing.body_of(op) is not None)
CLASSES = {name: BODIES[op["operationId"].rsplit(".", 1)[0]] for name, op in OPERATIONS.items() if name in WITH_BODY}
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _rules():
    for rule in APP.url_map.iter_rules():
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            yield rule, method


def test_every_route_is_in_the_document():
    for rule, method in _rules():
        path = rule.rule.replace("<path:", "<").replace("<", "{").replace(">", "}")
        assert method.lower() in DOC["paths"].get(path, {}), f"{method} {rule.rule} is not in /openapi.json"
        op = DOC["paths"][path][method.lower()]
        assert [p["name"] for p in op.get("parameters", ()) if p["in"] == "path"] == sorted(rule.arguments)


def test_every_body_taking_route_has_its_request_class():
    """A new POST route fails here until ``spark.http.openapi.BODIES`` names the class its view parses."""
    for rule, method in _rules():
        if method in BODY_METHODS:
            assert rule.endpoint in BODIES, f"{method} {rule.rule} ({rule.endpoint}) reads a body no class describes"
    endpoints = {rule.endpoint for rule in APP.url_map.iter_rules()}
    assert set(BODIES) <= endpoints, f"BODIES names routes that are gone: {set(BODIES) - endpoints}"
    assert not [name for name, op in OPERATIONS.items() if op.get("x-spark-body-undescribed")]


def test_the_document_is_openapi_3_1_and_its_schemas_json_schema():
    spec = pytest.importorskip("openapi_spec_validator")
    spec.validate(DOC)
    for name, schema in DOC["components"]["schemas"].items():
        jsonschema.validators.validator_for(schema).check_schema(schema)
    for name in WITH_BODY:
        full = fuzzing.body_schema(DOC, fuzzing.body_of(OPERATIONS[name]))
        jsonschema.validators.validator_for(full).check_schema(full)


def test_the_server_serves_it_without_a_key(server):
    with server.http(auth=False) as http:
        r = http.get("/openapi.json")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        assert r.json() == json.loads(json.dumps(DOC))


def test_schema_types_the_converter_has_no_rule_for_fail():
    @attrs.frozen
    class Odd:
        tags: set[str]

    with pytest.raises(TypeError, match="set"):
        SchemaBuilder().of(Odd)
    number = SchemaBuilder().of(float)
    assert SchemaBuilder().of(float | int) == {"anyOf": [number]}  # int values go to float first
    assert SchemaBuilder().of(int | float) == {"anyOf": [{"type": "integer"}, number]}


def _accepted(body, cls) -> bool:
    try:
        parse_body(json.dumps(body).encode(), cls)
    except ApiError as exc:
        assert exc.status == 400
        return False
    return True


@pytest.mark.parametrize("operation", WITH_BODY)
def test_seeds_are_valid(operation):
    check = fuzzing.validator(DOC, fuzzing.body_of(OPERATIONS[operation]))
    for seed in fuzzing.SEEDS.get(operation, ()):
        assert check.is_valid(seed) and _accepted(seed, CLASSES[operation]), seed


@pytest.mark.parametrize("operation", WITH_BODY)
def test_what_the_schema_accepts_the_converter_accepts(operation):
    fuzzer, cls = fuzzing.Fuzzer(DOC), CLASSES[operation]

    @FUZZ
    @given(body=fuzzer.valid(fuzzing.body_of(OPERATIONS[operation])))
    def accepted(body):
        assert _accepted(body, cls), body

    accepted()


@pytest.mark.parametrize("operation", WITH_BODY)
def test_schema_and_converter_agree_on_mutated_bodies(operation):
    fuzzer, cls = fuzzing.Fuzzer(DOC), CLASSES[operation]
    check = fuzzing.validator(DOC, fuzzing.body_of(OPERATIONS[operation]))
    rejected = []

    @FUZZ
    @given(body=fuzzer.mutated(operation) | fuzzer.valid(fuzzing.body_of(OPERATIONS[operation])))
    def agree(body):
        valid = check.is_valid(body)
        assert _accepted(body, cls) == valid, (valid, body)
        rejected.append(not valid)

    agree()
    assert any(rejected)  # the mutations do make bodies the schema refuses


@pytest.mark.parametrize("body", [{"prompt": []}, {"prompt": [[]]}, {"prompt": ["a", 1]}, {"prompt": [True]},
                                  {"prompt": [[1], "a"]}, {"prompt": 5}, {"prompt": [1.0]}])
def test_prompts_the_converter_refuses_the_schema_refuses(body):
    check = fuzzing.validator(DOC, fuzzing.body_of(OPERATIONS["POST /v1/completions"]))
    assert not check.is_valid(body) and not _accepted(body, CLASSES["POST /v1/completions"])


@pytest.mark.parametrize("value, ok", [(10 ** 308, True), (10 ** 309, False), (-10 ** 309, False), (1e308, True)])
def test_a_number_past_the_largest_float_is_refused_by_both(value, ok):
    body = {"prompt": "x", "temperature": value}
    check = fuzzing.validator(DOC, fuzzing.body_of(OPERATIONS["POST /v1/completions"]))
    assert check.is_valid(body) == ok == _accepted(body, CLASSES["POST /v1/completions"])


def test_seeds_are_served(server):
    """A valid body gets an answer, not a 400: the schema's seeds through the real server."""
    with server.http() as http:
        cid = http.post("/v1/conversations", json={}).json()["id"]
        rid = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "background": True}).json()["id"]
        for operation, seeds in fuzzing.SEEDS.items():
            if operation in fuzzing.DANGEROUS or operation in fuzzing.UPSTREAM_ONLY:
                continue
            method, path = operation.split(" ", 1)
            for seed in seeds:
                r = http.request(method, path.replace("{cid}", cid).replace("{rid}", rid), json=seed)
                assert r.status_code == 200, (operation, seed, r.text[:300])


@given(st.data())
@settings(max_examples=1, deadline=None, database=None)
def test_a_round_of_the_fuzzer_calls_every_operation(data):
    calls = data.draw(fuzzing.Fuzzer(DOC).rounds())
    assert {call.operation for call in calls} == set(OPERATIONS) | {"routing"}
