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

    # Dense float32 weights: the int4 matmuls of the CPU's default are not batch-invariant (a prompt alone
    # and in a batch may sample differently), and these tests compare outputs across batchings.
    return Engine.load("default", device="cpu", kv_cache_bytes=64 << 20, progress=False, weight_format="dense")


@asynccontextmanager
async def open_spied(engine, config):
    """``open_system`` that also yields the page allocator its core builds: ``(system, allocator)``."""
    built = []
    make = engine.new_page_allocator

    def spy():
        built.append(make())
        return built[-1]

    engine.new_page_allocator = spy  # on this instance only, until the block ends
    try:
        async with open_system(engine, config) as system:
            yield system, built[-1]
    finally:
        del engine.new_page_allocator


async def collect(stream):
    """Read a whole ``RequestStream``: (text, token ids, the last piece)."""
    text, ids, last = [], [], None
    async with stream:
        async for piece in stream:
            text.append(piece.text)
            ids.extend(piece.token_ids)
            last = piece
    return "".join(text), ids, last
