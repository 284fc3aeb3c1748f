"""Chat completions through the official OpenAI SDK against a real server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


def _chat(server, messages=HELLO, **kw):
    return server.client().chat.completions.create(model=server.model, messages=messages, **kw)


def _stream_text(server, messages, **kw) -> str:
    chunks = _chat(server, messages, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_non_streamed_chat_has_text_and_usage(server):
    r = _chat(server, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == server.model
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_arrives_incrementally_and_ends_with_usage(server):
    arrivals, chunks = [], []
    for chunk in _chat(server, max_tokens=16, temperature=0, stream=True,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        arrivals.append(time.perf_counter())
        chunks.append(chunk)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 8  # one chunk per token or so, not one blob at the end
    assert arrivals[-1] - arrivals[1] > 0.05  # they were not all written at once
    *_, last_choice, usage = chunks
    assert last_choice.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 16
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + 16
    whole = _chat(server, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content


def test_n2_gives_two_indexed_choices(server):
    r = _chat(server, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content  # seed+i per choice
    again = _chat(server, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    streamed = {}
    for chunk in _chat(server, max_tokens=8, temperature=1.0, seed=7, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[0], streamed[1]] == [c.message.content for c in r.choices]


def test_logprobs_and_top_logprobs(server):
    r = _chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the best
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    plain = _chat(server, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprobs_leave_out_the_end_of_turn_token(server):
    # The model ends its turn on <|im_end|>: a control token that writes no text, so not a logprob entry
    # (as OpenAI's), whole or streamed; it still counts as a completion token.
    r = _chat(server, max_tokens=200, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    tokens = [e.token for e in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content and "<|im_end|>" not in tokens
    assert len(tokens) == r.usage.completion_tokens - 1
    streamed = [e.token for chunk in _chat(server, max_tokens=200, temperature=0, logprobs=True, stream=True)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == tokens


def test_stop_string_ends_output_before_it(server):
    full = _chat(server, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content
    words = full.split()
    stop = " " + words[len(words) // 2]
    r = _chat(server, max_tokens=16, temperature=0, stop=[stop, "@@@"], extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.message.content
    assert choice.message.content == full[: full.index(stop)]
    assert _stream_text(server, HELLO, max_tokens=16, temperature=0, stop=stop,
                        extra_body={"ignore_eos": True}) == choice.message.content


def test_logprobs_end_where_a_stop_string_cuts_the_text(server):
    # The tokens of the stop string (and any after it) are no logprob entries: the tokens join into the
    # content, whole and streamed, and each streamed chunk's tokens into its own text.
    full = _chat(server, max_tokens=24, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    tokens = [e.token for e in full.choices[0].logprobs.content]
    starts = [len("".join(tokens[:k])) for k in range(len(tokens))]
    text = "".join(tokens)

    def stop_at(k):  # a stop string that begins with token k and ends inside the next (met there first)
        stop = tokens[k] + tokens[k + 1][:1]
        return stop if len(tokens[k]) > 1 and text.find(stop) == starts[k] else None
    k = next(k for k in range(len(tokens) // 3, len(tokens) - 1) if stop_at(k))
    stop = stop_at(k)
    r = _chat(server, max_tokens=24, temperature=0, logprobs=True, stop=[stop], extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == full.choices[0].message.content[: starts[k]]
    assert [e.token for e in choice.logprobs.content] == tokens[:k]
    chunks = [c for chunk in _chat(server, max_tokens=24, temperature=0, logprobs=True, stop=[stop], stream=True,
                                   extra_body={"ignore_eos": True}) for c in chunk.choices]
    streamed = [[e.token for e in c.logprobs.content] if c.logprobs else [] for c in chunks]
    assert sum(streamed, []) == tokens[:k]
    assert all("".join(t) == (c.delta.content or "") for t, c in zip(streamed, chunks))


def test_same_seed_same_text(server):
    texts = [_chat(server, max_tokens=12, temperature=1.0, seed=1234).choices[0].message.content for _ in range(2)]
    assert texts[0] == texts[1]
    other = {_chat(server, max_tokens=12, temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert len(other) > 1  # the seed matters


def test_content_parts_and_developer_role(server):
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Write one sentence"},
                                          {"type": "text", "text": "about the sea."}]}]
    r = _chat(server, parts, max_tokens=4, temperature=0, user="someone", extra_body={"chat_template_kwargs": {}})
    assert r.choices[0].message.content


def test_sixteen_concurrent_streams_match_their_solo_outputs(server):
    prompts = [[{"role": "user", "content": f"Name a fact about the number {i}."}] for i in range(4)]
    solo = [_stream_text(server, p, max_tokens=12, temperature=0) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: _stream_text(server, prompts[i % 4], max_tokens=12, temperature=0),
                                 range(16)))
    assert together == solo * 4


@pytest.mark.parametrize("alias", ["sparky", None])
def test_model_alias_and_missing_model(server, alias):
    body = {"messages": HELLO, "max_tokens": 2}
    if alias:
        body["model"] = alias
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == server.model


def test_greedy_chat_equals_spark_generate_chat(server):
    """The server and `spark generate --chat` run the same prompt through the same engine: same text."""
    import json
    import subprocess
    import sys

    prompt = "Name three colours of the rainbow."
    cli = subprocess.run(
        [sys.executable, "-m", "spark.cli", "generate", "--chat", "--json", "--max-tokens", "24", "--device", "cpu", prompt],
        capture_output=True, text=True, check=True, timeout=300,
    )
    generated = json.loads(cli.stdout)
    served = _chat(server, [{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
    assert served.choices[0].message.content == generated["text"]
    assert served.usage.completion_tokens == len(generated["token_ids"])
    assert served.usage.prompt_tokens == len(generated["prompt_token_ids"])
