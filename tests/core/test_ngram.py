"""Prompt-lookup drafts (issue 22): the index's draft is what a scan of the whole sequence finds."""

from __future__ import annotations

import random

import pytest

from spark.core.ngram import NgramIndex


def scan_draft(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The reference: for the longest suffix that occurred before, the k tokens after its latest
    earlier occurrence, by scanning every position; read from the sequence extended by the draft."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # ends before the last token: a next token exists
            if tokens[end - n:end] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[end + i])
                return extended[len(tokens):]
    return []


def test_a_repeated_span_drafts_its_old_continuation():
    index = NgramIndex([5, 6, 7, 8, 9, 1, 2, 5, 6], n_max=3, n_min=2)
    assert index.draft(3) == [7, 8, 9]
    # past the sequence's end the draft repeats itself, as the sequence would with it accepted
    assert index.draft(10) == [7, 8, 9, 1, 2, 5, 6, 7, 8, 9]
    assert NgramIndex([3, 1, 2, 1, 2]).draft(5) == [1, 2, 1, 2, 1]  # a loop goes on
    index.extend([7])
    assert index.draft(2) == [8, 9]  # the longest suffix now: (5, 6, 7)
    index.extend([4])
    assert index.draft(4) == []  # (7, 4) never occurred, and 4 alone is below n_min
    assert index.draft(0) == [] and len(index) == 11


def test_the_longest_match_wins_over_a_later_shorter_one():
    # (1, 2, 3) continued with 4 early on; (2, 3) alone continued with 9 later
    index = NgramIndex([1, 2, 3, 4, 0, 2, 3, 9, 0, 1, 2, 3], n_max=3, n_min=2)
    assert index.draft(1) == [4]
    assert NgramIndex([1, 2, 3, 4, 0, 2, 3, 9, 0, 1, 2, 3], n_max=2, n_min=2).draft(1) == [9]


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(n_max=2, n_min=3)


@pytest.mark.parametrize("seed", range(5))
def test_drafts_equal_a_full_scan_on_random_repetitive_sequences(seed):
    rng = random.Random(seed)
    n_max, n_min = rng.randint(2, 5), 1 + seed % 2
    tokens = [rng.randrange(6) for _ in range(40)]
    index = NgramIndex(tokens[:10], n_max=n_max, n_min=n_min)
    for token in tokens[10:]:
        k = rng.randint(1, 8)
        assert index.draft(k) == scan_draft(index.tokens, k, n_max, n_min)
        index.extend([token])
