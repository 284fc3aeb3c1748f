"""Which output text the tokens of each piece wrote (``OutputTokens``, through ``OutputBuilder`` as the
Responses route feeds it): pure, no server."""

from __future__ import annotations

from spark.actors.messages import TokenLogprob
from spark.http.output_tokens import OutputTokens
from spark.http.response_items import OutputBuilder
from spark.http.turn import ContentDelta, ReasoningDelta, ToolCallDelta


def _tokens(*texts: str) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(n, text, -0.5) for n, text in enumerate(texts))


def _build(steps) -> tuple[list[dict], list[dict]]:
    """Feed ``(tokens, events)`` steps as the Responses route does; returns the output and the text deltas."""
    builder, deltas = OutputBuilder(), []
    for tokens, events in steps:
        builder.add_tokens(_tokens(*tokens))
        for event in events:
            deltas += [e for e in builder.feed(event) if e["type"] == "response.output_text.delta"]
    builder.close()
    return builder.output, deltas


def _joined(logprobs: list[dict]) -> str:
    return "".join(lp["token"] for lp in logprobs)


def test_reasoning_tokens_are_not_the_message_texts():
    output, deltas = _build([(["<think>"], []), (["Short"], [ReasoningDelta("Short")]),
                             (["</think>"], []), (["Seven"], [ContentDelta("Seven")]), (["."], [ContentDelta(".")])])
    reasoning, message = output
    assert reasoning["type"] == "reasoning"
    part = message["content"][0]
    assert _joined(part["logprobs"]) == part["text"] == "Seven."
    assert [_joined(d["logprobs"]) for d in deltas] == ["Seven", "."]


def test_a_merged_piece_is_split_between_reasoning_and_message():
    # pieces merge when the reader falls behind: one piece, then, writes both
    tokens = ["<think>", "Short", "</think>", "\n\n", "Seven", "."]
    (reasoning, message), _ = _build([(tokens, [ReasoningDelta("Short"), ContentDelta("Seven.")])])
    part = message["content"][0]
    assert _joined(part["logprobs"]) == part["text"] == "Seven."


def test_held_text_keeps_its_tokens_until_it_is_shown():
    # the whitespace before a message waits for its first visible character, and its tokens with it
    output, deltas = _build([(["\n"], [ContentDelta("\n")]), (["Hi"], [ContentDelta("Hi")]),
                             ([" th"], []), (["ere"], [ContentDelta(" there")])])
    part = output[0]["content"][0]
    assert _joined(part["logprobs"]) == part["text"] == "\nHi there"
    assert [(d["delta"], _joined(d["logprobs"])) for d in deltas] == [("\nHi", "\nHi"), (" there", " there")]


def test_a_calls_tokens_are_dropped():
    call = ToolCallDelta(0, "call_1", "get_weather", "")
    output, _ = _build([(["Let me look."], [ContentDelta("Let me look.")]), (["\n"], [ContentDelta("\n")]),
                        (["<tool_call>", '{"name"'], [call]), (["}"], [ToolCallDelta(0, None, None, "{}")])])
    message, function_call = output
    assert _joined(message["content"][0]["logprobs"]) == "Let me look.\n"
    assert function_call["type"] == "function_call" and "logprobs" not in function_call


def test_a_token_across_two_texts_goes_with_the_first():
    tokens = OutputTokens()
    tokens.add(_tokens("<think>", "Hi th", "ere"))
    assert [e["token"] for e in tokens.take("Hi")] == ["Hi th"]  # " th" waits: it may start a tag
    assert [e["token"] for e in tokens.take(" there")] == ["ere"]


def test_text_inside_markup_is_not_taken_for_the_answer():
    tokens = OutputTokens()
    tokens.add(_tokens("</", "tool", "_call", ">", "a"))
    assert [e["token"] for e in tokens.take("a")] == ["a"]  # not the "a" of "_call"


def test_tokens_that_do_not_join_into_the_text_are_all_taken():
    tokens = OutputTokens()
    tokens.add(_tokens("▁Hello", "▁world"))  # a tokenizer whose pieces are not their text
    assert [e["token"] for e in tokens.take("Hello world")] == ["▁Hello", "▁world"]
    assert tokens.take("!") == []


def test_events_already_made_keep_the_logprobs_they_had():
    # the part grows in place as deltas come; its added event (written out later, in the piece's one
    # write) still shows it as it was, empty
    builder = OutputBuilder()
    events = []
    for text in ("Hi", " there"):
        builder.add_tokens(_tokens(text))
        events += builder.feed(ContentDelta(text))
    added = next(e for e in events if e["type"] == "response.content_part.added")
    assert added["part"]["logprobs"] == [] and added["part"]["text"] == ""
    builder.close()
    assert _joined(builder.output[0]["content"][0]["logprobs"]) == "Hi there"
