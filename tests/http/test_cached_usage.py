"""The prompt tokens a request found in the prefix cache, as each API's clients read them (issue 20):
OpenAI ``usage.prompt_tokens_details.cached_tokens``, Responses ``usage.input_tokens_details.cached_tokens``,
Anthropic ``usage.cache_read_input_tokens`` (its ``input_tokens`` counting the others)."""

from __future__ import annotations

import anthropic

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
