"""Text <-> token ids for a model, from an HF tokenizer directory or from GGUF metadata.

Both sources end up as one `tokenizers.Tokenizer`. From GGUF we rebuild the byte-level
BPE that llama.cpp runs, with llama.cpp's pre-tokenizer regexes for the `pre` name, so
that the ids match what llama.cpp would feed the model.
"""

from __future__ import annotations

import functools
import json
import logging
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from spark.engine import chat_template as templating
from spark.engine.chat_template import ChatTemplateError
from spark.engine.errors import ModelLoadError
from spark.parsers.hermes import CLOSE as HERMES_CLOSE, OPEN as HERMES_OPEN
from spark.parsers.reasoning import THINK_CLOSE, THINK_OPEN
from spark.parsers.xml_calls import MINIMAX, QWEN3_CODER

__all__ = ["ChatTemplateError", "Tokenizer", "read_gguf_metadata"]

log = logging.getLogger(__name__)

# --- llama.cpp pre-tokenizers (llama-vocab.cpp). Each regex splits the pieces the
# previous one left, keeping unmatched text as pieces of its own.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp spells (?i:'s|...) out case by case, so only ASCII letters fold.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # every digit on its own
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
_PRE_ALIASES = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4", "a.x-4.0", "mellum"), "gpt2"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), "smollm"),
    **dict.fromkeys(("llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe",
                     "midm-2.0", "lfm2"), "llama3"),
    **dict.fromkeys(("deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "kormo"), "qwen2"),
}
_ADDS_BOS_BY_DEFAULT = {"llama3"}  # llama.cpp's default when the GGUF has no add_bos_token

# tokenizer.ggml.token_type values (gguf.TokenType)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Texts llama.cpp also treats as end of generation, whatever the GGUF says.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|eom_id|>"}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


# The tags the output parsers find in generated text: decoding keeps them.
PARSER_TAGS = frozenset({THINK_OPEN, THINK_CLOSE, HERMES_OPEN, HERMES_CLOSE,
                         *(tag for d in (QWEN3_CODER, MINIMAX) for tag in (d.block_open, d.block_close))})


class Tokenizer:
    """A model's tokenizer: encode, decode, and render chat prompts.

    Build one with `from_hf_dir` or `from_gguf`.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_token: bool,
                 chat_template: str | Mapping[str, str] | None = None,
                 special_token_strings: Mapping[str, str] | None = None, raw_pieces: Mapping[int, str] | None = None):
        self.backend = backend
        # Added tokens whose text the decoder would misread as byte-level characters; they
        # are printed as written, like llama.cpp prints control and user-defined tokens.
        self._raw_pieces = dict(raw_pieces or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        # What skip_special_tokens leaves out: control tokens, but never the tags the output
        # parsers read (<think>, <tool_call>, ...), whatever the vocabulary marks special.
        self.special_ids = frozenset(i for i, t in added.items() if t.special and t.content not in PARSER_TAGS)
        strings = dict(special_token_strings or {})
        if bos_token_id is not None:
            strings.setdefault("bos_token", self.id_to_token(bos_token_id))
        if self.eos_token_ids:
            strings.setdefault("eos_token", self.id_to_token(self.eos_token_ids[0]))
        self._template_tokens = {k: v for k, v in strings.items() if v is not None}

    # --- constructors

    @classmethod
    def for_source(cls, source) -> Tokenizer:
        """The tokenizer of a resolved model (``spark.engine.weights.resolve_model``): its file's, or a
        synthetic one for dummy weights."""
        if source.kind == "gguf":
            return cls.from_gguf(source.path)
        if source.kind == "hf":
            return cls.from_hf_dir(source.path)
        return cls.synthetic(source.config.vocab_size)

    @classmethod
    def synthetic(cls, vocab_size: int) -> Tokenizer:
        """A stand-in for models with dummy weights: token i is the word ``t<i>``.

        Every id decodes to visible text (so every generated token streams as a
        piece, as with a real model) and text of such words encodes back; a
        plain chat template joins the messages. For benchmarks and tests only.
        """
        vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        backend.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
        template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        return cls(backend, bos_token_id=None, eos_token_ids=(), add_bos_token=False, chat_template=template)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load an HF model's `tokenizer.json` with its tokenizer and generation configs.

        Args:
          path: the model directory.

        Returns:
          The tokenizer.

        Raises:
          ModelLoadError: `tokenizer.json` is missing or unreadable.
        """
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ModelLoadError(path, "no tokenizer.json in the model directory")
        try:
            backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:
            raise ModelLoadError(root / "tokenizer.json", f"cannot parse: {e}") from e
        # Older models keep the special tokens in special_tokens_map.json.
        config = {**_read_json(root / "special_tokens_map.json"), **_read_json(root / "tokenizer_config.json")}
        generation = _read_json(root / "generation_config.json")

        strings = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = backend.token_to_id(strings["bos_token"]) if strings["bos_token"] else None
        eos_ids = [backend.token_to_id(strings["eos_token"])] if strings["eos_token"] else []
        extra = generation.get("eos_token_id")
        eos_ids += extra if isinstance(extra, list) else [extra]
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]

        template: Any = config.get("chat_template")
        if (root / "chat_template.jinja").is_file():  # newer transformers save it beside the config
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}

        with_specials = backend.encode("", add_special_tokens=True).ids
        return cls(backend, bos_token_id=bos_id, eos_token_ids=[i for i in eos_ids if i is not None],
                   add_bos_token=bos_id is not None and with_specials[:1] == [bos_id],
                   chat_template=template, special_token_strings=strings)

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | Mapping[str, Any] | Any) -> Tokenizer:
        """Rebuild the byte-level BPE tokenizer stored in a GGUF file's metadata.

        Args:
          source: a GGUF path (only the metadata is read), a `gguf.GGUFReader`, or a
            mapping of metadata keys to values as `read_gguf_metadata` returns.

        Returns:
          The tokenizer.

        Raises:
          ModelLoadError: no tokenizer metadata, or a tokenizer model other than `gpt2`.
        """
        if isinstance(source, (str, os.PathLike)):
            name, meta = os.fspath(source), read_gguf_metadata(source)
        elif isinstance(source, Mapping):
            name, meta = "<gguf metadata>", source
        else:  # a gguf.GGUFReader
            name = str(getattr(getattr(source, "data", None), "filename", None) or "<gguf>")
            meta = {k: f.contents() for k, f in source.fields.items() if k.startswith("tokenizer.")}

        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(name, "no tokenizer metadata (tokenizer.ggml.tokens) in the GGUF file")
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(name, f"tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')")
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ModelLoadError(name, "byte-level BPE tokenizer without tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = [1] * len(tokens)

        pre = _pre_name(meta.get("tokenizer.ggml.pre"))
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                         merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=pre == "llama3")
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in _PRE_REGEXES[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        # Control tokens are matched in text and skipped on request; user-defined ones are
        # matched in text and always printed.
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == _USER_DEFINED])

        byte_level = decoders.ByteLevel()
        raw = {i: tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN, _USER_DEFINED)
               and byte_level.decode([tokens[i]]) != tokens[i]}

        bos = _opt_int(meta.get("tokenizer.ggml.bos_token_id"))
        eos = _opt_int(meta.get("tokenizer.ggml.eos_token_id"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _ADDS_BOS_BY_DEFAULT)) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            backend.post_processor = _bos_eos_processor(tokens, bos if add_bos else None, eos if add_eos else None)

        eog = [eos] + [_opt_int(meta.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eot", "eom")]
        eog += [i for i, t in enumerate(types) if t == _CONTROL and tokens[i] in _EOG_TEXTS]
        strings = {"unk_token": _token_at(tokens, meta.get("tokenizer.ggml.unknown_token_id")),
                   "pad_token": _token_at(tokens, meta.get("tokenizer.ggml.padding_token_id"))}
        return cls(backend, bos_token_id=bos, eos_token_ids=[i for i in eog if i is not None],
                   add_bos_token=add_bos, chat_template=meta.get("tokenizer.chat_template"),
                   special_token_strings=strings, raw_pieces=raw)

    # --- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._template_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._template_tokens.get("eos_token")

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level form, e.g. `Ġhello`), or None."""
        return self.backend.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs show it: bytes that are not (complete) UTF-8
        on their own — half of an emoji, say — come out as ``\\xNN`` escapes, not U+FFFD."""
        piece = self.id_to_token(token_id)
        if piece is not None and token_id not in self.special_ids and token_id not in self._raw_pieces \
                and isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel):
            raw = bytes(_BYTE_OF_CHAR[c] for c in piece if c in _BYTE_OF_CHAR)
            if len(raw) == len(piece):
                return raw.decode("utf-8", errors="backslashreplace")
        return self.decode([token_id])

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self.backend.token_to_id(token)

    # --- text

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token texts such as `<|im_start|>` become their ids.

        Args:
          text: the text.
          add_special_tokens: add the BOS/EOS the model's tokenizer adds to every input.

        Returns:
          The ids.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The texts of the control tokens (those ``decode`` skips as special), longest first."""
        return tuple(sorted((self.backend.id_to_token(i) for i in self.special_ids), key=len, reverse=True))

    def encode_literal(self, text: str) -> list[int]:
        """Token ids of `text` read as plain text: a control token's text (`<|im_end|>`) is
        spelled out in ordinary tokens, never taken for the control token (a chat message's
        content must not open or close turns)."""
        return self._literal_backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _literal_backend(self) -> tokenizers.Tokenizer:
        # A copy, built on first use (rarely: only text that spells a control token gets here),
        # so that the flag never changes how the shared backend encodes templates meanwhile.
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; an invalid or unfinished UTF-8 sequence shows as U+FFFD.

        Args:
          ids: token ids.
          skip_special_tokens: leave out control tokens (BOS, EOS, `<|im_end|>`, ...).

        Returns:
          The text.
        """
        ids = list(ids)
        if skip_special_tokens:  # ours, not the backend's: its idea of special includes parser tags
            ids = [i for i in ids if i not in self.special_ids]
        if self._raw_pieces.keys().isdisjoint(ids):
            return self.backend.decode(ids, skip_special_tokens=False)
        parts, start = [], 0
        for n, i in enumerate(ids):
            if i in self._raw_pieces:
                parts.append(self.backend.decode(ids[start:n], skip_special_tokens=False))
                parts.append(self._raw_pieces[i])
                start = n + 1
        parts.append(self.backend.decode(ids[start:], skip_special_tokens=False))
        return "".join(parts)

    # --- chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            **kwargs: Any) -> str:
        """Render a conversation into prompt text with the model's chat template.

        Args:
          messages: dicts with `role` and `content` (and whatever else the template reads).
          tools: JSON schemas of callable tools, or None.
          add_generation_prompt: end with the header that opens the assistant's turn.
          chat_template: a template name (of the model's named templates) or template source
            to use instead of the model's default.
          **kwargs: more template variables, e.g. `enable_thinking=False`.

        Returns:
          The prompt text.

        Raises:
          ChatTemplateError: no template, or it failed to render.
        """
        templates = self.chat_template
        if chat_template is not None and not (isinstance(templates, Mapping) and chat_template in templates):
            templates, chat_template = chat_template, None
        source = templating.select_template(templates, name=chat_template, has_tools=tools is not None)
        return templating.render(source, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                 **{**self._template_tokens, **kwargs})

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Render a conversation and encode it, special-token texts included.

        Like transformers, no BOS/EOS is added on top of the rendered text, except a BOS
        when the model adds one to every input and the template did not write it
        (what llama.cpp's server does), so a prompt never starts with two BOS.

        Args:
          messages, tools, add_generation_prompt, **kwargs: as for `apply_chat_template`.

        Returns:
          The prompt ids.
        """
        text = self.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        ids = self.encode(text)
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


# --- GGUF metadata

def read_gguf_metadata(path: str | os.PathLike, prefixes: tuple[str, ...] = ("tokenizer.", "general.")
                       ) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file, without touching its tensors.

    `gguf.GGUFReader` also indexes every tensor and wraps each string of the vocabulary
    in numpy views, which takes seconds; this walks the header once (`gguf_header`).

    Args:
      path: the GGUF file.
      prefixes: keep only keys that start with one of these.

    Returns:
      key -> value: str, int, float, bool, or a list of them.

    Raises:
      ModelLoadError: not a GGUF file, or its metadata is truncated.
    """
    from spark.engine.weights.gguf_header import read_metadata

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta, _, _, _ = read_metadata(buf)
            return {k: v for k, v in meta.items() if k.startswith(prefixes)}
    except (struct.error, ValueError, IndexError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"GGUF metadata is truncated or corrupt ({e})") from e
    except OSError as e:
        raise ModelLoadError(path, f"cannot read: {e.strerror or e}") from e


# --- helpers

def _pre_name(pre: str | None) -> str:
    name = _PRE_ALIASES.get(pre, pre)
    if name in _PRE_REGEXES:
        return name
    # llama.cpp itself falls back to its 'default' pre-tokenizer here.
    log.warning("unknown GGUF pre-tokenizer %r; using llama.cpp's 'default' pre-tokenizer", pre)
    return "default"


def _bos_eos_processor(tokens: Sequence[str], bos: int | None, eos: int | None) -> processors.TemplateProcessing:
    head = [tokens[bos]] if bos is not None else []
    tail = [tokens[eos]] if eos is not None else []
    return processors.TemplateProcessing(
        single=" ".join(head + ["$A"] + tail), pair=" ".join(head + ["$A"] + tail + head + ["$B:1"] + tail),
        special_tokens=[(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)])


def _opt_int(value: Any) -> int | None:
    return None if value is None or int(value) < 0 else int(value)


def _token_at(tokens: Sequence[str], index: Any) -> str | None:
    i = _opt_int(index)
    return tokens[i] if i is not None and i < len(tokens) else None


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as serialized AddedTokens.
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(path, f"cannot parse: {e}") from e
