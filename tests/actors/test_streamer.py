"""StopMatcher over every split of a text, and the streamer actor fed by hand."""

from __future__ import annotations

import itertools
import random

import pytest
import trio
import trio.testing

from spark.actors import streamer
from spark.actors.messages import Cancel, GenerateRequest, StreamOpen, Submission
from spark.core.events import Failed, TokenBatch
from spark.actors.streamer import StopMatcher
from spark.core.plan import TokenOutput
from spark.engine.sampling import SamplingParams
from spark.metrics import Metrics
from tests.actors.engine_double import CharTokenizer


def first_stop(text: str, stops) -> tuple[str, str | None]:
    """The answer: generation ends where a stop string first completes; the text before it.

    Among stops that complete at the same character, the one that started first wins.
    """
    best = None  # (end, start, stop)
    for stop in filter(None, stops):
        start = text.find(stop)
        if start >= 0:
            best = min(best or (len(text) + 1, 0, ""), (start + len(stop), start, stop))
    return (text, None) if best is None else (text[: best[1]], best[2])


def splits(text: str, rng: random.Random, *, exhaustive_up_to: int = 12, samples: int = 3000):
    """Every way to cut ``text`` into pieces (or ``samples`` random ones, some pieces empty)."""
    n = len(text)
    if n <= exhaustive_up_to:
        for cuts in itertools.product((False, True), repeat=max(0, n - 1)):
            pieces, start = [], 0
            for i, cut in enumerate(cuts, 1):
                if cut:
                    pieces.append(text[start:i])
                    start = i
            yield pieces + [text[start:]]
        return
    for _ in range(samples):
        cuts = sorted(rng.sample(range(n + 1), rng.randint(0, min(n, 10))) + [0, n])
        yield [text[a:b] for a, b in zip(cuts, cuts[1:])]  # repeated cuts give empty pieces


def check_every_split(text: str, stops: tuple[str, ...]) -> int:
    answer, answer_stop = first_stop(text, stops)
    count = 0
    for pieces in splits(text, random.Random(text)):
        matcher, emitted, stop = StopMatcher(stops), "", None
        for piece in pieces:
            out, stop = matcher.feed(piece)
            emitted += out
            assert answer.startswith(emitted), (pieces, emitted, answer)  # never a premature part of a stop
            if stop is not None:
                break
        else:
            emitted += matcher.flush()
        assert (emitted, stop) == (answer, answer_stop), pieces
        count += 1
    return count


@pytest.mark.parametrize("text, stops", [
    ("say STOP now", ("STOP",)),
    ("abcabcabd!", ("abd",)),  # partial matches that fail, then one that completes
    ("aaaab", ("aab",)),  # a stop overlapping itself
    ("STOP then", ("STOP",)),  # at the very start
    ("ends in sto", ("stop",)),  # a prefix at the end is flushed, not lost
    ("no stop here", ("zzz", "ere!")),
    ("one two three", ("three", "two")),  # the earlier one wins, whatever the list order
    ("the end.", ("end.", "end")),  # one stop a prefix of another: the shorter completes first
    ("abc", ("", "c")),  # empty stop strings are ignored
    ("café → naïve", ("→",)),
    ("User: hi\n\nAssistant: hello\n\nUser:", ("\n\nUser:", "<|im_end|>")),  # random splits
])
def test_stop_matcher_over_every_split(text, stops):
    assert check_every_split(text, stops) > 0


@pytest.mark.parametrize("text, stops", [
    ("x<|end|>y", ("<|end|>", "|e")),  # a stop inside a longer one completes first
    ("a\nUser: b", ("\nUser:", "User")),
])
def test_stop_matcher_answer_does_not_depend_on_the_split_when_stops_nest(text, stops):
    # The stream ends where a stop string first completes, so the answer must not
    # change with how the text was cut into tokens.
    assert check_every_split(text, stops) > 0


def test_stop_matcher_without_stops_passes_text_through():
    matcher = StopMatcher(())
    assert matcher.feed("abc") == ("abc", None)
    assert matcher.flush() == ""


# -- the streamer actor ------------------------------------------------------------

TOK = CharTokenizer()


class Harness:
    def __init__(self, nursery):
        self.nursery = nursery
        self.inbox, inbox_recv = trio.open_memory_channel(100)
        self.cancels_send, self.cancels = trio.open_memory_channel(100)
        self.metrics = Metrics()
        self._inbox_recv = inbox_recv

    async def start(self):
        await self.nursery.start(streamer.run, TOK, self._inbox_recv, self.cancels_send, self.metrics)

    async def open(self, request_id, *, stop=(), max_tokens=50, arrival=0.0, logprobs=None):
        send, recv = trio.open_memory_channel(max_tokens + 8)
        req = GenerateRequest(request_id, (0, ord("?")), SamplingParams(max_tokens=max_tokens, logprobs=logprobs),
                              stop=stop)
        await self.inbox.send(StreamOpen(Submission(req, send, arrival)))
        return recv

    async def tokens(self, request_id, text, *, last_reason=None, step=0.01):
        for i, ch in enumerate(text):
            await trio.sleep(step)
            reason = last_reason if i == len(text) - 1 else None
            out = TokenOutput(request_id, ord(ch), logprob=-0.5, finish_reason=reason)  # read when logprobs are asked
            await self.inbox.send(TokenBatch((out,), trio.current_time()))


async def read_all(recv):
    pieces = []
    with trio.fail_after(10):
        async for piece in recv:
            pieces.append(piece)
    return pieces


async def test_streamer_ends_before_the_stop_string_and_asks_to_free_the_request(autojump_clock):
    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        recv = await h.open("r", stop=("END",))
        await h.tokens("r", "hi ENDING")  # tokens after the match are ignored
        pieces = await read_all(recv)
        assert "".join(p.text for p in pieces) == "hi "
        assert [p.finish_reason for p in pieces] == [None] * 5 + ["stop"]
        assert pieces[-1].stop_string == "END" and pieces[-1].num_output_tokens == 6
        assert [p.token_ids for p in pieces] == [(ord(c),) for c in "hi END"]
        with trio.fail_after(1):
            assert await h.cancels.receive() == Cancel("r")
        assert h.metrics.registry.get_sample_value("spark_generation_tokens_total") == 6
        nursery.cancel_scope.cancel()


async def test_streamer_flushes_held_text_when_the_engine_ends_the_stream(autojump_clock):
    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        recv = await h.open("r", stop=("END",))
        await h.tokens("r", "so EN", last_reason="length")
        pieces = await read_all(recv)
        assert "".join(p.text for p in pieces) == "so EN"  # "EN" was held back, then released
        assert pieces[-1].finish_reason == "length" and pieces[-1].stop_string is None
        assert h.cancels.statistics().current_buffer_used == 0  # the engine forgot it already
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("stop, reason, tokens", [
    ((), "stop", "Hi"),  # the engine stopped on the last token ("$", its EOS): a control token, no entry
    ((), "length", "Hi$"),  # a length cut ends on a token of the text
    (("$",), "stop", "Hi"),  # a stop string's tokens end the text, as the text is cut
])
async def test_streamer_logprobs_are_the_tokens_of_the_text(autojump_clock, stop, reason, tokens):
    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        recv = await h.open("r", stop=stop, logprobs=0)
        await h.tokens("r", "Hi$", last_reason=reason)
        pieces = await read_all(recv)
        assert "".join(lp.token for p in pieces for lp in p.logprobs) == tokens
        assert pieces[-1].finish_reason == "stop" if stop else reason
        nursery.cancel_scope.cancel()


async def test_streamer_reports_a_failure_and_keeps_other_streams(autojump_clock):
    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        bad, good = await h.open("bad"), await h.open("good")
        await h.tokens("bad", "ab")
        await h.inbox.send(Failed("bad", "engine step failed: boom"))
        await h.tokens("good", "ok", last_reason="stop")
        bad_pieces, good_pieces = await read_all(bad), await read_all(good)
        assert bad_pieces[-1].finish_reason == "error" and bad_pieces[-1].error == "engine step failed: boom"
        assert bad_pieces[-1].num_output_tokens == 2 and "".join(p.text for p in bad_pieces) == "ab"
        assert "".join(p.text for p in good_pieces) == "ok" and good_pieces[-1].finish_reason == "stop"
        nursery.cancel_scope.cancel()


async def test_streamer_measures_ttft_and_inter_token_latency(autojump_clock):
    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        recv = await h.open("r", arrival=trio.current_time())
        await h.tokens("r", "abcd", last_reason="length", step=0.04)
        await read_all(recv)
        sample = h.metrics.registry.get_sample_value
        assert sample("spark_time_to_first_token_seconds_sum") == pytest.approx(0.04)
        assert sample("spark_inter_token_latency_seconds_sum") == pytest.approx(0.12)
        assert sample("spark_inter_token_latency_seconds_count") == 3
        assert sample("spark_e2e_request_latency_seconds_sum") == pytest.approx(0.16)
        nursery.cancel_scope.cancel()


async def test_streamer_survives_a_client_that_left(autojump_clock):
    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        gone, stays = await h.open("gone"), await h.open("stays")
        await gone.aclose()
        await h.tokens("gone", "xyz", last_reason="length")
        await h.tokens("stays", "fine", last_reason="length")
        assert "".join(p.text for p in await read_all(stays)) == "fine"
        nursery.cancel_scope.cancel()


async def test_streamer_takes_every_waiting_step_in_one_turn_so_a_reader_gets_them_merged(autojump_clock):
    from spark.actors.ingress import RequestStream

    async with trio.open_nursery() as nursery:
        h = Harness(nursery)
        await h.start()
        stream = RequestStream("r", await h.open("r"), h.cancels_send.clone())
        await trio.testing.wait_all_tasks_blocked()
        for i, ch in enumerate("abc"):  # three steps came while the event loop was busy elsewhere
            h.inbox.send_nowait(TokenBatch((TokenOutput("r", ord(ch), finish_reason="length" if i == 2 else None),),
                                           trio.current_time()))
        pieces = [p async for p in stream]
        assert [(p.text, p.token_ids, p.finish_reason) for p in pieces] == [("abc", (97, 98, 99), "length")]
        assert h.metrics.registry.get_sample_value("spark_generation_tokens_total") == 3
        nursery.cancel_scope.cancel()
