"""Faults on purpose through the whole server (``SPARK_FAULTS``): a request told to fail ends with an
error in its API's shape, streamed or not; the others finish, the pages come back, the server serves on."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time

import anthropic
import httpx
import openai
import pytest

from spark.http.serve import serve_async
from spark.serve_config import ServeConfig
from tests.http.conftest import API_KEY
from tests.http.replay import ReplayEngine, replay_server, smollm_tokenizer
from tests.server_thread import serve_in_thread


@pytest.fixture(scope="module")
def url():
    # The preflight is the 1st request the core admits: the 2nd, 4th, ... fail.
    config = ServeConfig(model="dummy:tiny-llama", port=0, device="cpu", kv_cache_bytes=16 << 20,
                         faults="request=2")
    with serve_in_thread(functools.partial(serve_async, config, quiet=True), name="spark-faults") as url:
        yield url


def pages_used(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("spark_kv_pages_used "):
            return float(line.split()[1])
    raise AssertionError("no spark_kv_pages_used in /metrics")


def test_a_failed_request_is_an_error_in_the_apis_shape_and_the_next_ones_finish(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    with client:
        model = client.models.list().data[0].id
        # greedy: random weights at temperature 1 may sample the end of text within 4 tokens
        ask = dict(model=model, prompt="hello", max_tokens=4, temperature=0)
        with pytest.raises(openai.InternalServerError) as failed:  # the 2nd admitted
            client.completions.create(**ask)
        assert failed.value.status_code == 500 and "told to fail" in str(failed.value)
        assert failed.value.body["code"] == "generation_failed"
        assert client.completions.create(**ask).choices[0].finish_reason == "length"  # the 3rd
        with pytest.raises(openai.APIError, match="told to fail"):  # the 4th, streamed
            for _ in client.completions.create(**ask, stream=True):
                pass
        chunks = list(client.completions.create(**ask, stream=True))  # the 5th
        assert chunks[-1].choices[0].finish_reason == "length"
    deadline = time.monotonic() + 5  # the gauge follows the core's last turn
    while pages_used(url) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pages_used(url) == 0


# -- a step that fails under concurrent load, across the APIs --------------------------------------

FAILING_STEP = 250  # counted from the server's first launch (its preflight's steps included)
SLOW_STEP = 0.03  # seconds a step takes until the test lets the engine run free
LONG = " ".join(f"w{i}" for i in range(400))  # longer than FAILING_STEP tokens: still decoding when it fails
SHORT = "Fine, thanks."


class PacedReplay(ReplayEngine):
    """A replaying engine whose steps are slow until ``fast`` is set, counting the core's launches
    (every launch with chunks; the core counts those, and a faulted one never reaches the engine)."""

    def __init__(self):
        super().__init__(smollm_tokenizer(), {"[long]": LONG, "[short]": SHORT})
        self.launches = 0
        self.fast = threading.Event()

    def launch(self, plan):
        if plan.chunks:
            self.launches += 1
        super().launch(plan)

    def step(self, plan):
        if plan.chunks:
            self.fast.wait(SLOW_STEP)  # returns at once when set
        return super().step(plan)


@pytest.fixture(scope="module")
def paced():
    engine = PacedReplay()
    assert len(engine.tokenizer.encode(LONG)) > FAILING_STEP + 50
    # A batch of 4: the 4 long requests fill it, the others wait in the server's queue.
    with replay_server(engine, faults=f"step={FAILING_STEP}", max_batch_size=4) as server:
        yield server, engine


GAUGES = {"spark_requests_running": "running", "spark_requests_waiting": "waiting", "spark_kv_pages_used": "pages"}


def gauges(server) -> dict[str, float]:
    """Requests running and waiting and KV pages used, from /metrics."""
    with server.http() as http:
        lines = http.get("/metrics").text.splitlines()
    return {GAUGES[name]: float(value) for name, _, value in (line.partition(" ") for line in lines) if name in GAUGES}


def wait_for(server, deadline_s: float = 20, **want: float) -> dict[str, float]:
    """The gauges once they read ``want`` (or as they are at the deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        now = gauges(server)
        if all(now[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def test_a_failed_step_fails_the_requests_it_ran_in_their_apis_shapes_and_spares_the_rest(paced):
    server, engine = paced
    client = server.client()
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)
    told = f"step {FAILING_STEP} was told to fail"

    def chat_streamed(marker):
        text = []
        try:
            for chunk in client.chat.completions.create(
                    model="replay", messages=[{"role": "user", "content": f"Hi {marker}"}], max_tokens=1000,
                    stream=True):
                text.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason:
                    return "finished", "".join(text), chunk.choices[0].finish_reason
        except openai.APIError as exc:  # an {"error": {...}} event: the SDK raises it with that body
            return "error", "".join(text), exc.body
        return "cut", "".join(text), None

    def messages_streamed(marker):
        text = []
        try:
            with claude.messages.create(model="replay", max_tokens=1000, stream=True,
                                        messages=[{"role": "user", "content": f"Hi {marker}"}]) as events:
                for event in events:
                    if event.type == "content_block_delta":
                        text.append(event.delta.text)
                    elif event.type == "message_delta":
                        return "finished", "".join(text), event.delta.stop_reason
        except anthropic.APIStatusError as exc:  # "event: error": the SDK raises it with the event's data
            return "error", "".join(text), exc.body
        return "cut", "".join(text), None

    def responses_streamed(marker):
        text = []
        for event in client.responses.create(model="replay", input=f"Hi {marker}", max_output_tokens=1000,
                                             stream=True):
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete", "response.failed"):
                return event.type, "".join(text), event.response
        return "cut", "".join(text), None

    def completion(marker):
        try:
            r = client.completions.create(model="replay", prompt=f"Hi {marker}", max_tokens=1000)
        except openai.APIStatusError as exc:
            return "error", exc.status_code, exc.body
        return "finished", r.choices[0].text, r.choices[0].finish_reason

    with claude, concurrent.futures.ThreadPoolExecutor(6) as pool:
        try:
            assert engine.launches < 20  # the start-up's steps
            apis = (chat_streamed, messages_streamed, responses_streamed, completion)
            hit = [pool.submit(ask, "[long]") for ask in apis]
            assert wait_for(server, running=4)["running"] == 4
            spared = [pool.submit(ask, "[short]") for ask in (chat_streamed, messages_streamed)]
            now = wait_for(server, running=4, waiting=2)
            assert (now["running"], now["waiting"]) == (4, 2)
            assert engine.launches < FAILING_STEP - 10  # the fault is still ahead: it hits these 4 mid-reply
            engine.fast.set()
            chat, message, response, completed = (f.result(timeout=60) for f in hit)
            spared = [f.result(timeout=60) for f in spared]
        finally:
            engine.fast.set()  # whatever failed, the requests under way end soon

    # OpenAI chat: content deltas, then an {"error"} event in OpenAI's error shape.
    assert chat[0] == "error" and LONG.startswith(chat[1].strip()) and chat[1].strip()
    assert chat[2]["code"] == "generation_failed" and told in chat[2]["message"]
    assert set(chat[2]) == {"message", "type", "param", "code"}
    # Anthropic: text deltas, then event: error with {"type": "error", "error": {"type", "message"}}.
    assert message[0] == "error" and message[1].strip() and LONG.startswith(message[1].strip())
    assert message[2]["type"] == "error" and message[2]["error"]["type"] == "api_error"
    assert told in message[2]["error"]["message"] and set(message[2]["error"]) == {"type", "message"}
    # Responses: text deltas, then response.failed whose response is failed with a server_error.
    assert response[0] == "response.failed" and response[1].strip() and LONG.startswith(response[1].strip())
    assert response[2].status == "failed" and response[2].error.code == "server_error"
    assert told in response[2].error.message
    # Completions, not streamed: a 500 in OpenAI's error shape.
    assert completed[0] == "error" and completed[1] == 500
    assert completed[2]["code"] == "generation_failed" and told in completed[2]["message"]
    # The requests that waited while the step failed finish normally.
    assert spared == [("finished", SHORT, "stop"), ("finished", SHORT, "end_turn")]

    assert wait_for(server, deadline_s=5, running=0, waiting=0, pages=0) == {"running": 0, "waiting": 0, "pages": 0}
    # and the server serves on
    assert completion("[short]") == ("finished", SHORT, "stop")
    assert chat_streamed("[short]") == ("finished", SHORT, "stop")
