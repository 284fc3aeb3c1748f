"""Model outputs with their expected parse, over the three tool formats and the reasoning cases.

Each fixture runs through `ChatOutputParser(parser, reasoning, tools, prompt_ends_in_thinking)`.
`calls` lists `(name, arguments, unknown)`; `cut`, when set, says that the output ended inside the
last call (the token limit) and gives the JSON of its arguments as they stream.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Fixture:
    name: str
    parser: str | None
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any], bool]] = []
    reasoning: str = ""
    think: bool = False
    prompt_ends_in_thinking: bool = False
    tools: list[dict[str, Any]] | None = None
    cut: str | None = None


def _tool(name: str, **props: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    _tool("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
    _tool("run_code", code={"type": "string"}, timeout={"type": "number"}),
    _tool("search", query={"type": "string"}, filters={"type": "object"}, tags={"type": "array"},
          limit={"type": ["integer", "null"]}),
    _tool("noop"),
]

HERMES = [
    Fixture("h_plain", "hermes", "Hello! How can I help you today?", "Hello! How can I help you today?"),
    Fixture("h_single", "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
            "", [("get_weather", {"city": "Paris", "days": 3}, False)], tools=TOOLS),
    Fixture("h_two_in_a_row", "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n',
            "", [("get_weather", {"city": "Paris"}, False), ("get_weather", {"city": "Rome"}, False)]),
    Fixture("h_text_before_between_after", "hermes",
            'Let me check.\n<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>'
            ' and then <tool_call>{"name": "search", "arguments": {"query": "b"}}</tool_call>\nDone.',
            "Let me check.\n and then \nDone.",
            [("search", {"query": "a"}, False), ("search", {"query": "b"}, False)], tools=TOOLS),
    Fixture("h_close_tag_in_string", "hermes",
            '<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"</tool_call>\\")"}}\n</tool_call>',
            "", [("run_code", {"code": 'print("</tool_call>")'}, False)], tools=TOOLS),
    Fixture("h_open_and_close_tags_in_string", "hermes",
            '<tool_call>{"name": "run_code", "arguments": {"code": "<tool_call>{}</tool_call> <to"}}</tool_call>',
            "", [("run_code", {"code": "<tool_call>{}</tool_call> <to"}, False)]),
    Fixture("h_empty_arguments", "hermes", '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
            "", [("noop", {}, False)], tools=TOOLS),
    Fixture("h_no_arguments_key", "hermes", '<tool_call>{"name": "noop"}</tool_call>', "", [("noop", {}, False)]),
    Fixture("h_parameters_and_string_arguments", "hermes",
            '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [true, null]}"}</tool_call>',
            "", [("a", {"x": 1}, False), ("b", {"y": [True, None]}, False)]),
    Fixture("h_unknown_tool", "hermes",
            'Sure. <tool_call>{"name": "launch_rocket", "arguments": {"target": "moon"}}</tool_call>',
            "Sure. ", [("launch_rocket", {"target": "moon"}, True)], tools=TOOLS),
    Fixture("h_invalid_json_is_content", "hermes",
            'Try: <tool_call>{"name": "search", "arguments": {"query": "x",}}</tool_call> ok',
            'Try: <tool_call>{"name": "search", "arguments": {"query": "x",}}</tool_call> ok'),
    Fixture("h_unbalanced_braces_then_valid_call", "hermes",
            '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>\n<tool_call>{"name": "b"}</tool_call>',
            '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>\n', [("b", {}, False)]),
    # Cut off by the token limit inside a call: its markup is never content. A call whose name
    # was whole comes back incomplete, with its arguments as far as they went; one that was not, not at all.
    Fixture("h_cut_in_arguments", "hermes",
            'Calling <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
            "Calling ", [("get_weather", {}, False)], tools=TOOLS, cut='{"city": "Pa'),
    Fixture("h_cut_in_name", "hermes", 'Sure.\n<tool_call>\n{"name": "get_wea', "Sure.\n"),
    Fixture("h_cut_before_the_body", "hermes", '\n<tool_call>\n', ""),
    Fixture("h_cut_in_the_open_tag", "hermes", "Sure. <tool_ca", "Sure. "),
    Fixture("h_cut_in_the_close_tag", "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</too',
            "", [("get_weather", {"city": "Paris"}, False)]),
    Fixture("h_cut_second_call_after_its_name", "hermes",
            '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "search",',
            "", [("noop", {}, False), ("search", {}, False)], tools=TOOLS, cut=""),
    Fixture("h_cut_with_whole_arguments", "hermes", '<tool_call>{"name": "search", "arguments": {"tags": [1, 2]}',
            "", [("search", {"tags": [1, 2]}, False)], cut='{"tags": [1, 2]}'),
    Fixture("h_cut_name_after_arguments", "hermes", '<tool_call>{"arguments": {"a": 1}, "name": "no', ""),
    Fixture("h_cut_double_encoded", "hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1, \\"b',
            "", [("f", {}, False)], cut='{"a": 1, "b'),
    Fixture("h_cut_in_an_escape", "hermes", '<tool_call>{"name": "f", "arguments": {"s": "caf\\u00',
            "", [("f", {}, False)], cut='{"s": "caf\\u00'),
    Fixture("h_cut_string_ending_like_a_tag", "hermes", '<tool_call>{"name": "f", "arguments": {"s": "a </tool',
            "", [("f", {}, False)], cut='{"s": "a </tool'),
    Fixture("h_cut_not_json_is_content", "hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN',
            '<tool_call>{"name": "f", "arguments": {"x": NaN'),
    # At the end of the output an unclosed block whose body is a whole call is that call (issue 18).
    Fixture("h_unclosed_complete_call_at_end", "hermes", '<tool_call>\n{"name": "ping", "arguments": {}}',
            "", [("ping", {}, False)]),
    Fixture("h_unclosed_complete_call_after_text", "hermes",
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n\n',
            "Checking.\n", [("get_weather", {"city": "Oslo", "days": 2}, False)], tools=TOOLS),
    Fixture("h_closed_then_unclosed_call", "hermes",
            '<tool_call>{"name": "noop"}</tool_call>\n<tool_call>{"name": "search", "arguments": {"query": "}"}}',
            "", [("noop", {}, False), ("search", {"query": "}"}, False)], tools=TOOLS),
    Fixture("h_unclosed_call_then_text_is_content", "hermes", '<tool_call>{"name": "noop"} and then',
            '<tool_call>{"name": "noop"} and then'),
    Fixture("h_unclosed_not_a_call_is_content", "hermes", '<tool_call>\n{"arguments": {}}\n',
            '<tool_call>\n{"arguments": {}}\n'),
    Fixture("h_unclosed_then_new_block", "hermes",
            '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "a", "arguments": {}}\n', [("b", {}, False)]),
    Fixture("h_tag_mentioned_in_prose", "hermes",
            "Wrap calls in <tool_call> tags. <tool_call>{\"name\": \"noop\"}</tool_call>",
            "Wrap calls in <tool_call> tags. ", [("noop", {}, False)]),
    Fixture("h_not_an_object", "hermes", '<tool_call>["noop"]</tool_call>', '<tool_call>["noop"]</tool_call>'),
    Fixture("h_missing_name", "hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>',
            '<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    Fixture("h_unicode_escapes_nesting", "hermes",
            '<tool_call>{"name": "search", "arguments": {"query": '
            '"caf\\u00e9 \\"quoted\\" \\\\ back\\nline \U0001f600",'
            ' "filters": {"lang": ["fr", "en"], "deep": {"x": -1.5e3, "y": false}}}}</tool_call>',
            "", [("search", {"query": 'café "quoted" \\ back\nline \U0001f600',
                             "filters": {"lang": ["fr", "en"], "deep": {"x": -1500.0, "y": False}}}, False)]),
    Fixture("h_backslash_before_quote_end", "hermes",
            '<tool_call>{"name": "run_code", "arguments": {"code": "dir C:\\\\"}}</tool_call>',
            "", [("run_code", {"code": "dir C:\\"}, False)]),
    Fixture("h_partial_tags_in_content", "hermes", "a <to b <tx c < d <tool_call e <tool_ca",
            "a <to b <tx c < d <tool_call e "),  # the last one: a call the output ended in
    Fixture("h_whitespace_only_output", "hermes", "\n\n  ", "\n\n  "),
    Fixture("h_nan_is_not_json", "hermes", '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
            '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>'),
]

QWEN = [
    Fixture("q_single_typed", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n</function>\n</tool_call>",
            "", [("get_weather", {"city": "New York", "days": 5, "metric": False}, False)], tools=TOOLS),
    Fixture("q_two_calls_text_between", "qwen3_coder",
            "I'll run both.\n\n<tool_call>\n<function=run_code>\n<parameter=code>\nprint(1)\n</parameter>\n"
            "<parameter=timeout>\n2.5\n</parameter>\n</function>\n</tool_call>\nThen:\n<tool_call>\n<function=noop>\n"
            "</function>\n</tool_call>",
            "I'll run both.\n\n\nThen:\n",
            [("run_code", {"code": "print(1)", "timeout": 2.5}, False), ("noop", {}, False)], tools=TOOLS),
    Fixture("q_close_tags_inside_value", "qwen3_coder",
            "<tool_call>\n<function=run_code>\n<parameter=code>\nx = '</tool_call>'\ny = '</function>'\n"
            "</parameter>\n</function>\n</tool_call>",
            "", [("run_code", {"code": "x = '</tool_call>'\ny = '</function>'"}, False)], tools=TOOLS),
    Fixture("q_missing_param_close_before_param", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n</tool_call>",
            "", [("get_weather", {"city": "Oslo", "days": 2}, False)], tools=TOOLS),
    Fixture("q_missing_param_close_before_function_close", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>\nDone",
            "\nDone", [("get_weather", {"city": "Oslo"}, False)], tools=TOOLS),
    Fixture("q_missing_param_and_function_close", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</tool_call>\n<tool_call>\n<function=noop>\n"
            "</function>\n</tool_call>",
            "", [("get_weather", {"days": 4}, False), ("noop", {}, False)], tools=TOOLS),
    Fixture("q_empty_arguments", "qwen3_coder", "<tool_call>\n<function=noop>\n</function>\n</tool_call>",
            "", [("noop", {}, False)], tools=TOOLS),
    Fixture("q_unknown_tool_keeps_strings", "qwen3_coder",
            "<tool_call>\n<function=launch>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>",
            "", [("launch", {"count": "3"}, True)], tools=TOOLS),
    Fixture("q_no_tools_given", "qwen3_coder",
            "<tool_call>\n<function=launch>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>",
            "", [("launch", {"count": "3"}, False)]),
    Fixture("q_cut_after_the_open_tag", "qwen3_coder", "Let me call <tool_call>\n", "Let me call "),
    Fixture("q_cut_in_the_open_tag", "qwen3_coder", "Hi <tool_c", "Hi "),
    Fixture("q_cut_in_the_header", "qwen3_coder", "Checking.\n<tool_call>\n<function=get_wea", "Checking.\n"),
    Fixture("q_truncated_call", "qwen3_coder",
            "<tool_call>\n<function=run_code>\n<parameter=timeout>\n1\n</parameter>\n<parameter=code>\nimport os\npri",
            "", [("run_code", {"timeout": 1, "code": "import os\npri"}, False)], tools=TOOLS,
            cut='{"timeout": 1, "code": "import os\\npri"}'),
    Fixture("q_cut_in_a_parameter_header", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da",
            "", [("get_weather", {"city": "Paris"}, False)], tools=TOOLS, cut='{"city": "Paris"}'),
    Fixture("q_cut_in_a_parameter_close_tag", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param",
            "", [("get_weather", {"city": "Paris"}, False)], tools=TOOLS, cut='{"city": "Paris"}'),
    Fixture("q_cut_in_the_function_close_tag", "qwen3_coder", "<tool_call>\n<function=noop>\n</func",
            "", [("noop", {}, False)], tools=TOOLS, cut="{}"),
    Fixture("q_cut_after_a_whole_call", "qwen3_coder", "<tool_call>\n<function=noop>\n</function>\n</tool",
            "", [("noop", {}, False)], tools=TOOLS),
    Fixture("q_bad_values_stay_strings", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nyes\n"
            "</parameter>\n</function>\n</tool_call>",
            "", [("get_weather", {"days": "three", "metric": "yes"}, False)], tools=TOOLS),
    Fixture("q_object_array_null", "qwen3_coder",
            "<tool_call>\n<function=search>\n<parameter=query>\n\"quoted\" \\ path\n</parameter>\n<parameter=filters>\n"
            "{'lang': 'fr', 'safe': True}\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=limit>\nnull\n</parameter>\n</function>\n</tool_call>",
            "", [("search", {"query": '"quoted" \\ path', "filters": {"lang": "fr", "safe": True},
                             "tags": ["a", 1], "limit": None}, False)], tools=TOOLS),
    Fixture("q_json_body_is_content", "qwen3_coder", '<tool_call>\n{"name": "noop"}\n</tool_call>',
            '<tool_call>\n{"name": "noop"}\n</tool_call>'),
    Fixture("q_two_functions_one_block", "qwen3_coder",
            "<tool_call>\n<function=noop>\n</function>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
            "</function>\n</tool_call>",
            "", [("noop", {}, False), ("get_weather", {"city": "Lima"}, False)], tools=TOOLS),
    Fixture("q_strips_one_newline_only", "qwen3_coder",
            "<tool_call>\n<function=run_code>\n<parameter=code>\n\n  indented\n\n</parameter>\n"
            "</function>\n</tool_call>",
            "", [("run_code", {"code": "\n  indented\n"}, False)], tools=TOOLS),
    Fixture("q_duplicate_parameter_first_wins", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n"
            "<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>",
            "", [("get_weather", {"city": "A"}, False)], tools=TOOLS),
    Fixture("q_stray_text_in_call", "qwen3_coder",
            "<tool_call>\n<function=get_weather>\nhmm, <b>Paris</b>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>",
            "hmm, <b>Paris</b>\n", [("get_weather", {"city": "Paris"}, False)], tools=TOOLS),
    Fixture("q_malformed_header_is_content", "qwen3_coder",
            "<tool_call>\n<function=get\nweather>\n</tool_call>", "<tool_call>\n<function=get\nweather>\n</tool_call>"),
    Fixture("q_quoted_name_no_newlines", "qwen3_coder",
            '<tool_call><function="get_weather"><parameter=city>Kyiv</parameter></function></tool_call>',
            "", [("get_weather", {"city": "Kyiv"}, False)], tools=TOOLS),
]

MINIMAX = [
    Fixture("m_single", "minimax",
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
            "", [("get_weather", {"city": "Paris", "days": 3}, False)], tools=TOOLS),
    Fixture("m_two_invokes_text_before", "minimax",
            'Checking two cities.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
            '</parameter>\n</invoke>\n<invoke name="search">\n<parameter name="tags">["x", {"y": 2}]</parameter>\n'
            '</invoke>\n</minimax:tool_call>',
            "Checking two cities.\n",
            [("get_weather", {"city": "Paris"}, False), ("search", {"tags": ["x", {"y": 2}]}, False)], tools=TOOLS),
    Fixture("m_close_tags_inside_value", "minimax",
            '<minimax:tool_call>\n<invoke name="run_code">\n<parameter name="code">s = "</invoke></minimax:tool_call>"'
            '</parameter>\n</invoke>\n</minimax:tool_call>',
            "", [("run_code", {"code": 's = "</invoke></minimax:tool_call>"'}, False)], tools=TOOLS),
    Fixture("m_missing_param_close", "minimax",
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="metric">true\n</invoke>\n'
            '</minimax:tool_call>',
            "", [("get_weather", {"metric": True}, False)], tools=TOOLS),
    Fixture("m_cut_after_the_open_tag", "minimax", "ok <minimax:tool_call>", "ok "),
    Fixture("m_cut_in_the_invoke_name", "minimax", '<minimax:tool_call>\n<invoke name="get_wea', ""),
    Fixture("m_cut_in_a_value", "minimax",
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par',
            "", [("get_weather", {"city": "Par"}, False)], tools=TOOLS, cut='{"city": "Par"}'),
    Fixture("m_cut_in_a_parameter_close_tag", "minimax",
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">3</param',
            "", [("get_weather", {"days": 3}, False)], tools=TOOLS, cut='{"days": 3}'),
    Fixture("m_hermes_tags_are_text", "minimax", '<tool_call>{"name": "noop"}</tool_call>',
            '<tool_call>{"name": "noop"}</tool_call>'),
    Fixture("m_unknown_empty", "minimax",
            '<minimax:tool_call><invoke name="mystery"></invoke></minimax:tool_call>\n\nAnything else?',
            "\n\nAnything else?", [("mystery", {}, True)], tools=TOOLS),
]

REASONING = [
    Fixture("r_think_then_answer", None, "<think>\nThe user greets me.\n</think>\n\nHello!", "Hello!",
            reasoning="\nThe user greets me.\n", think=True),
    Fixture("r_empty_block_is_noop", None, "<think>\n\n</think>\n\nHello!", "Hello!", think=True),
    Fixture("r_prompt_ends_in_thinking", None, "Okay, 2+2=4.\n</think>\n\n4", "4", reasoning="Okay, 2+2=4.\n",
            think=True, prompt_ends_in_thinking=True),
    # The template opened the block and the model writes its own <think> anyway (issue 18):
    # the tag is dropped, so the parse is the one of the same text without the template's tag.
    Fixture("r_forced_and_model_reopens", None, "<think>\nplan\n</think>\n\nAnswer", "Answer",
            reasoning="\nplan\n", think=True, prompt_ends_in_thinking=True),
    Fixture("r_forced_reopens_after_whitespace", None, "\n <think>plan</think>Answer", "Answer", reasoning="plan",
            think=True, prompt_ends_in_thinking=True),
    Fixture("r_forced_reopened_empty_block", None, "<think>\n\n</think>\n\nAnswer", "Answer", think=True,
            prompt_ends_in_thinking=True),
    Fixture("r_forced_second_open_is_text", None, "<think><think>x</think>y", "y", reasoning="<think>x",
            think=True, prompt_ends_in_thinking=True),
    Fixture("r_forced_later_open_is_text", None, "plan <think> more</think>y", "y", reasoning="plan <think> more",
            think=True, prompt_ends_in_thinking=True),
    Fixture("r_forced_reopen_then_unclosed_hermes_call", "hermes",
            '<think>\nuse ping\n</think>\n\n<tool_call>\n{"name": "ping", "arguments": {}}',
            "", [("ping", {}, False)], reasoning="\nuse ping\n", think=True, prompt_ends_in_thinking=True),
    Fixture("r_prompt_forced_empty", None, "\n\n</think>\n\n4", "4", think=True, prompt_ends_in_thinking=True),
    Fixture("r_several_blocks", None, "<think>a</think>Part one. <think>b</think>Part two.", "Part one. Part two.",
            reasoning="ab", think=True),
    Fixture("r_unclosed_at_end", None, "Hi <think>\nstill thinking <think> about </thin", "Hi ",
            reasoning="\nstill thinking <think> about ", think=True),  # the tag the output ended in: dropped
    Fixture("r_cut_in_the_open_tag", None, "Hi <thin", "Hi ", think=True),
    # The tool parser reads the answer as the reasoning parser leaves it: "<to" ends it, as a cut call tag.
    Fixture("r_cut_tags_of_both_parsers", "hermes", "<think>a</think>\n\n<to<", "", reasoning="a", think=True),
    Fixture("r_cut_in_the_close_tag_of_an_empty_block", None, "<think>\n\n</thi", "", think=True),
    Fixture("r_partial_tags", None, "a <thi b <th\n<think>x </thinker y</think> c", "a <thi b <th\nc",
            reasoning="x </thinker y", think=True),
    Fixture("r_tool_call_inside_think_is_not_a_call", "hermes",
            '<think>\nI could write <tool_call>{"name": "noop"}</tool_call> but\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>',
            "", [("get_weather", {"city": "Bern"}, False)],
            reasoning='\nI could write <tool_call>{"name": "noop"}</tool_call> but\n', think=True, tools=TOOLS),
    Fixture("r_qwen3_coder_after_forced_think", "qwen3_coder",
            "Need weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n"
            "</parameter>\n</function>\n</tool_call>",
            "Checking.\n", [("get_weather", {"city": "Bern"}, False)], reasoning="Need weather.\n", think=True,
            prompt_ends_in_thinking=True, tools=TOOLS),
    Fixture("r_minimax_with_think", "minimax",
            '<think>\nuse the tool\n</think>\n<minimax:tool_call>\n<invoke name="noop">\n</invoke>\n'
            '</minimax:tool_call>',
            "", [("noop", {}, False)], reasoning="\nuse the tool\n", think=True, tools=TOOLS),
    Fixture("r_no_reasoning_parser_keeps_think_text", "hermes", "<think>x</think> y", "<think>x</think> y"),
    # Reasoning cut off by the token limit stays reasoning, a call begun in it too.
    Fixture("r_cut_in_think", "hermes", '<think>\nI will call <tool_call>{"name": "get_we', "",
            reasoning='\nI will call <tool_call>{"name": "get_we', think=True, tools=TOOLS),
    Fixture("r_cut_in_a_call_after_think", "qwen3_coder",
            "<think>\nweather\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBe",
            "", [("get_weather", {"city": "Be"}, False)], reasoning="\nweather\n", think=True, tools=TOOLS,
            cut='{"city": "Be"}'),
    Fixture("r_unclosed_think_swallows_tool_call", "hermes", '<think>maybe <tool_call>{"name": "noop"}</tool_call>',
            "", reasoning='maybe <tool_call>{"name": "noop"}</tool_call>', think=True),
]

FIXTURES = HERMES + QWEN + MINIMAX + REASONING
