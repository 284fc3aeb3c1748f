"""API keys, checked in constant time whatever their number.

The configured keys are kept as keyed digests (HMAC-SHA256 under a secret drawn at start):
a token is checked by one digest and one set lookup, so a server with 100,000 keys answers
as fast as one with two, and the lookup's timing says nothing an attacker can use (the
digests' key is secret).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets

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
