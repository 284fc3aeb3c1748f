"""The refusal filter and citation extraction (issue 25), each API in its own fields: OpenAI
``message.refusal`` / ``delta.refusal`` and ``url_citation`` annotations; a Responses ``refusal``
part and ``url_citation`` annotations; Anthropic ``stop_reason: "refusal"`` and text-block
citations. The model is the replaying engine (``tests.http.replay``), the clients the official SDKs."""

from __future__ import annotations

import anthropic
import pytest

from tests.http.conftest import API_KEY
from tests.http.replay import ReplayEngine, replay_server, smollm_tokenizer

REFUSAL = "I'm sorry, but I can't help with that request."
CITING = "See [the docs](https://example.com/docs) and https://example.org/page for more."
REPLIES = {"[refuse]": REFUSAL, "[cite]": CITING, "[plain]": "I like turtles.", "[nope]": "Nope, not doing that."}
LINKS = [(4, 40, "https://example.com/docs", "the docs"), (45, 69, "https://example.org/page", "https://example.org/page")]


@pytest.fixture(scope="module")
def server():
    # 5 ms steps: a token a step, so a stream shows how the filter holds text back
    with replay_server(ReplayEngine(smollm_tokenizer(), REPLIES, step_seconds=0.005)) as running:
        yield running


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


def _chat(server, marker: str, **kw):
    return server.client().chat.completions.create(model="replay", messages=[{"role": "user", "content": marker}],
                                                   **kw)


# -- OpenAI chat completions ---------------------------------------------------------------------


def test_chat_refusal_is_message_refusal_streamed_and_not(server):
    message = _chat(server, "[refuse]").choices[0].message
    assert message.refusal == REFUSAL and message.content is None  # was content, refusal None
    chunks = list(_chat(server, "[refuse]", stream=True))
    refusal = [c.choices[0].delta.refusal for c in chunks if c.choices and c.choices[0].delta.refusal]
    assert "".join(refusal) == REFUSAL and len(refusal) > 3  # streamed as it comes, once it is one
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_an_answer_that_only_starts_like_one_is_content(server):
    message = _chat(server, "[plain]").choices[0].message
    assert message.content == "I like turtles." and message.refusal is None
    chunks = list(_chat(server, "[plain]", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "I like turtles."
    assert not any(c.choices[0].delta.refusal for c in chunks if c.choices)


def test_chat_citations_are_url_citation_annotations(server):
    message = _chat(server, "[cite]").choices[0].message
    assert message.content == CITING
    got = [(a.url_citation.start_index, a.url_citation.end_index, a.url_citation.url, a.url_citation.title)
           for a in message.annotations]  # was None
    assert got == LINKS and all(a.type == "url_citation" for a in message.annotations)
    chunks = list(_chat(server, "[cite]", stream=True))
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and [a["url_citation"]["url"] for a in last.delta.annotations] == [
        url for _, _, url, _ in LINKS]


# -- Responses ---------------------------------------------------------------------------------------


def test_responses_refusal_is_a_refusal_part(server):
    r = server.client().responses.create(model="replay", input="[refuse]")
    part = r.output[0].content[0]
    assert part.type == "refusal" and part.refusal == REFUSAL and r.status == "completed"  # was output_text
    events = list(server.client().responses.create(model="replay", input="[refuse]", stream=True))
    deltas = [e.delta for e in events if e.type == "response.refusal.delta"]
    assert "".join(deltas) == REFUSAL and [e.refusal for e in events if e.type == "response.refusal.done"] == [REFUSAL]
    assert not [e for e in events if e.type == "response.output_text.delta"]
    assert events[-1].response.output[0].content[0].refusal == REFUSAL
    again = server.client().responses.create(model="replay", input="[plain]", previous_response_id=r.id)
    assert again.output_text == "I like turtles."  # a refusal in the history reads back


def test_responses_citations_are_url_citation_annotations(server):
    r = server.client().responses.create(model="replay", input="[cite]")
    annotations = r.output[0].content[0].annotations
    assert [(a.start_index, a.end_index, a.url, a.title) for a in annotations] == LINKS  # was []
    assert all(a.type == "url_citation" for a in annotations)
    events = list(server.client().responses.create(model="replay", input="[cite]", stream=True))
    added = [e for e in events if e.type == "response.output_text.annotation.added"]
    assert [(e.annotation_index, e.annotation.url) for e in added] == [(0, LINKS[0][2]), (1, LINKS[1][2])]
    assert [a.url for a in events[-1].response.output[0].content[0].annotations] == [url for _, _, url, _ in LINKS]


# -- Anthropic Messages ------------------------------------------------------------------------------


def _ask(claude, marker: str):
    return dict(model="replay", max_tokens=64, messages=[{"role": "user", "content": marker}])


def test_anthropic_refusal_is_stop_reason_refusal(claude):
    m = claude.messages.create(**_ask(claude, "[refuse]"))
    assert m.stop_reason == "refusal" and m.content[0].text == REFUSAL  # was end_turn
    with claude.messages.stream(**_ask(claude, "[refuse]")) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "refusal" and final.content[0].text == REFUSAL
    assert claude.messages.create(**_ask(claude, "[plain]")).stop_reason == "end_turn"


def test_anthropic_citations_are_on_the_text_block(claude):
    m = claude.messages.create(**_ask(claude, "[cite]"))
    block = m.content[0]
    assert block.text == CITING and [(c.url, c.title, c.cited_text) for c in block.citations] == [
        (url, title, CITING[a:b]) for a, b, url, title in LINKS]  # was None
    with claude.messages.stream(**_ask(claude, "[cite]")) as stream:
        final = stream.get_final_message()
    assert [c.url for c in final.content[0].citations] == [url for _, _, url, _ in LINKS]
    assert all(c.type == "web_search_result_location" for c in final.content[0].citations)


# -- configuration -------------------------------------------------------------------------------------


def test_both_can_be_turned_off_and_the_patterns_replaced():
    engine = ReplayEngine(smollm_tokenizer(), REPLIES)
    with replay_server(engine, refusal_filter=False, citations=False) as off:
        message = _chat(off, "[refuse]").choices[0].message
        assert message.content == REFUSAL and message.refusal is None
        assert _chat(off, "[cite]").choices[0].message.annotations is None
    with replay_server(engine, refusal_patterns=("nope,",)) as custom:
        assert _chat(custom, "[nope]").choices[0].message.refusal == "Nope, not doing that."
        assert _chat(custom, "[refuse]").choices[0].message.content == REFUSAL  # not among its patterns
