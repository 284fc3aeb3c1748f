"""API keys are checked by one keyed digest and a set lookup: as fast with 100,000 keys as with two (issue 27.12)."""

from __future__ import annotations

from spark.http.keys import KeyRing


def test_a_ring_knows_its_keys_and_nothing_else():
    ring = KeyRing(("sk-a", "sk-b"))
    assert "sk-a" in ring and b"sk-b" in ring
    assert "sk-c" not in ring and "sk-a " not in ring and "" not in ring
    assert not KeyRing(()) and ring


def test_a_lookup_is_one_digest_whatever_the_number_of_keys(monkeypatch):
    from spark.http import keys

    many = KeyRing(tuple(f"k{i}" for i in range(100_000)))
    calls = []
    real = keys._digest
    monkeypatch.setattr(keys, "_digest", lambda token: calls.append(token) or real(token))
    assert "k99999" in many and "nope" not in many
    assert calls == [b"k99999", b"nope"]  # no walk over the keys
