"""Anthropic cache_control breakpoints found in the rendered prompt (``spark.http.breakpoints``)."""

from __future__ import annotations

import pytest

from spark.http import breakpoints
from spark.http.anthropic import Block, CacheControl, Message, MessagesRequest, Tool, turn_kwargs
from spark.http.chat_prompt import ChatFormat
from spark.http.errors import ApiError
from spark.http.turn import prepare_turn
from spark.engine.tokenizer import Tokenizer

TOK = Tokenizer.synthetic(100)  # token i is the word t<i>; the template joins "role: content" lines


def _request(**kw) -> MessagesRequest:
    system = [Block("text", text="t1 t2 t3", cache_control=CacheControl()), Block("text", text="t4")]
    messages = [Message("user", [Block("text", text="t5 t6", cache_control=CacheControl(ttl="1h"))]),
                Message("assistant", "t7"), Message("user", "t8 t9")]
    return MessagesRequest(max_tokens=4, system=system, messages=messages, **kw)


def _render(req):
    return prepare_turn(TOK, ChatFormat(None, False), **turn_kwargs(req)).prompt


def test_each_breakpoint_pins_the_prompt_up_to_its_block_with_its_ttl():
    req = _request()
    marked, ttls = breakpoints.mark(req)
    assert ttls == [300.0, 3600.0]
    prompt, again = _render(req), _render(marked)
    pins, last = breakpoints.pins(TOK, prompt.prompt_ids, prompt.text, again.text, ttls)
    # "system: t1 t2 t3 | t4 \n user: t5 t6 | ..." (the role words are one unknown token each)
    assert [(p.tokens, p.ttl_s) for p in pins] == [(4, 300.0), (8, 3600.0)] and last == 8
    assert prompt.prompt_ids[1:4] == (1, 2, 3) and prompt.prompt_ids[6:8] == (5, 6)
    same, _ = breakpoints.pins(TOK, prompt.prompt_ids, prompt.text, again.text, ttls)
    assert [p.key for p in same] == [p.key for p in pins]  # one prefix, one key: a later request refreshes it


def test_a_template_that_changes_the_text_pins_nothing():
    prompt = _render(_request())
    assert breakpoints.pins(TOK, prompt.prompt_ids, prompt.text, prompt.text + " t1", [300.0]) == ((), 0)


@pytest.mark.parametrize("control, match", [(CacheControl(type="persistent"), "type must be ephemeral"),
                                            (CacheControl(ttl="2h"), "ttl must be 5m or 1h")])
def test_a_bad_cache_control_is_a_400_naming_it(control, match):
    req = MessagesRequest(max_tokens=4, messages=[Message("user", "t1")],
                          tools=[Tool("look", {"type": "object"}, cache_control=control)])
    with pytest.raises(ApiError, match=match) as refused:
        breakpoints.mark(req)
    assert refused.value.status == 400 and refused.value.param.startswith("tools[0].cache_control")
