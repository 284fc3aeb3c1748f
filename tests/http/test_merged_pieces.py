"""A reader slower than the engine gets several tokens in one piece (``RequestStream`` merges them):
every route must say exactly what it says token by token, logprobs one entry per token."""

from __future__ import annotations

import json

import pytest

from spark.actors.messages import GenerateRequest, RequestOutput, TokenLogprob
from spark.engine.sampling import SamplingParams
from spark.http import routes
from spark.http.params import Job
from spark.http.turn import TurnParser

HEAD = {"id": "x-1", "created": 1, "model": "m"}
# (token text, the text the detokenizer released with it): "é" is two byte tokens, released together
TOKENS = [("Hi", "Hi"), (" th", " th"), ("ere", "ere"), ("\\xc3", ""), ("\\xa9", "é"), ("!", "!")]


def token_pieces(*, logprobs: bool) -> list[RequestOutput]:
    """One piece per token, as the streamer sends them; the last ends the stream."""
    out = []
    for k, (token, text) in enumerate(TOKENS, 1):
        lps = (TokenLogprob(100 + k, token, -k / 4, ((100 + k, token, -k / 4), (7, "z", -9.0))),) if logprobs else ()
        out.append(RequestOutput("r-0", text, (100 + k,), lps, finish_reason="length" if k == len(TOKENS) else None,
                                 num_prompt_tokens=2, num_output_tokens=k))
    return out


def merged(pieces: list[RequestOutput], sizes: list[int]) -> list[RequestOutput]:
    out, start = [], 0
    for size in sizes:
        out.append(RequestOutput.merge(pieces[start:start + size]))
        start += size
    assert start == len(pieces)
    return out


SPLITS = [[1] * len(TOKENS), [3, 3], [2, 1, 3], [6]]


class Pieces:
    """A one-choice ``FanIn`` double that yields ``pieces``."""

    def __init__(self, pieces):
        self.pieces, self.closed = pieces, False

    async def __aiter__(self):
        for p in self.pieces:
            yield 0, p

    def close(self):
        self.closed = True


def job(*, logprobs: int | None) -> Job:
    params = SamplingParams(max_tokens=len(TOKENS), logprobs=logprobs)
    return Job((GenerateRequest("r-0", (1, 2), params),), 2, True, True)


async def events(gen) -> list[dict]:
    """The events of a stream of SSE writes (one write may hold several events)."""
    out = []
    async for chunk in gen:
        assert chunk.endswith(b"\n\n")
        for event in chunk[:-2].split(b"\n\n"):
            assert event.startswith(b"data: ")
            body = event[6:].decode()
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def completion_view(chunks: list[dict]):
    """What a client reads off a streamed completion: text, tokens with offsets, the end, usage."""
    text, tokens, offsets, top, ends, usage = "", [], [], [], [], None
    for c in chunks[:-1]:
        assert set(c) == {"id", "created", "model", "object", "usage", "choices"}
        if c["usage"]:
            usage = c["usage"]
        for choice in c["choices"]:
            text += choice["text"]
            if choice["finish_reason"]:
                ends.append(choice["finish_reason"])
            lp = choice["logprobs"]
            if lp is not None:
                columns = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                assert len({len(lp[k]) for k in columns}) == 1
                tokens += lp["tokens"]
                offsets += lp["text_offset"]
                top += lp["top_logprobs"]
    assert chunks[-1] == "[DONE]"
    return text, tokens, offsets, top, ends, usage


@pytest.mark.parametrize("logprobs", [None, 2])
async def test_streamed_completion_reads_the_same_however_tokens_are_merged(logprobs):
    views = []
    for sizes in SPLITS:
        pieces = merged(token_pieces(logprobs=logprobs is not None), sizes)
        chunks = await events(routes._completion_events(HEAD, job(logprobs=logprobs), Pieces(pieces)))
        views.append(completion_view(chunks))
        text_chunks = [c for c in chunks[:-1] if c["choices"] and c["choices"][0]["finish_reason"] is None]
        assert len(text_chunks) == sum(1 for p in pieces if p.text or p.logprobs)  # one chunk per piece
    assert all(v == views[0] for v in views)
    text, tokens, offsets, top, ends, usage = views[0]
    assert text == "Hi there\u00e9!" and ends == ["length"] and usage["completion_tokens"] == len(TOKENS)
    if logprobs:
        assert tokens == [t for t, _ in TOKENS] and offsets == [0, 2, 5, 8, 8, 9]  # both halves of "é" at 8
        assert top[0] == {"Hi": -0.25, "z": -9.0}


def chat_view(chunks: list[dict]):
    text, entries, ends, usage = "", [], [], None
    for c in chunks[:-1]:
        if c.get("usage"):
            usage = c["usage"]
        for choice in c["choices"]:
            text += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                ends.append(choice["finish_reason"])
            if choice["logprobs"] is not None:
                entries += choice["logprobs"]["content"]
    assert chunks[-1] == "[DONE]"
    return text, entries, ends, usage


@pytest.mark.parametrize("logprobs", [None, 1])
async def test_streamed_chat_reads_the_same_however_tokens_are_merged(logprobs):
    views = []
    for sizes in SPLITS:
        pieces = merged(token_pieces(logprobs=logprobs is not None), sizes)
        fanin = Pieces(pieces)
        chunks = await events(routes._chat_events(HEAD, job(logprobs=logprobs), fanin, [TurnParser(None, False)]))
        views.append(chat_view(chunks))
        assert fanin.closed
    assert all(v == views[0] for v in views)
    text, entries, ends, usage = views[0]
    assert text == "Hi there\u00e9!" and ends == ["length"] and usage["completion_tokens"] == len(TOKENS)
    if logprobs:  # OpenAI's shape: one entry per token, bytes undo the \x escapes
        assert [e["token"] for e in entries] == [t for t, _ in TOKENS]
        assert entries[3]["bytes"] == [0xC3] and entries[4]["bytes"] == [0xA9]
        assert [len(e["top_logprobs"]) for e in entries] == [2] * len(TOKENS)


async def test_collected_completion_is_the_same_however_tokens_are_merged():
    answers = []
    for sizes in SPLITS:
        pieces = merged(token_pieces(logprobs=True), sizes)
        texts, logprobs, reasons, tokens, _, _ = await routes._collect(job(logprobs=2), Pieces(pieces))
        answers.append((texts, [lp.token for lp in logprobs[0]], reasons, tokens))
    assert all(a == answers[0] for a in answers)
    assert answers[0] == (["Hi there\u00e9!"], [t for t, _ in TOKENS], ["length"], len(TOKENS))


async def test_an_error_after_merged_text_still_shows_the_text_first():
    pieces = merged(token_pieces(logprobs=False), [2, 4])[:1] + [
        RequestOutput("r-0", "", (), finish_reason="error", error="boom", num_output_tokens=2)]
    chunks = await events(routes._completion_events(HEAD, job(logprobs=None), Pieces(pieces)))
    assert chunks[0]["choices"][0]["text"] == "Hi th"
    assert chunks[1]["error"]["code"] == "generation_failed" and "boom" in chunks[1]["error"]["message"]


async def test_completion_chunks_keep_their_shape():
    """The fast path (an encoded template) writes what the dict path wrote, key for key."""
    chunks = await events(routes._completion_events(HEAD, job(logprobs=None), Pieces(merged(token_pieces(
        logprobs=False), [6]))))
    assert chunks[0] == {**HEAD, "object": "text_completion", "usage": None,
                         "choices": [{"index": 0, "text": "Hi there\u00e9!", "logprobs": None, "finish_reason": None}]}
    assert list(chunks[0]) == ["id", "created", "model", "object", "usage", "choices"]
