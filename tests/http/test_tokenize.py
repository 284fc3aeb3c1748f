"""/tokenize and /detokenize in vLLM's shapes, and completions' echo (issue 25), through a real server
whose model replays scripted text (``tests.http.replay``)."""

from __future__ import annotations

import pytest

from tests.http.replay import ReplayEngine, replay_server, smollm_tokenizer

REPLY = " over the lazy dog."


@pytest.fixture(scope="module")
def engine():
    return ReplayEngine(smollm_tokenizer(), {}, default=REPLY)


@pytest.fixture(scope="module")
def server(engine):
    with replay_server(engine) as running:
        yield running


# -- /tokenize, /detokenize ----------------------------------------------------------------------


def test_a_prompt_is_counted_as_completions_encode_it(server):
    tok = smollm_tokenizer()
    with server.http() as http:
        r = http.post("/tokenize", json={"model": "replay", "prompt": "Hello world", "return_token_strs": True})
        assert r.status_code == 200, r.text  # was 404
        body = r.json()
        assert body == {"count": len(body["tokens"]), "max_model_len": 4096,
                        "tokens": tok.encode("Hello world", add_special_tokens=True),
                        "token_strs": [tok.token_text(t) for t in body["tokens"]]}
        plain = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
        assert plain["tokens"] == tok.encode("Hello world") and plain["token_strs"] is None
        done = server.client().completions.create(model="replay", prompt="Hello world", max_tokens=2)
        assert done.usage.prompt_tokens == body["count"]


def test_messages_are_counted_as_chat_completions_render_them(server, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with server.http() as http:
        body = http.post("/tokenize", json={"model": "replay", "messages": messages}).json()
        bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    chat = server.client().chat.completions.create(model="replay", messages=messages, max_tokens=2)
    assert body["count"] == chat.usage.prompt_tokens == len(body["tokens"])
    assert smollm_tokenizer().decode(body["tokens"]) == engine.prompts[-1]  # the very prompt the model got
    assert body["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < body["count"]
    assert smollm_tokenizer().decode(body["tokens"][bare["count"]:]).strip() == "<|im_start|>assistant"


def test_detokenize_gives_the_text_back(server):
    tok = smollm_tokenizer()
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": "Grüße, world!", "add_special_tokens": False}).json()["tokens"]
        r = http.post("/detokenize", json={"model": "replay", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Grüße, world!"} == {"prompt": tok.decode(ids)}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_bad_input_is_a_400_in_openais_shape(server, path, body, param):
    with server.http() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]


def test_an_unknown_model_is_a_404(server):
    with server.http() as http:
        r = http.post("/tokenize", json={"model": "gpt-4o", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# -- completions echo -----------------------------------------------------------------------------


def test_echo_puts_the_prompt_before_the_text(server):
    client = server.client()
    r = client.completions.create(model="replay", prompt="The quick brown fox", max_tokens=20, echo=True)  # was 400
    assert r.choices[0].text == "The quick brown fox" + REPLY
    chunks = list(client.completions.create(model="replay", prompt="The quick brown fox", max_tokens=20, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == "The quick brown fox"  # the prompt first, on its own
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_echo_of_token_ids_and_of_several_prompts_and_choices(server):
    tok = smollm_tokenizer()
    ids = tok.encode("Jumps")
    r = server.client().completions.create(model="replay", prompt=["A", "B"], max_tokens=20, echo=True, n=2)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == ["A" + REPLY] * 2 + ["B" + REPLY] * 2
    r = server.client().completions.create(model="replay", prompt=ids, max_tokens=20, echo=True)
    assert r.choices[0].text == tok.decode(ids) + REPLY


def test_echo_with_logprobs_lists_the_prompts_tokens_first(server):
    tok = smollm_tokenizer()
    prompt = "The quick brown fox"
    ids = tok.encode(prompt, add_special_tokens=True)
    client = server.client()
    r = client.completions.create(model="replay", prompt=prompt, max_tokens=20, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    generated = len(tok.encode(REPLY))  # the end of text writes none of the text: not listed
    assert lp.tokens[:len(ids)] == [tok.token_text(t) for t in ids] and len(lp.tokens) == len(ids) + generated
    assert lp.token_logprobs[:len(ids)] == [None] * len(ids)  # the replayed model scores no prompt
    assert all(p is not None for p in lp.token_logprobs[len(ids):])
    assert lp.text_offset[len(ids)] == len(prompt)  # the text's first generated character
    assert r.choices[0].text[lp.text_offset[len(ids)]:].startswith(lp.tokens[len(ids)])
    chunks = list(client.completions.create(model="replay", prompt=prompt, max_tokens=20, echo=True, logprobs=1,
                                            stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_a_server_with_keys_asks_one_for_tokenize_and_detokenize(server):
    with server.http(auth=False) as http:
        for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [1, 2]})):
            r = http.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # was 200
    with server.http() as http:
        assert http.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
