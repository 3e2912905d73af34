"""The grammar of a forced tool call (rvcompile/runtime/serve/tool_grammar.py), run by llguidance
over the default model's tokenizer (skipped where llguidance is not installed: it comes with
structured outputs, issue 16 item 3).

- It compiles without warnings; the calls it accepts are those tool_calls.py parses, with the
  required keys, in sorted order and of the declared types; it refuses text, missing required
  keys, keys out of order, values of the wrong type or outside an enum, undeclared tools, and a
  second call without parallel_tool_calls.
- Random walks through its token mask (seeded; each step an allowed token, drawn uniformly or
  among the syntax's characters) end in text that parses to a call of an allowed tool whose
  arguments fit the schema.
- Tool schemas it cannot express are refused naming the field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from rvcompile.runtime.serve import tool_calls
from rvcompile.runtime.serve.tool_grammar import GrammarError, call_grammar

llguidance = pytest.importorskip("llguidance")

TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny" / "tokenizer.json"
Q = '<|"|>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "tags": {"type": "array", "items": {"type": "boolean"}},
        "at": {"type": "object", "properties": {"lat": {"type": "number"},
                                                "note": {"type": "string", "nullable": True}},
               "required": ["lat"]}}}}}
NOARGS = {"type": "function", "function": {"name": "noargs"}}
TOOLS = [WEATHER, NOARGS]


@pytest.fixture(scope="module")
def tokenizer():
    return llguidance.LLTokenizer(TOKENIZER.read_text(), eos_token=1)


def matcher(tokenizer, allowed=("get_weather", "noargs"), parallel=True):
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(TOOLS, list(allowed),
                                                                  parallel))
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer) == (False, [])
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


def accepts(tokenizer, text, **kw) -> bool:
    m = matcher(tokenizer, **kw)
    return m.consume_tokens(tokenizer.tokenize_str(text)) and m.is_accepting()


def call(name, args):
    return f"<|tool_call>call:{name}{args}<tool_call|>"


GOOD = [
    call("get_weather", "{city:" + Q + "Paris" + Q + "}"),
    call("get_weather", "{at:{lat:-1.5e3,note:null},city:" + Q + "a<b" + Q + ",days:3,"
         "tags:[true,false],unit:" + Q + "f" + Q + "}"),
    call("get_weather", "{city:" + Q + "" + Q + ",tags:[]}"),
    call("noargs", "{}"),
    call("noargs", "{x:[1,{y:" + Q + "z" + Q + "}],w:null}"),
    call("noargs", "{}") + call("get_weather", "{city:" + Q + "B" + Q + "}"),
]
BAD = [
    "Hello",
    call("get_weather", "{}"),  # city is required
    call("get_weather", "{days:3,city:" + Q + "P" + Q + "}"),  # keys out of order
    call("get_weather", "{city:3}"),
    call("get_weather", "{city:" + Q + "P" + Q + ",days:3.5}"),
    call("get_weather", "{city:" + Q + "P" + Q + ",unit:" + Q + "k" + Q + "}"),
    call("get_weather", "{city:" + Q + "P" + Q + ",at:{note:null}}"),  # lat is required
    call("get_weather", "{city:" + Q + "a<|b" + Q + "}"),
    call("get_weather", "{city:" + Q + "P" + Q + ",more:1}"),
    call("launch", "{}"),
    call("get_weather", "{city:" + Q + "P" + Q + "}") + " and text",
]


@pytest.mark.parametrize("text", GOOD)
def test_accepted_calls_parse(tokenizer, text):
    assert accepts(tokenizer, text)
    message = tool_calls.parse_message(text, frozenset({"get_weather", "noargs"}), True)
    assert message.content is None and message.calls


@pytest.mark.parametrize("text", BAD)
def test_refused(tokenizer, text):
    assert not accepts(tokenizer, text)


def test_named_and_single_calls(tokenizer):
    assert not accepts(tokenizer, call("noargs", "{}"), allowed=("get_weather",))
    assert not accepts(tokenizer, GOOD[-1], parallel=False)
    assert accepts(tokenizer, GOOD[0], parallel=False)


def fits(value, schema) -> bool:
    kind = schema.get("type")
    if value is None:
        return bool(schema.get("nullable")) or kind is None
    if kind == "string":
        return isinstance(value, str) and value in schema.get("enum", [value])
    if kind == "integer":
        return type(value) is int
    if kind == "number":
        return type(value) in (int, float)
    if kind == "boolean":
        return type(value) is bool
    if kind == "array":
        return isinstance(value, list) and all(fits(v, schema["items"]) for v in value)
    if kind == "object" and "properties" in schema:
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
                <= set(schema["properties"])
                and all(fits(v, schema["properties"][k]) for k, v in value.items()))
    return True


def test_random_walks_give_valid_calls(tokenizer):
    rng = random.Random(0)
    names = frozenset({"get_weather", "noargs"})
    fresh = matcher(tokenizer)
    # most draws, where one is allowed, a token of the syntax: walks get out of strings
    structural = {t for t in range(8192) if tokenizer.decode_str([t]) in set('<|">}],:')}
    checked = 0
    for _ in range(80):
        m = fresh.deep_copy()
        ids: list[int] = []
        for _ in range(250):
            mask = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8),
                                 bitorder="little")
            allowed = np.flatnonzero(mask[:8192]).tolist()
            if m.is_accepting() and (rng.random() < 0.3 or allowed == [1]):
                break
            closing = [t for t in allowed if t in structural]
            token = rng.choice(closing if closing and rng.random() < 0.6 else
                               [t for t in allowed if t != 1])
            assert m.consume_token(token)
            ids.append(token)
        else:
            continue  # a walk still inside a long string: nothing to check
        text = tokenizer.decode_str(ids)
        message = tool_calls.parse_message(text, names, True)
        assert message.content is None and message.calls, text
        for c in message.calls:
            schema = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
            assert fits(json.loads(c.arguments), schema[c.name] or {}), text
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("tool, param", [
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a b": {"type": "string"}}}}},
     "tools[0].function.parameters.properties"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}}},
     "tools[0].function.parameters.required"),
    ({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "enum": ["x<|y"]}}}}},
     "tools[0].function.parameters.properties.a.enum"),
])
def test_schemas_it_cannot_express(tool, param):
    with pytest.raises(GrammarError) as e:
        call_grammar([tool], ["f"], True)
    assert e.value.param == param
