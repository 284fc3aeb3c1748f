"""Citation extraction: the links an answer cites, with where they stand in its text.

Two forms are read: markdown links ``[title](https://...)`` (the span is the whole link) and bare
``http(s)://`` URLs (the span is the URL, without a sentence's closing punctuation). Indices are
Python string indices into the text. The APIs turn a ``Citation`` into their own shapes: OpenAI's
``url_citation`` annotations, Anthropic's text-block ``citations``.
"""

from __future__ import annotations

import re

import attrs

_LINK = re.compile(r"\[([^\]\n]{1,300})\]\((https?://[^\s()<>]+(?:\([^\s()<>]*\))?[^\s()<>]*)\)")
_URL = re.compile(r"https?://[^\s<>()\[\]{}\"'`]+")
_TRAILING = ".,;:!?*_~"


@attrs.frozen
class Citation:
    start: int  # the cited span: text[start:end]
    end: int
    url: str
    title: str  # the link's text; a bare URL's own


def extract_citations(text: str) -> tuple[Citation, ...]:
    """The citations in ``text``, in order."""
    found, taken = [], []
    for m in _LINK.finditer(text):
        found.append(Citation(m.start(), m.end(), m[2], m[1].strip()))
        taken.append((m.start(), m.end()))
    for m in _URL.finditer(text):
        url = m[0].rstrip(_TRAILING)
        if len(url) > url.index("://") + 3 and not any(a <= m.start() < b for a, b in taken):  # a host, outside links
            found.append(Citation(m.start(), m.start() + len(url), url, url))
    return tuple(sorted(found, key=lambda c: c.start))
