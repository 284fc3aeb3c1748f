"""A JSON object cut off before its end, as when the token limit stops a model inside a tool call.

`cut_object_members(text)` tells such a beginning of an object from text that no JSON object
starts with (or an object that ended), and gives the text of each top-level member's value as
far as it went: enough to see whether a cut hermes call had written its whole name, and to keep
its arguments up to the cut.
"""

from __future__ import annotations

import json
import re

_SPACE = re.compile(r"\s*")
_STRING_BODY = r'"(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'  # raw control characters taken, as load_json does
_TOKEN = re.compile(_STRING_BODY + r'"|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null|[{}\[\]:,]')
# What a token can be when the text ends inside it: a string without its closing quote (perhaps in
# an escape), the start of a number (a whole one too: more digits could have followed), a literal's start.
_CUT_TOKEN = re.compile(_STRING_BODY + r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?"
                        r"|-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:(?<=[0-9])[eE][+-]?[0-9]*)?)?"
                        r"|t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:ul?)?")

# What may come next.
_VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON, _NEXT = range(6)
_VALUES, _KEYS = (_VALUE, _VALUE_OR_END), (_KEY, _KEY_OR_END)
_OPENS = {"{": _KEY_OR_END, "[": _VALUE_OR_END}
_CLOSES = {"{": ("}", _KEY_OR_END), "[": ("]", _VALUE_OR_END)}  # the closer, and the state it may also end
_PUNCTUATION = frozenset("{}[]:,")


def cut_object_members(text: str) -> dict[str, str] | None:
    """Read `text` as the beginning of a JSON object that has not ended.

    Args:
      text: what was written of the object (leading whitespace allowed).

    Returns:
      ``{key: value text}`` for the object's top-level members whose key was whole and whose
      value had begun: a complete value's own text, the last one's up to the end of `text`
      (trailing whitespace removed). None when `text` does not begin an object, goes on past
      its end, or breaks JSON's grammar (then it was not a call cut short).
    """
    stack: list[str] = []  # the open containers, "{" or "["
    expect = _VALUE
    members: dict[str, str] = {}
    key, start = "", 0  # the top-level member being read, and where its value starts
    pos = 0
    while True:
        pos = _SPACE.match(text, pos).end()
        in_value = expect in _VALUES
        if pos == len(text) or (stack and (in_value or expect in _KEYS and text[pos] == '"')
                                and _CUT_TOKEN.fullmatch(text, pos)):
            if len(stack) > 1 or len(stack) == 1 and in_value and pos < len(text):
                members[key] = text[start if len(stack) > 1 else pos:].rstrip()
            return members
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        token, pos = m.group(), m.end()
        if not stack:  # the first token must open the object
            if token != "{":
                return None
            stack.append(token)
            expect = _KEY_OR_END
            continue
        if in_value and len(stack) == 1:
            start = m.start()
        closer, also = _CLOSES[stack[-1]]
        if in_value and token in _OPENS:
            stack.append(token)
            expect = _OPENS[token]
        elif expect in _KEYS and token[0] == '"':
            if len(stack) == 1:
                key = json.loads(token, strict=False)
            expect = _COLON
        elif expect == _COLON and token == ":":
            expect = _VALUE
        elif expect == _NEXT and token == ",":
            expect = _KEY if stack[-1] == "{" else _VALUE
        elif token == closer and expect in (_NEXT, also):
            stack.pop()
            if not stack:
                return None  # the object ended: it was not cut
            if len(stack) == 1:
                members[key] = text[start:pos]
            expect = _NEXT
        elif in_value and token not in _PUNCTUATION:  # a string, number or literal
            if len(stack) == 1:
                members[key] = text[start:pos]
            expect = _NEXT
        else:
            return None
