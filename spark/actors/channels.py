"""Taking what a channel holds in one turn of the event loop.

Every ``await`` of a trio channel is a checkpoint, and a checkpoint waits for every
other runnable task: with hundreds of streams that is milliseconds. An actor that
wakes for one message therefore takes whatever else is already waiting at once.
"""

from __future__ import annotations

import trio


def take_waiting(channel: trio.MemoryReceiveChannel, batch: list, limit: int | None = None) -> list:
    """Append to ``batch`` what ``channel`` holds now, without a checkpoint, until ``batch``
    has ``limit`` items (no limit by default). Returns ``batch``."""
    while limit is None or len(batch) < limit:
        try:
            batch.append(channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    return batch
