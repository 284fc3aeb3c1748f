"""RequestStream: pieces that wait for a slow reader come out merged, and say what they said one by one."""

from __future__ import annotations

import trio

from spark.actors.ingress import RequestStream
from spark.actors.messages import Cancel, RequestOutput, TokenLogprob


def piece(text: str, *tokens: int, n: int, finish: str | None = None, error: str | None = None,
          stop: str | None = None, logprobs: bool = False) -> RequestOutput:
    lps = tuple(TokenLogprob(t, f"<{t}>", -t / 10, ((t, f"<{t}>", -t / 10),)) for t in tokens) if logprobs else ()
    return RequestOutput("r", text, tokens, lps, finish_reason=finish, stop_string=stop, num_prompt_tokens=7,
                         num_output_tokens=n, error=error)


def open_stream(*pieces: RequestOutput):
    send, recv = trio.open_memory_channel(64)
    cancels_send, cancels = trio.open_memory_channel(8)
    for p in pieces:
        send.send_nowait(p)
    return RequestStream("r", recv, cancels_send), send, cancels


def test_merge_joins_text_tokens_and_logprobs_and_ends_like_the_last_piece():
    pieces = [piece("He", 1, n=1, logprobs=True), piece("", 2, n=2, logprobs=True),
              piece("llo", 3, 4, n=4, finish="stop", stop="!", logprobs=True)]
    merged = RequestOutput.merge(pieces)
    assert merged.text == "Hello" and merged.token_ids == (1, 2, 3, 4)
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]  # one per token, in order
    assert (merged.finish_reason, merged.stop_string, merged.num_output_tokens, merged.num_prompt_tokens) == (
        "stop", "!", 4, 7)
    assert RequestOutput.merge(pieces[:1]) is pieces[0]


async def test_pieces_waiting_for_the_reader_come_as_one(autojump_clock):
    stream, send, _ = open_stream(piece("a", 1, n=1), piece("b", 2, n=2), piece("c", 3, n=3))
    first = await stream.__anext__()
    assert (first.text, first.token_ids, first.num_output_tokens, first.finish_reason) == ("abc", (1, 2, 3), 3, None)
    send.send_nowait(piece("d", 4, n=4))
    send.send_nowait(piece("", 5, n=5, finish="length"))
    last = await stream.__anext__()
    assert (last.text, last.token_ids, last.num_output_tokens, last.finish_reason) == ("d", (4, 5), 5, "length")
    assert stream.finished
    async for _ in stream:
        raise AssertionError("nothing after the last piece")


async def test_a_reader_that_keeps_up_gets_every_piece_alone(autojump_clock):
    stream, send, _ = open_stream()

    async def produce():
        for i in range(1, 4):
            await trio.sleep(1)
            send.send_nowait(piece(str(i), i, n=i, finish="length" if i == 3 else None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        got = [p.text async for p in stream]
    assert got == ["1", "2", "3"]


async def test_an_error_is_not_merged_so_the_text_before_it_comes_first(autojump_clock):
    stream, _, _ = open_stream(piece("a", 1, n=1), piece("b", 2, n=2), piece("", n=2, finish="error", error="boom"))
    got = [p async for p in stream]
    assert [(p.text, p.finish_reason) for p in got] == [("ab", None), ("", "error")]
    assert got[-1].error == "boom" and got[-1].num_output_tokens == 2


async def test_leaving_early_cancels_once_and_a_finished_stream_not_at_all(autojump_clock):
    stream, _, cancels = open_stream(piece("a", 1, n=1))
    async with stream:
        await stream.__anext__()
    assert cancels.receive_nowait() == Cancel("r")
    stream, _, cancels = open_stream(piece("a", 1, n=1), piece("b", 2, n=2, finish="stop"))
    async with stream:
        assert (await stream.__anext__()).finish_reason == "stop"
    assert cancels.statistics().current_buffer_used == 0
