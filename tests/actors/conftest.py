"""Fixtures of the actor tests: the real default model (loaded once), doubles, and a page-allocator spy."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest

from spark.actors.system import open_system


@pytest.fixture(scope="session")
def real_engine():
    """The embedded SmolLM2-135M on the CPU, loaded once for the session (several seconds).

    A 64 MiB KV cache (~1450 tokens) is plenty here and spares allocating the 1 GiB default.
    """
    from spark.engine.engine import Engine

    return Engine.load("default", device="cpu", kv_cache_bytes=64 << 20, progress=False)


class AllocatorSpy:
    """Wraps an engine (or double) and remembers the page allocator the system builds from it."""

    def __init__(self, engine):
        self._engine = engine
        self.allocator = None

    def new_page_allocator(self):
        self.allocator = self._engine.new_page_allocator()
        return self.allocator

    def __getattr__(self, name):
        return getattr(self._engine, name)


@asynccontextmanager
async def open_spied(engine, config, **kwargs):
    """``open_system`` that also yields the system's page allocator: ``(system, allocator)``."""
    spy = AllocatorSpy(engine)
    async with open_system(spy, config, **kwargs) as system:
        yield system, spy.allocator


async def collect(stream):
    """Read a whole ``RequestStream``: (text, token ids, the last piece)."""
    text, ids, last = [], [], None
    async with stream:
        async for piece in stream:
            text.append(piece.text)
            ids.extend(piece.token_ids)
            last = piece
    return "".join(text), ids, last
