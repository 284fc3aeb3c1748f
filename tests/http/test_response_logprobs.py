"""The Responses API's output text logprobs (``include=["message.output_text.logprobs"]``) through the
official ``openai`` SDK, on the real default model: whole and streamed, the same tokens chat completions
scores, and none without the include."""

from __future__ import annotations

import pytest

LOGPROBS = ["message.output_text.logprobs"]
PROMPT = "Say hi"


def _create(server, **kw):
    # store=False: the session's server keeps its state file in the user's data directory
    return server.client().responses.create(model=server.model, input=PROMPT, temperature=0, store=False, **kw)


def _check_tokens(logprobs, text: str, k: int) -> None:
    assert logprobs and "".join(lp.token for lp in logprobs) == text
    for lp in logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == k
        assert all(top.logprob <= 0 for top in lp.top_logprobs)
        if k:
            assert lp.token == lp.top_logprobs[0].token  # temperature 0 picks the best
            assert lp.top_logprobs[0].logprob >= lp.top_logprobs[-1].logprob


@pytest.mark.parametrize("max_output_tokens, status", [(8, "incomplete"), (120, "completed")])
def test_output_text_logprobs(server, max_output_tokens, status):
    r = _create(server, max_output_tokens=max_output_tokens, include=LOGPROBS, top_logprobs=3)
    assert r.status == status and r.top_logprobs == 3
    (part,) = r.output[0].content
    _check_tokens(part.logprobs, part.text, 3)
    assert part.text == r.output_text
    for lp in part.logprobs:
        assert bytes(lp.bytes).decode("utf-8", "replace") == lp.token
    # every token the model made is there, but the EOS it stopped on, which writes no text
    assert len(part.logprobs) == r.usage.output_tokens - (status == "completed")


def test_the_same_tokens_as_chat_completions(server):
    r = _create(server, max_output_tokens=10, include=LOGPROBS, top_logprobs=2)
    chat = server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    ours, theirs = r.output[0].content[0].logprobs, chat.choices[0].logprobs.content
    assert [lp.token for lp in ours] == [lp.token for lp in theirs]
    assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=1e-4)


def test_streamed_deltas_carry_their_tokens(server):
    with server.client().responses.stream(model=server.model, input=PROMPT, temperature=0, store=False,
                                          max_output_tokens=120, include=LOGPROBS, top_logprobs=2) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed"  # ended by EOS, which is no token of the text
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    text = final.output_text
    assert "".join(e.delta for e in deltas) == text == done.text
    for e in deltas:  # each delta's tokens write its text
        assert "".join(lp.token for lp in e.logprobs) == e.delta
    _check_tokens([lp for e in deltas for lp in e.logprobs], text, 2)
    _check_tokens(done.logprobs, text, 2)
    _check_tokens(final.output[0].content[0].logprobs, text, 2)
    whole = _create(server, max_output_tokens=120, include=LOGPROBS, top_logprobs=2)
    assert [lp.token for lp in whole.output[0].content[0].logprobs] == [lp.token for e in deltas for lp in e.logprobs]


def test_zero_alternatives(server):
    r = _create(server, max_output_tokens=6, include=LOGPROBS)
    _check_tokens(r.output[0].content[0].logprobs, r.output_text, 0)


def test_none_without_the_include(server):
    r = _create(server, max_output_tokens=6, top_logprobs=3)  # as OpenAI's: top_logprobs alone shows none
    assert r.output[0].content[0].logprobs == [] and r.output_text
    with server.client().responses.stream(model=server.model, input=PROMPT, temperature=0, store=False,
                                          max_output_tokens=6) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert deltas and all(e.logprobs == [] for e in deltas)
