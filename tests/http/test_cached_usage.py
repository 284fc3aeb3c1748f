"""The prompt tokens a request found in the prefix cache, as each API's clients read them (issue 20):
OpenAI ``usage.prompt_tokens_details.cached_tokens``, Responses ``usage.input_tokens_details.cached_tokens``,
Anthropic ``usage.cache_read_input_tokens`` (its ``input_tokens`` counting the others)."""

from __future__ import annotations

import time

import anthropic
import pytest

from tests.http.conftest import API_KEY

SYSTEM = ("You are the assistant of a harbour office. You answer questions about ships, tides, berths and "
          "cargo in one short sentence, and you never invent schedules or tracking numbers.")


def test_openai_chat_and_completions_report_cached_tokens(server):
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]
    first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0  # whole pages, never the last token
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    assert [c.usage for c in stream if c.usage][-1].prompt_tokens_details.cached_tokens == cached
    prompt = SYSTEM + " Which berth is free?"
    client.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert client.completions.create(model=server.model, prompt=prompt, max_tokens=1
                                     ).usage.prompt_tokens_details.cached_tokens >= 16


def test_responses_report_cached_tokens(server):
    client = server.client()
    body = dict(model=server.model, instructions=SYSTEM, input="Is the pier open?", max_output_tokens=2, store=False)
    client.responses.create(**body)
    assert client.responses.create(**body).usage.input_tokens_details.cached_tokens >= 16


def test_anthropic_reports_cache_reads_apart(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
        body = dict(model=server.model, system="Desk B, night shift. " + SYSTEM, max_tokens=2,  # its own prefix
                    messages=[{"role": "user", "content": "How deep is the channel?"}])
        first = client.messages.create(**body)
        again = client.messages.create(**body)
        total = first.usage.input_tokens + first.usage.cache_read_input_tokens
        assert first.usage.cache_read_input_tokens == 0
        assert again.usage.cache_read_input_tokens >= 16
        assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def _metric(server, name: str) -> float:
    with server.http() as http:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_anthropic_cache_control_writes_then_reads_its_breakpoint(server):
    system = [{"type": "text", "text": "Desk C, tide tables. " + SYSTEM, "cache_control": {"type": "ephemeral"}}]
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
        first = client.messages.create(model=server.model, system=system, max_tokens=2,
                                       messages=[{"role": "user", "content": "When is the next spring tide?"}])
        u = first.usage
        total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        assert u.cache_read_input_tokens == 0 and 40 <= u.cache_creation_input_tokens < total  # up to the system
        assert _metric(server, "spark_prefix_cache_pinned_pages") >= u.cache_creation_input_tokens // 16
        again = client.messages.create(model=server.model, system=system, max_tokens=2, stream=True,
                                       messages=[{"role": "user", "content": "Is the lock gate working?"}])
        usage = [e.usage for e in again if e.type == "message_delta"][-1]
        written = u.cache_creation_input_tokens
        assert usage.cache_read_input_tokens >= written // 16 * 16  # its whole pages (and what follows alike)
        assert usage.cache_creation_input_tokens == max(0, written - usage.cache_read_input_tokens)
        with pytest.raises(anthropic.BadRequestError, match="ttl must be 5m or 1h"):
            client.messages.create(model=server.model, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}])


def test_anthropic_stream_starts_with_the_input_split_it_ends_with(server):
    """message_start's usage splits the input as message_delta's does: clients (LangChain) take it from the start."""
    system = [{"type": "text", "text": "Desk E, pilots. " + SYSTEM, "cache_control": {"type": "ephemeral"}}]
    fields = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    splits = []
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
        for question in ("Is a pilot needed in the inner harbour?", "Is a pilot needed at night?"):
            events = list(client.messages.create(model=server.model, system=system, max_tokens=2, stream=True,
                                                 messages=[{"role": "user", "content": question}]))
            start = events[0].message.usage
            end = [e.usage for e in events if e.type == "message_delta"][-1]
            splits.append([getattr(start, f) for f in fields])
            assert splits[-1] == [getattr(end, f) for f in fields]
    (_, read, written), (_, read_again, _) = splits
    assert read == 0 and written >= 16 and read_again >= 16  # the breakpoint written, then read


def test_a_stored_response_pins_what_its_next_turn_extends_until_deleted(server):
    client = server.client()
    desk = "Desk D, berths. " + SYSTEM  # (instructions do not carry over to the next turn: sent again)
    first = client.responses.create(model=server.model, instructions=desk, input="Is berth 4 free tonight?",
                                    max_output_tokens=8)
    pinned = _metric(server, "spark_prefix_cache_pinned_pages")
    assert pinned >= first.usage.input_tokens // 16
    turn = client.responses.create(model=server.model, previous_response_id=first.id, instructions=desk,
                                   input="And berth 5?", max_output_tokens=2)
    # the whole first prompt's pages, and those its answer filled (all but its last token's)
    assert turn.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens + 7) // 16 * 16
    pinned = _metric(server, "spark_prefix_cache_pinned_pages")
    client.responses.delete(turn.id)
    client.responses.delete(first.id)
    gone = first.usage.input_tokens // 16  # pages no other test's pin covers (its instructions are its own)
    deadline = time.monotonic() + 10
    while _metric(server, "spark_prefix_cache_pinned_pages") > pinned - gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "spark_prefix_cache_pinned_pages") <= pinned - gone
