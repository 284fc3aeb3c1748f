"""Grammars for constrained decoding, by xgrammar: compiled against the served tokenizer, cached by spec.

``XGrammars`` is the ``spark.core.grammar.Grammars`` the core uses: a ``GrammarSpec`` compiles once
(xgrammar's compiler caches too) and each request gets its own ``GrammarMatcher``, whose bitmask
(int32 words, token i at bit i % 32 of word i // 32) goes to the engine as is: ``masks`` fills a
step's rows into one int32 array and hands out its rows (no bytes per row). ``check`` compiles
a spec without a tokenizer, so that the HTTP layer refuses a bad one with a 400 before it queues.
xgrammar is imported at first use: a server that never constrains never pays its import.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Sequence

import numpy as np

from spark.core.grammar import GrammarSpec
from spark.engine.grammar_chains import chain_bounded_repeats


# Blanks in a row a JSON answer may hold: enough to indent, too few for a small model to spin on
# newlines until its max_tokens (the one way a grammar-valid prefix would still not parse).
JSON_MAX_WHITESPACE = 6


def _xgr():
    import xgrammar

    return xgrammar


def check(spec: GrammarSpec) -> None:
    """Raise ValueError (naming the problem) when xgrammar cannot build ``spec``."""
    xgr = _xgr()
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.source, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.source)
        else:
            raise ValueError(f"unknown grammar kind {spec.kind!r}")
    except Exception as exc:  # xgrammar raises its own errors (InvalidJSONError, RuntimeError, ...)
        raise ValueError(_message(exc)) from None


def _message(exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


class XMatcher:
    def __init__(self, compiled, vocab_size: int, stop_mask: bytes):
        xgr = _xgr()
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._stop_mask = stop_mask

    def mask(self) -> bytes:
        if self._matcher.is_terminated():  # (a request that ignores EOS): only the stop tokens, again
            return self._stop_mask
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask.numpy().tobytes()

    def accept(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return True  # past the end (the stop token was taken): nothing is left to check
        return self._matcher.accept_token(token_id)


class XGrammars:
    """xgrammar over ``tokenizer`` (``spark.engine.tokenizer.Tokenizer``) for a model of ``vocab_size`` logits.

    ``fill_threads``: xgrammar's threads for a batch of masks. One by default: on the H200's 16-core
    host, xgrammar's own default (half the cores) took 0.39 ms for one row's mask that one thread
    fills in 0.01 ms, and 64 rows of forced calls decoded no faster with 4 threads than with 1 (the
    step waits for its slowest row, which one thread fills as fast as many).
    ``chain_repeats``: structural tags compile with their bounded repeats as chains of rules
    (``spark.engine.grammar_chains``: the same masks, filled in microseconds rather than milliseconds
    inside an XML-style string parameter with a ``maxLength``); False compiles them as xgrammar
    writes them (for A/B measurements).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] = (), fill_threads: int | str = 1,
                 chain_repeats: bool = True):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._fill_threads = fill_threads
        self._chain_repeats = chain_repeats
        self._stop = list(stop_token_ids) or list(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = None  # xgrammar's BatchGrammarMatcher, at first use
        allowed = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)  # as long as xgrammar's int32 words
        allowed[self._stop] = True
        self._stop_words = np.packbits(allowed, bitorder="little").view(np.int32)
        self._stop_mask = self._stop_words.tobytes()

    def _compiler_now(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                from transformers import PreTrainedTokenizerFast

                backend = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
                info = xgr.TokenizerInfo.from_huggingface(backend, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    @functools.lru_cache(maxsize=256)
    def compiled(self, spec: GrammarSpec):
        compiler = self._compiler_now()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.source or "{}", max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if spec.kind == "structural_tag":
                if self._chain_repeats:
                    text = str(_xgr().Grammar.from_structural_tag(spec.source))
                    chained = chain_bounded_repeats(text)
                    if chained != text:
                        return compiler.compile_grammar(chained)
                return compiler.compile_structural_tag(spec.source)
        except Exception as exc:
            raise ValueError(f"cannot compile the grammar: {_message(exc)}") from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def matcher(self, spec: GrammarSpec) -> XMatcher:
        return XMatcher(self.compiled(spec), self.vocab_size, self._stop_mask)

    def accept(self, matchers: list[XMatcher], token_ids: list[int]) -> list[bool]:
        """The matchers' ``accept`` in one call into xgrammar (a step's rows: one Python crossing, not 64)."""
        live = [row for row, m in enumerate(matchers) if not m._matcher.is_terminated()]
        out = [True] * len(matchers)  # a finished grammar checks nothing (XMatcher.accept)
        if live:
            accepted = _xgr().BatchGrammarMatcher.batch_accept_token(
                [matchers[row]._matcher for row in live], [token_ids[row] for row in live])
            for row, ok in zip(live, accepted):
                out[row] = ok
        return out

    def masks(self, matchers: list[XMatcher]) -> list[np.ndarray]:
        """The matchers' masks in one call (xgrammar's batch fill, on ``fill_threads`` threads): the rows
        of one int32 array, each row at its matcher's position (a finished grammar's: the stop tokens).
        The array is new on each call, so that the rows stay valid while the engine reads them."""
        words = np.empty((len(matchers), len(self._stop_words)), dtype=np.int32)
        live, done = [], []
        for row, m in enumerate(matchers):
            (done if m._matcher.is_terminated() else live).append(row)
        if done:
            words[done] = self._stop_words
        if live:
            with self._lock:
                if self._batch is None:
                    self._batch = _xgr().BatchGrammarMatcher(self._fill_threads)
                self._batch.batch_fill_next_token_bitmask([matchers[row]._matcher for row in live], words, live)
        return list(words)
