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


def _ingress(*, rps: float = 0.0, queue: int = 8):
    from spark.actors.ingress import Ingress
    from spark.actors.rate_limiter import RateLimiter
    from spark.metrics import Metrics

    admissions_send, admissions = trio.open_memory_channel(queue)
    cancels_send, _ = trio.open_memory_channel(64)
    ingress = Ingress(admissions_send, cancels_send, max_model_len=64, max_tokens_in_cache=1024, vocab_size=100,
                      rate_limiter=RateLimiter(rps=rps), metrics=Metrics())
    return ingress, admissions


def _choices(request_id: str, n: int, key: str | None = "k1"):
    from spark.actors.messages import GenerateRequest
    from spark.engine.sampling import SamplingParams

    return [GenerateRequest(f"{request_id}-{i}", (1, 2), SamplingParams(max_tokens=1), api_key=key) for i in range(n)]


async def test_the_choices_of_one_request_are_one_request_to_the_rate_limiter(autojump_clock):
    """Issue 18.1: at 1 request/s, n=2 was refused every time (its 2nd choice was a 2nd request),
    and the key was charged for the 1st anyway."""
    import pytest

    from spark.actors.ingress import SubmitError

    ingress, admissions = _ingress(rps=1)
    assert len(ingress.submit_all(_choices("a", 2))) == 2
    assert admissions.statistics().current_buffer_used == 2
    with pytest.raises(SubmitError) as refused:  # the bucket is empty for a second
        ingress.submit_all(_choices("b", 2))
    assert refused.value.status == 429 and admissions.statistics().current_buffer_used == 2  # nothing queued
    await trio.sleep(1.0)
    assert len(ingress.submit_all(_choices("c", 1))) == 1  # the refusal charged nothing


async def test_the_choices_of_one_request_are_queued_together_or_not_at_all(autojump_clock):
    import pytest

    from spark.actors.ingress import SubmitError

    ingress, admissions = _ingress(queue=3)
    ingress.submit_all(_choices("a", 2, key=None))
    with pytest.raises(SubmitError) as refused:
        ingress.submit_all(_choices("b", 2, key=None))  # one slot left: not half of them
    assert refused.value.status == 503 and admissions.statistics().current_buffer_used == 2
    assert len(ingress.submit_all(_choices("c", 1, key=None))) == 1


async def test_more_choices_than_the_queue_holds_is_a_bad_request_not_a_retry():
    """Issue 27.10: a 503 with Retry-After for a request that can never fit."""
    import pytest

    from spark.actors.ingress import SubmitError

    ingress, admissions = _ingress(queue=4)
    with pytest.raises(SubmitError) as refused:
        ingress.submit_all(_choices("many", 5, key=None))
    assert refused.value.status == 400 and "more than the server queues" in refused.value.message
    assert admissions.statistics().current_buffer_used == 0  # nothing of it was queued
