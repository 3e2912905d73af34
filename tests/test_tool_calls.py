"""Tool calls in Gemma 4's format read out of model text (rvcompile/runtime/serve/tool_calls.py)
and the tool fields of a chat request (serve/tools.py), without a model.

- A corpus of answers in Gemma 4's call syntax, well formed and broken: each gives exactly the
  content and calls listed; broken or undeclared calls come back as text, markers and all;
  text that only looks like a call stays text.
- Streaming: feeding an answer in pieces of any size (one character, random cuts) gives the
  same content and calls as the whole answer, and never holds back text that cannot become a
  call.
- Request checks: names, duplicates, tool_choice; required/named plan a forced-call grammar
  (the grammar the sampler enforces), assistant calls' arguments, tool messages answering a call.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from rvcompile.runtime.serve import tool_calls as tc
from rvcompile.runtime.serve import tools
from rvcompile.runtime.serve.server import ChatCompletionRequest

Q = '<|"|>'
NAMES = frozenset({"get_weather", "search", "noargs"})


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{args}<tool_call|>"


# (answer, expected content, expected [(name, arguments as objects)])
CORPUS = [
    # plain text, and text that only looks like a call
    ("In the beginning.", "In the beginning.", []),
    ("call:get_weather{city:<|\"|>Paris<|\"|>}", "call:get_weather{city:<|\"|>Paris<|\"|>}", []),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
     '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', []),
    ("a <tool_call|> b <|tool_call", "a <tool_call|> b <|tool_call", []),
    ("<|tool_call> is how a call starts", "<|tool_call> is how a call starts", []),
    # well-formed calls
    (call("get_weather", "{city:" + Q + "Paris" + Q + "}"), None,
     [("get_weather", {"city": "Paris"})]),
    (call("noargs", "{}"), None, [("noargs", {})]),
    (call("search", "{ q : " + Q + "a, b: {c}" + Q + " , n:3, f:-1.5e2, ok:true, no:false, "
          "none:null, xs:[1,[2,3],{k:" + Q + "v" + Q + "}], o:{deep:{er:[]}}}"), None,
     [("search", {"q": "a, b: {c}", "n": 3, "f": -150.0, "ok": True, "no": False,
                  "none": None, "xs": [1, [2, 3], {"k": "v"}], "o": {"deep": {"er": []}}})]),
    (call("search", '{"q":"json \\"quoted\\" \\u00e9", ' + Q + "k2" + Q + ":1}"), None,
     [("search", {"q": 'json "quoted" é', "k2": 1})]),
    (call("search", "{q:" + Q + "multi\nline <turn|> text" + Q + "}"), None,
     [("search", {"q": "multi\nline <turn|> text"})]),
    ("Let me check. " + call("get_weather", "{city:" + Q + "Oslo" + Q + "}"), "Let me check. ",
     [("get_weather", {"city": "Oslo"})]),
    (call("get_weather", "{city:" + Q + "A" + Q + "}") + "\n"
     + call("get_weather", "{city:" + Q + "B" + Q + "}"), None,
     [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    # broken calls: text, markers and all; good calls beside them still count
    (call("get_weather", "{city:" + Q + "Paris}"), call("get_weather", "{city:" + Q + "Paris}"),
     []),
    (call("get_weather", "{city:Paris}"), call("get_weather", "{city:Paris}"), []),
    (call("get_weather", "{city:" + Q + "P" + Q), call("get_weather", "{city:" + Q + "P" + Q),
     []),
    (call("get_weather", "{city:" + Q + "P" + Q + "} trailing"),
     call("get_weather", "{city:" + Q + "P" + Q + "} trailing"), []),
    (call("get_weather", "{a:1,a:2}"), call("get_weather", "{a:1,a:2}"), []),
    (call("get_weather", "{a:1,}"), call("get_weather", "{a:1,}"), []),
    (call("get_weather", "{a:01}"), call("get_weather", "{a:01}"), []),
    (call("get_weather", "{a:1e999}"), call("get_weather", "{a:1e999}"), []),
    (call("get_weather", "{a:tru}"), call("get_weather", "{a:tru}"), []),
    (call("get_weather", "{a:[1 2]}"), call("get_weather", "{a:[1 2]}"), []),
    (call("get_weather", "[1]"), call("get_weather", "[1]"), []),
    (call("get_weather", "{a:" + "[" * 80 + "]" * 80 + "}"),
     call("get_weather", "{a:" + "[" * 80 + "]" * 80 + "}"), []),
    ("<|tool_call>get_weather{}<tool_call|>", "<|tool_call>get_weather{}<tool_call|>", []),
    (call("rm_rf", "{}"), call("rm_rf", "{}"), []),  # not a declared tool
    (call("get weather", "{}"), call("get weather", "{}"), []),
    ("<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + "}",  # never closed
     "<|tool_call>call:get_weather{city:" + Q + "Paris" + Q + "}", []),
    (call("get_weather", "{city:1}") + " and " + call("nope", "{}"), " and " + call("nope", "{}"),
     [("get_weather", {"city": 1})]),
]


def expected(case):
    text, content, calls = case
    return content, [(n, a) for n, a in calls]


def got(message: tc.Message):
    return message.content, [(c.name, json.loads(c.arguments)) for c in message.calls]


@pytest.mark.parametrize("case", CORPUS, ids=[str(i) for i in range(len(CORPUS))])
def test_corpus_whole_and_streamed(case):
    text = case[0]
    whole = tc.parse_message(text, NAMES, parallel=True, new_id=ids())
    assert got(whole) == expected(case)
    assert [c.id for c in whole.calls] == [f"call_{i}" for i in range(len(whole.calls))]
    for arguments in (c.arguments for c in whole.calls):
        assert isinstance(json.loads(arguments), dict)
    rng = random.Random(sum(map(ord, text)))
    for cuts in ([1] * len(text), [rng.randint(1, 7) for _ in text]):
        stream, pieces, at = tc.CallStream(NAMES, True, ids()), [], 0
        for n in cuts:
            pieces += stream.feed(text[at:at + n])
            at += n
        pieces += stream.finish()
        content = "".join(p.text for p in pieces)
        calls = [p.call for p in pieces if p.call is not None]
        assert calls == list(whole.calls)
        assert content == (whole.content or "") or (whole.content is None and not
                                                     content.strip())


def test_stream_holds_back_only_what_may_become_a_call():
    s = tc.CallStream(NAMES, True, ids())
    assert s.feed("Hello <|tool") == [tc.Piece(text="Hello ")]
    assert s.feed("_cal") == []
    assert s.feed("x and on") == [tc.Piece(text="<|tool_calx and on")]
    assert s.feed("<|tool_call>call:noargs{") == []
    assert s.feed("}<tool_call|> done") == [tc.Piece(call=tc.ToolCall("call_0", "noargs", "{}")),
                                            tc.Piece(text=" done")]
    assert s.finish() == []


def test_parallel_false_keeps_only_the_first_call():
    text = call("noargs", "{}") + call("get_weather", "{city:" + Q + "B" + Q + "}")
    m = tc.parse_message(text, NAMES, parallel=False, new_id=ids())
    assert [c.name for c in m.calls] == ["noargs"]
    assert m.content == call("get_weather", "{city:" + Q + "B" + Q + "}")


def test_non_ascii_arguments_stay_readable_json():
    m = tc.parse_message(call("search", "{q:" + Q + "Ἐν ἀρχῇ" + Q + "}"), NAMES, True, ids())
    assert m.calls[0].arguments == '{"q": "Ἐν ἀρχῇ"}'


# ------------------------------------------------------------------------------ request checks

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return ChatCompletionRequest.model_validate(body, strict=True)


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def plan_of(**fields) -> tools.ToolPlan:
    r = request(**fields)
    return tools.plan(r.tools, r.tool_choice, r.parallel_tool_calls)


def test_tool_plans():
    p = plan_of(tools=[WEATHER])
    assert p.parse and p.names == {"get_weather"} and p.parallel
    assert p.tools == [WEATHER]
    p = plan_of(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False)
    assert not p.parse and p.tools is None
    p = plan_of()
    assert not p.parse and p.tools is None


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "declared twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters", "type object"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": nested(40)}}}}]}, "tools[0].function.parameters",
     "nested deeper than 32"),
])
def test_bad_tool_fields(fields, param, words):
    with pytest.raises(tools.ToolRequestError) as e:
        plan_of(**fields)
    assert e.value.param == param and words in str(e.value)


def test_required_and_named_plan_a_forced_call_grammar():
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        p = plan_of(tools=[WEATHER], tool_choice=choice)
        assert p.parse and p.grammar is not None and "call:get_weather{" in p.grammar
    assert plan_of(tools=[WEATHER], tool_choice="auto").grammar is None


def test_forced_call_grammar_names_the_allowed_functions():
    r = request(tools=[WEATHER, {"type": "function", "function": {"name": "noargs"}}])
    named = tools.NamedToolChoice.model_validate({"type": "function",
                                                  "function": {"name": "get_weather"}})
    one = tools.forced_call_grammar(r.tools, named, parallel=False)
    assert "call:get_weather{" in one and "call:noargs" not in one
    assert one.startswith("start: ") and "+" not in one.splitlines()[0]
    both = tools.forced_call_grammar(r.tools, "required", parallel=True)
    assert "call:get_weather{" in both and "call:noargs{" in both
    assert both.splitlines()[0].endswith("+")


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_template_messages_tie_tool_answers_to_calls():
    r = request(messages=[{"role": "user", "content": "Weather?"}, ASSISTANT_CALL,
                          {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                          {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}])
    assert tools.template_messages(r.messages) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]


def with_call(arguments: str) -> dict:
    return {**ASSISTANT_CALL, "tool_calls": [{**ASSISTANT_CALL["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": arguments}}]}


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "Hi"}, with_call("{bad")],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "Hi"}, with_call("[1]")],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "Hi"}, with_call('{"a": NaN}')],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "Hi"}, with_call('{"a":' * 40 + "1" + "}" * 40)],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "c1",
                                          "content": "x"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "Hi"}, ASSISTANT_CALL,
      {"role": "tool", "tool_call_id": "c9", "content": "x"}], "messages[2].tool_call_id"),
    ([{"role": "user", "content": "Hi"}, ASSISTANT_CALL, {"role": "tool", "content": "x"}],
     "messages[2].tool_call_id"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "Hi", "tool_calls": ASSISTANT_CALL["tool_calls"]}],
     "messages[0].tool_calls"),
    ([{"role": "user", "content": "Hi", "tool_call_id": "c1"}], "messages[0].tool_call_id"),
])
def test_bad_messages(messages, param):
    with pytest.raises(tools.ToolRequestError) as e:
        tools.template_messages(request(messages=messages).messages)
    assert e.value.param == param
