"""API keys, checked in constant time whatever their number.

The configured keys are kept as keyed digests (HMAC-SHA256 under a secret drawn at start):
a token is checked by one digest and one set lookup, so a server with 100,000 keys answers
as fast as one with two, and the lookup's timing says nothing an attacker can use (the
digests' key is secret).

Refusals (a missing or unknown key) are answered at a bounded rate across the server
(``RefusalPacer``): a flood of bad keys over kept-alive connections sends its next request only once
answered, so it then costs the event loop that rate, however many connections it opens, and the real
clients' requests are not queued behind a thousand refusals a second.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

import trio

_SECRET = secrets.token_bytes(32)


class KeyRing:
    def __init__(self, keys: tuple[str, ...]):
        self._digests = frozenset(_digest(k.encode()) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __contains__(self, token: str | bytes) -> bool:
        return _digest(token.encode() if isinstance(token, str) else token) in self._digests


def _digest(token: bytes) -> bytes:
    return hmac.new(_SECRET, token, hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def keyring(keys: tuple[str, ...]) -> KeyRing:
    """The ring of ``keys`` (built once per key set: a config's keys do not change)."""
    return KeyRing(keys)


class RefusalPacer:
    """At most ``per_s`` refusals a second across the server, after a burst of ``burst`` (GCRA).

    Each refusal is given the next free slot of a virtual schedule and waits until it; a refusal that
    finds the schedule idle answers at once. A waiting refusal is a sleeping task: cheap to hold.
    """

    def __init__(self, burst: int = 50):
        self.burst = burst
        self._next = -float("inf")  # the schedule's next free slot (trio's clock)

    async def pace(self, per_s: float) -> None:
        """Wait for this refusal's slot (at once when ``per_s`` <= 0: unpaced)."""
        if per_s <= 0:
            return
        now = trio.current_time()
        slot = max(self._next, now - (self.burst - 1) / per_s)
        self._next = slot + 1.0 / per_s
        if slot > now:
            await trio.sleep(slot - now)
