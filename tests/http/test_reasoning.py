"""Reasoning through chat completions: <think> split into reasoning_content, thinking switches and budgets."""

from __future__ import annotations

import json

import anthropic
import attrs
import openai
import pytest

from spark.http import formatting as fmt
from spark.http.turn import ChatFormat, chat_format, prepare_turn
from spark.serve_config import ServeConfig
from tests.http.conftest import API_KEY
from tests.http.replay import ReplayEngine, qwen_like_tokenizer, replay_server, smollm_tokenizer

MAX_THINKING = 4096
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
REPLIES = {
    "[think]": "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello there, friend!",
    "[open]": "I should greet.\n</think>\n\nHello!",
    "[plain]": "Hi.",
    "[call-in-thought]": ('<think>\nI could write <tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n'
                          "</tool_call> but I know it already.\n</think>\n\nIt is sunny in Bern."),
    "[thought-then-call]": ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                            '"arguments": {"city": "Bern"}}\n</tool_call>'),
}


@pytest.fixture(scope="module")
def engine():
    # 5 ms steps: every token its own step, so the streamed tests below see how a reply is
    # written (without them a loaded machine's streamer may merge the tokens into few chunks).
    return ReplayEngine(qwen_like_tokenizer(), REPLIES, step_seconds=0.005)


@pytest.fixture(scope="module")
def server(engine):
    with replay_server(engine, max_thinking_budget=MAX_THINKING) as running:  # reasoning "auto": on (<think>)
        yield running


def _ask(marker: str, **kw) -> dict:
    return {"model": "replay", "messages": [{"role": "user", "content": f"Hello! {marker}"}], **kw}


def _streamed(server, **body) -> tuple[str, str, list, str, list[str], int]:
    """A streamed request's reasoning, content, tool-call deltas and finish reason; then the order of
    the kinds of text (runs of "reasoning" / "content") and the number of text chunks."""
    reasoning, content, calls, finish, kinds = [], [], [], None, []
    for chunk in server.client().chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
            kinds.append("reasoning")
        if delta.content:
            content.append(delta.content)
            kinds.append("content")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    order = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    return "".join(reasoning), "".join(content), calls, finish, order, len(kinds)


def test_think_block_becomes_reasoning_content_streamed_and_not(server, engine):
    r = server.client().chat.completions.create(**_ask("[think]"))
    message = r.choices[0].message
    assert message.reasoning_content == "\nThe user greets me. I should greet back.\n"
    assert message.content == "Hello there, friend!" and r.choices[0].finish_reason == "stop"
    reasoning, content, calls, finish, order, pieces = _streamed(server, **_ask("[think]"))
    assert (reasoning, content, calls, finish) == (message.reasoning_content, message.content, [], "stop")
    assert order == ["reasoning", "content"] and pieces > 6  # streamed as it is written, reasoning first
    assert not engine.params[-1].starts_in_thinking


def test_prompt_that_opens_think_starts_in_reasoning(server, engine):
    body = _ask("[open]", extra_body={"chat_template_kwargs": {"open_think": True}})
    r = server.client().chat.completions.create(**body)
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n") and engine.params[-1].starts_in_thinking
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("I should greet.\n", "Hello!")
    reasoning, content, *_ = _streamed(server, **body)
    assert (reasoning, content) == ("I should greet.\n", "Hello!")


def test_enable_thinking_false_reaches_the_template_and_the_engine(server, engine):
    body = _ask("[plain]", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = server.client().chat.completions.create(**body)
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert engine.params[-1].thinking_budget == 0  # a block the model opens anyway is closed at once
    assert r.choices[0].message.content == "Hi." and r.choices[0].message.reasoning_content is None


def test_tool_call_text_inside_thinking_is_not_a_call(server):
    r = server.client().chat.completions.create(**_ask("[call-in-thought]", tools=[WEATHER]))
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert "<tool_call>" in choice.message.reasoning_content and choice.message.content == "It is sunny in Bern."
    reasoning, content, calls, finish, *_ = _streamed(server, **_ask("[call-in-thought]", tools=[WEATHER]))
    assert (reasoning, content, calls, finish) == (choice.message.reasoning_content, choice.message.content, [], "stop")

    r = server.client().chat.completions.create(**_ask("[thought-then-call]", tools=[WEATHER]))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "\nI need the weather.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Bern"})]


@pytest.mark.parametrize("extra, budget", [
    ({}, MAX_THINKING),  # the server's maximum is the default
    ({"reasoning_effort": "low"}, 512),
    ({"reasoning_effort": "high"}, MAX_THINKING),  # 8192, capped
    ({"extra_body": {"thinking_budget": 100}}, 100),
    ({"extra_body": {"thinking_budget": 10**6}}, MAX_THINKING),
    ({"reasoning_effort": "low", "extra_body": {"thinking_budget": 64}}, 64),  # the explicit budget wins
    ({"reasoning_effort": "none"}, 0),
])
def test_thinking_budget_reaches_the_engine_capped(server, engine, extra, budget):
    server.client().chat.completions.create(**_ask("[plain]"), **extra)
    assert engine.params[-1].thinking_budget == budget
    thinking_off = engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert thinking_off == (budget == 0)


@pytest.mark.parametrize("extra, param", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"thinking_budget": -1}}, "thinking_budget"),
    ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": "no"}}}, "chat_template_kwargs.enable_thinking"),
])
def test_bad_thinking_fields_are_400(server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(**_ask("[plain]"), **extra)
    assert info.value.param == param


def test_server_settings_for_thinking():
    tok = qwen_like_tokenizer()
    config = ServeConfig(disable_thinking=True, max_thinking_budget=7)
    off = chat_format(config, tok)
    assert attrs.evolve(off, refusal_patterns=(), citations=False) == ChatFormat(
        "hermes", True, thinking_allowed=False, max_thinking_budget=7)
    hello = [{"role": "user", "content": "hi"}]
    assert prepare_turn(tok, off, hello).prompt.text.endswith("<think>\n\n</think>\n\n")
    assert prepare_turn(tok, off, hello).thinking_budget == 0
    # a kill-switch (issue 18.4): no request turns it back on, by any API's switch
    for asks in ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True, "thinking_budget": 3}):
        still_off = prepare_turn(tok, off, hello, **asks)
        assert still_off.prompt.text.endswith("<think>\n\n</think>\n\n") and still_off.thinking_budget == 0
    on = chat_format(ServeConfig(max_thinking_budget=7), tok)
    assert prepare_turn(tok, on, hello).thinking_budget == 7
    assert prepare_turn(tok, on, hello, enable_thinking=True, thinking_budget=3).thinking_budget == 3
    assert chat_format(ServeConfig(reasoning_parser="none"), tok).reasoning is False


@pytest.fixture(scope="module")
def thinking_off():
    """A second replay server started with ``--disable-thinking``; yields it and its engine."""
    engine = ReplayEngine(qwen_like_tokenizer(), REPLIES)
    with replay_server(engine, disable_thinking=True, max_thinking_budget=MAX_THINKING) as running:
        yield running, engine


def _chat_enable_thinking(server):
    server.client().chat.completions.create(
        **_ask("[plain]", extra_body={"chat_template_kwargs": {"enable_thinking": True}}))


def _anthropic_thinking_enabled(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as claude:
        claude.messages.create(model="replay", max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
                               messages=[{"role": "user", "content": "Hello! [plain]"}])


def _responses_effort_minimal(server):
    server.client().responses.create(model="replay", input="Hello! [plain]", reasoning={"effort": "minimal"})


@pytest.mark.parametrize("ask, budget", [
    (_chat_enable_thinking, MAX_THINKING),  # no budget asked: the server's maximum
    (_anthropic_thinking_enabled, 1024),
    (_responses_effort_minimal, 128),
], ids=["chat_template_kwargs", "anthropic_thinking", "responses_effort"])
def test_disable_thinking_is_a_kill_switch_through_every_api(server, engine, thinking_off, ask, budget):
    # issue 18.4. On a server that allows thinking, each API's switch turns it on: the template
    # leaves no empty block and the engine gets the asked budget (so the switch reaches the prompt) ...
    ask(server)
    assert not engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert engine.params[-1].thinking_budget == budget
    # ... and with --disable-thinking the same request renders thinking off and gets no budget.
    off, off_engine = thinking_off
    seen = len(off_engine.prompts)
    ask(off)
    assert len(off_engine.prompts) == seen + 1
    assert off_engine.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off_engine.params[-1].thinking_budget == 0


def test_models_without_think_keep_the_tags_as_content():
    tok = smollm_tokenizer()
    turn = prepare_turn(tok, chat_format(ServeConfig(), tok), [{"role": "user", "content": "hi"}])
    assert turn.thinking_budget is None and "enable_thinking" not in turn.prompt.text
    parser = turn.parser()
    parser.feed("<think>x</think> y")
    parser.flush()
    result = parser.finish()
    assert (result.reasoning, result.content) == ("", "<think>x</think> y")
    assert "reasoning_content" not in fmt.chat_message(result, reasoning=parser.reasoning)
    forced = chat_format(ServeConfig(reasoning_parser="think"), tok)  # the operator knows better
    parser = prepare_turn(tok, forced, [{"role": "user", "content": "hi"}]).parser()
    parser.feed("<think>x</think> y")
    parser.flush()
    assert (parser.finish().reasoning, parser.finish().content) == ("x", "y")
