"""Bounded repeats rewritten as chains of rules, so that xgrammar fills their masks fast (issue 21).

xgrammar (0.2.9) writes an XML-style tool parameter (qwen3_coder, minimax) that is a string with a
``maxLength`` as a rule of its own, ``P ::= X{m, n}``, followed by the closing tag in the rule that
uses it: ``... P W "</parameter>" ...`` (W: the blank allowed before the tag). Its compile-time
token cache cannot settle a token that runs past the end of such a repeat (the token might go on
into the closing tag), so every token longer than the characters still allowed is checked at run
time: 5 to 18 ms a row on the CPUs measured, for each step inside the string (a JSON string, whose
closing quote sits in the same rule as its repeat, fills in 0.01 ms).

The same language as a right-linear chain that carries the closing tag in each of its rules,

    C_i ::= (X C_{i+1}) | (W "</parameter>")     m <= i < n   (below m: only the first alternative)
    C_n ::= (W "</parameter>")

fills in microseconds: every token now ends inside the chain. ``chain_bounded_repeats`` makes that
rewrite on the grammar's EBNF text (xgrammar's printer, which its parser reads back), for each use of
a repeat followed by at most one rule and then a string literal; other uses keep the repeat. The
masks stay the same bit for bit (tests/engine/test_grammar_chains.py walks both and compares).
"""

from __future__ import annotations

import re

# A repeat longer than this stays as it is: its chain would be a rule per character, and xgrammar
# checks at run time only the tokens longer than what is left of it, which near the start are few.
MAX_CHAIN = 256

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_CLASS = r"\[(?:[^\]\\]|\\.)*\]"
_LITERAL = r'"(?:[^"\\]|\\.)*"'
# "P ::= ((X{m, n}))": a whole rule that is one bounded repeat of a rule or a character class
_REPEAT = re.compile(rf"^({_NAME}) ::= \(\(({_NAME}|{_CLASS})\{{(\d+), (\d+)\}}\)\)$")


def chain_bounded_repeats(ebnf: str, max_chain: int = MAX_CHAIN) -> str:
    """``ebnf`` (xgrammar's printed grammar) with each ``P W "lit"`` / ``P "lit"`` of a bounded repeat
    ``P ::= ((X{m, n}))`` (n <= ``max_chain``) replaced by a chain of rules of the same language; the
    text unchanged when there is none."""
    lines = ebnf.splitlines()
    repeats = {}
    for line in lines:
        if (match := _REPEAT.match(line)) and int(match[4]) <= max_chain and int(match[3]) <= int(match[4]):
            repeats[match[1]] = (match[2], int(match[3]), int(match[4]))
    if not repeats:
        return ebnf
    taken = {line.split(" ::= ", 1)[0] for line in lines if " ::= " in line}
    use = re.compile(rf"(?<![A-Za-z0-9_])({'|'.join(map(re.escape, repeats))}) ((?:{_NAME} )?{_LITERAL})(?=[ )])")
    chains: list[str] = []

    def chained(match: re.Match) -> str:
        repeated, low, high = repeats[match[1]]
        k = 0
        while f"{match[1]}_chain{k}_0" in taken:
            k += 1
        names = [f"{match[1]}_chain{k}_{i}" for i in range(high + 1)]
        taken.update(names)
        end = f"({match[2]})"
        for i, name in enumerate(names):
            alternatives = ([f"({repeated} {names[i + 1]})"] if i < high else []) + ([end] if i >= low else [])
            chains.append(f"{name} ::= " + " | ".join(alternatives))
        return names[0]

    out = [line if " ::= " not in line else
           line.split(" ::= ", 1)[0] + " ::= " + use.sub(chained, line.split(" ::= ", 1)[1]) for line in lines]
    if not chains:
        return ebnf
    return "\n".join(out + chains) + ("\n" if ebnf.endswith("\n") else "")
