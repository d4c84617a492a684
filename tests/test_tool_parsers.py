"""Tool calling's pure-Python parts: the output parsers (whole and streamed), the checks
of ``tools`` / ``tool_choice`` and the schemas that force a choice. Exact values
throughout; no model, no server (the served path: tests/serving/
test_structured_outputs_serving.py)."""

from __future__ import annotations

import json

import pytest

from tandem.router.tool_calling import (ToolRequestError, plan_tools, required_schema,
                                        template_message)
from tandem.router.tool_parsers import (TOOL_PARSERS, HermesToolParser, JsonArrayToolParser,
                                        Llama3JsonToolParser, NamedToolParser, ToolCallStream,
                                        extract_tool_calls, get_tool_parser)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"note": "a \\"}\\" inside"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
          '"arguments": {}}\n</tool_call>')


def _calls(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def _stream(parser, text: str, step: int, max_calls=None):
    """Feed ``text`` in ``step``-character deltas: (content, [(id, name, arguments)],
    the deltas)."""
    s = ToolCallStream(parser, max_calls)
    outs = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.finish()]
    content = "".join(c for c, _ in outs)
    calls: dict[int, list] = {}
    deltas = [d for _, ds in outs for d in ds]
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function"
            calls[d["index"]] = [d["id"], d["function"]["name"], d["function"]["arguments"]]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][2] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas, s


def test_hermes_whole_output():
    content, calls = extract_tool_calls(HermesToolParser(), HERMES)
    assert content == "Let me look.\n"
    assert _calls(calls) == [("get_weather", '{"city": "Paris", "note": "a \\"}\\" inside"}'),
                             ("get_time", "{}")]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": calls[0].arguments}}
    # Only the calls: content None. An unclosed last block counts once its object closed.
    assert extract_tool_calls(HermesToolParser(),
                              '<tool_call>{"name": "f", "arguments": {"a": 1}}')[0] is None
    assert _calls(extract_tool_calls(HermesToolParser(), '<tool_call>{"name": "f", '
                                                         '"arguments": {"a": 1}}')[1]) == \
        [("f", '{"a": 1}')]
    assert _calls(extract_tool_calls(HermesToolParser(), HERMES, max_calls=1)[1]) == \
        [("get_weather", '{"city": "Paris", "note": "a \\"}\\" inside"}')]


@pytest.mark.parametrize("text", [
    "Just an answer.",
    "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": ",           # cut off
    "<tool_call>{\"arguments\": {}}</tool_call>",                     # no name
    "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",   # not an object
    "<tool_call>not json</tool_call>",
    "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
])
def test_hermes_without_a_valid_call_is_all_content(text):
    assert extract_tool_calls(HermesToolParser(), text) == (text, [])
    for step in (1, 4, len(text)):
        content, calls, _, s = _stream(HermesToolParser(), text, step)
        if not s.called:
            assert content == text and calls == []


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_stream_matches_whole_output(step):
    content, calls, deltas, s = _stream(HermesToolParser(), HERMES, step)
    whole_content, whole = extract_tool_calls(HermesToolParser(), HERMES)
    assert content == whole_content
    assert [(n, a) for _, n, a in calls] == _calls(whole)
    assert s.called and len({i for i, _, _ in calls}) == 2
    # The first delta of each call names it before any argument fragment.
    assert deltas[0]["function"]["name"] == "get_weather"


def test_stream_holds_back_a_possible_marker_only():
    s = ToolCallStream(HermesToolParser())
    assert s.feed("Hi <tool") == ("Hi ", [])
    assert s.feed("s are here") == ("<tools are here", [])
    assert s.finish() == ("", []) and not s.called
    s = ToolCallStream(HermesToolParser())
    assert s.feed("Hi <tool_") == ("Hi ", [])
    assert s.finish() == ("<tool_", [])


def test_stream_of_a_cut_off_call_is_not_complete():
    """A call cut off by max_tokens was streamed in part; the non-streaming answer has no
    call for it (all content), so the stream does not claim ``tool_calls`` either."""
    text = '<tool_call>{"name": "f", "arguments": {"a": '
    content, calls, _, s = _stream(HermesToolParser(), text, 4)
    assert content == "" and calls[0][1:] == ("f", '{"a": ') and s.called
    assert not s.complete and extract_tool_calls(HermesToolParser(), text) == (text, [])
    _, _, _, s = _stream(HermesToolParser(), HERMES, 4)
    assert s.complete


def test_stream_max_calls_sends_the_first_call_only():
    _, calls, _, _ = _stream(HermesToolParser(), HERMES, 5, max_calls=1)
    assert [n for _, n, _ in calls] == ["get_weather"]


LLAMA = '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", ' \
        '"arguments": {"tz": "UTC"}}'


def test_llama3_json():
    p = Llama3JsonToolParser()
    content, calls = extract_tool_calls(p, LLAMA)
    assert content is None and _calls(calls) == [("get_weather", '{"city": "Rome"}'),
                                                       ("get_time", '{"tz": "UTC"}')]
    content, calls = extract_tool_calls(p, 'Calling.<|python_tag|>{"name": "f", '
                                           '"parameters": {}}')
    assert content == "Calling." and _calls(calls) == [("f", "{}")]
    for text in ("No tools needed.", '{"city": "Rome"}', '{"name": "f", "parameters": 3}',
                 '{"name": "f", "parameters": {}} trailing'):
        assert extract_tool_calls(p, text) == (text, [])
    for step in (1, 5, 1000):
        content, calls, _, _ = _stream(p, LLAMA, step)
        assert content == "" and [(n, a) for _, n, a in calls] == \
            [("get_weather", '{"city": "Rome"}'), ("get_time", '{"tz": "UTC"}')]
        content, calls, _, s = _stream(p, "  Plain text.", step)
        assert content == "  Plain text." and not s.called


def test_forced_choice_parsers():
    arr = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, ' \
          '{"name": "get_time", "parameters": {}}]'
    assert _calls(extract_tool_calls(JsonArrayToolParser(), arr)[1]) == \
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    content, calls, _, _ = _stream(JsonArrayToolParser(), arr, 2)
    assert content == "" and [(n, a) for _, n, a in calls] == \
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    named = NamedToolParser("get_weather")
    assert _calls(extract_tool_calls(named, '{"city": "Oslo"}')[1]) == \
        [("get_weather", '{"city": "Oslo"}')]
    assert extract_tool_calls(named, '{"city": "Os') == ('{"city": "Os', [])   # cut off
    content, calls, deltas, _ = _stream(named, '{"city": "Oslo"}', 3)
    assert calls[0][1:] == ("get_weather", '{"city": "Oslo"}')
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": '{"c'}


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json"]
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'qwen'; known: "
                                         "hermes, llama3_json"):
        get_tool_parser("qwen")


def test_plan_defaults_and_forced_schemas():
    assert plan_tools(None, None, None, None).mode == "none"
    assert plan_tools([WEATHER], "none", None, None).mode == "none"
    auto = plan_tools([WEATHER], None, None, "hermes")
    assert auto.mode == "auto" and isinstance(auto.parser, HermesToolParser)
    assert auto.schema is None and auto.max_calls is None
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                       None, None)
    assert named.mode == "named" and named.schema == {"type": "object", "properties": {}}
    assert plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}},
                      None, None).schema == WEATHER["function"]["parameters"]
    req = plan_tools([WEATHER, TIME], "required", False, None)
    assert req.mode == "required" and req.max_calls == 1
    assert req.schema == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"type": "string", "enum": ["get_weather"]},
            "parameters": WEATHER["function"]["parameters"]}},
        {"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"type": "string", "enum": ["get_time"]},
            "parameters": {"type": "object", "properties": {}}}}]}}
    assert "maxItems" not in required_schema(req.tools, None)


def test_required_schema_compiles_and_accepts_the_parsers_format():
    """The schema of a forced choice compiles with the grammar backend the engine uses,
    and the text it allows is what JsonArrayToolParser reads."""
    xgr = pytest.importorskip("xgrammar")
    schema = plan_tools([WEATHER, TIME], "required", None, None).schema
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert xgr.testing._is_grammar_accept_string(grammar, text)
    assert not xgr.testing._is_grammar_accept_string(
        grammar, '[{"name": "get_wind", "parameters": {}}]')
    assert _calls(extract_tool_calls(JsonArrayToolParser(), text)[1]) == \
        [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("tools, choice, param, message", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice",
     "function 'nope' is not among the tools"),
    (None, "required", "tool_choice", "needs tools"),
    (None, {"type": "function", "function": {"name": "f"}}, "tool_choice", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice", "must be 'none', 'auto', 'required'"),
    ([WEATHER], {"type": "function"}, "tool_choice", "a named tool choice is"),
    ([WEATHER], "auto", "tool_choice", "requires the server to run with "
                                       "--enable-auto-tool-choice"),
    ([{"type": "function", "function": {"description": "x"}}], "none", "tools",
     "tools[0].function.name: must be 1-64"),
    ([{"type": "retrieval"}], "none", "tools", "tools[0]: must be an object with type"),
    ([WEATHER, WEATHER], "none", "tools", "tools[1].function.name: 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "none", "tools",
     "tools[0].function.parameters: must be a JSON schema object"),
])
def test_plan_refusals_name_the_field(tools, choice, param, message):
    with pytest.raises(ToolRequestError) as e:
        plan_tools(tools, choice, None, None)
    assert e.value.param == param and message in e.value.message


def test_template_message_parses_tool_call_arguments():
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    assert template_message("assistant", "", calls, None, None, 1) == {
        "role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert template_message("tool", "12 C", None, "call_1", None, 2) == {
        "role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    with pytest.raises(ToolRequestError) as e:
        template_message("assistant", "", [{"function": {"name": "f", "arguments": "{x"}}],
                         None, None, 3)
    assert e.value.param == "messages[3].tool_calls[0].function.arguments"


def test_serve_flags_are_vllms_pair(capsys):
    """``--enable-auto-tool-choice`` needs ``--tool-call-parser`` (refused before anything
    starts); the parser name is one of the registry's."""
    from tandem.router.cli import build_parser, main

    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert capsys.readouterr().err == "error: --enable-auto-tool-choice: needs " \
                                      "--tool-call-parser\n"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--tool-call-parser", "qwen"])
    assert e.value.code == 2
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "llama3_json"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
