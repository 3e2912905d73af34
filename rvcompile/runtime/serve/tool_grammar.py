"""The grammar a forced tool call must follow, for a grammar-constrained sampler.

`tool_choice: "required"` or a named function asks for an answer that is a call (or, with
`parallel_tool_calls`, calls) and nothing else. `call_grammar` writes that language as a Lark
grammar in llguidance's dialect, in Gemma 4's call syntax as its chat template renders calls
(models/rv-gemma4-tiny/chat_template.jinja) and tool_calls.py parses them:
`<|tool_call>call:NAME{key:value,...}<tool_call|>`, keys in sorted order (the template's
dictsort), each required property present, strings between `<|"|>` marks (without `<|` inside
them), values following the parameters' JSON Schema where it says `type` (string with or without
`enum`, integer, number, boolean, null or `nullable`, array with `items`, object with
`properties`); where the schema says less (no type, `anyOf`, an object without properties) any
value of the syntax. So every text the grammar accepts parses (tool_calls.parse_call) to a call
of an allowed tool whose arguments have the required keys and the declared types.

This module makes the grammar only; the sampler that masks tokens with it is issue 16 item 3.
"""

from __future__ import annotations

import json
import re

from rvcompile.runtime.serve.tool_calls import CLOSE, OPEN, QUOTE

_KEY = re.compile(r"[A-Za-z0-9_$.-]+")
_MAX_DEPTH = 16  # schemas nested deeper are refused (a request, not a grammar, limits this)

# Terminals shared by every grammar: text between quote marks holds no "<|" and does not end
# in "<"; numbers as JSON writes them, those with a fraction or exponent within float range
# (at most 16 digits before the point, exponents of at most 2 digits); bare keys as the
# template writes them.
_COMMON = r"""
QSTR: /<\|"\|>(?:[^<]|<+[^<|])*<\|"\|>/
INT: /-?(?:0|[1-9][0-9]*)/
NUM: /-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]+)?(?:[eE][+-]?[0-9]{1,2})?/
BARE: /[A-Za-z0-9_$.-]+/
any: QSTR | NUM | "true" | "false" | "null" | any_list | any_map
any_list: "[" (any ("," any)*)? "]"
any_map: "{" (BARE ":" any ("," BARE ":" any)*)? "}"
"""


class GrammarError(ValueError):
    """A tool whose parameters the call grammar cannot express (a 400 naming `param`)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


class _Writer:
    def __init__(self):
        self.rules: list[str] = []
        self.count = 0

    def rule(self, body: str) -> str:
        name = f"r{self.count}"
        self.count += 1
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: object, where: str, depth: int) -> str:
        """A rule (or terminal) for values of `schema`."""
        if depth > _MAX_DEPTH:
            raise GrammarError(where, f"nested more than {_MAX_DEPTH} levels")
        if not isinstance(schema, dict) or not isinstance(schema.get("type"), str):
            return "any"
        kind = schema["type"]
        if kind == "string" and isinstance(schema.get("enum"), list) and schema["enum"]:
            options = []
            for choice in schema["enum"]:
                if not isinstance(choice, str) or "<|" in choice or choice.endswith("<"):
                    raise GrammarError(f"{where}.enum", f"{choice!r} cannot be a quoted string")
                options.append(_literal(QUOTE + choice + QUOTE))
            body = " | ".join(options)
        elif kind == "string":
            body = "QSTR"
        elif kind == "integer":
            body = "INT"
        elif kind == "number":
            body = "NUM"
        elif kind == "boolean":
            body = '"true" | "false"'
        elif kind == "null":
            body = '"null"'
        elif kind == "array":
            item = self.value(schema.get("items"), f"{where}.items", depth + 1)
            body = f'"[" ({item} ("," {item})*)? "]"'
        elif kind == "object" and isinstance(schema.get("properties"), dict) \
                and schema["properties"]:
            body = f'"{{" {self.properties(schema, where, depth)} "}}"'
        elif kind == "object":
            body = "any_map"
        else:
            return "any"
        if schema.get("nullable"):
            body = f'{body} | "null"'
        return self.rule(body)

    def properties(self, schema: dict, where: str, depth: int) -> str:
        """A rule for `key:value` pairs of an object schema: sorted keys, required ones
        present, optional ones possibly left out, commas between."""
        props = schema["properties"]
        required = schema.get("required") or []
        for key in props:
            if not _KEY.fullmatch(key):
                raise GrammarError(f"{where}.properties", f"the key {key!r} cannot be written "
                                                          "bare in a call")
        for key in required:
            if key not in props:
                raise GrammarError(f"{where}.required", f"{key!r} is not among the properties")
        keys = sorted(props)
        values = [self.value(props[k], f"{where}.properties.{k}", depth + 1) for k in keys]
        memo: dict[tuple[int, bool], str] = {}

        def pairs(i: int, lead: bool) -> str:
            """The pairs from keys[i] on ("" for none); `lead`: a comma comes first."""
            if i == len(keys):
                return ""
            if (i, lead) not in memo:
                comma = '"," ' if lead else ""
                taken = f"{comma}{_literal(keys[i] + ':')} {values[i]} {pairs(i + 1, True)}"
                skipped = pairs(i + 1, lead)
                if keys[i] in required:
                    body = taken
                elif skipped:
                    body = f"{taken} | {skipped}"
                else:
                    body = f"({taken})?"
                memo[i, lead] = self.rule(body.strip())
            return memo[i, lead]

        return pairs(0, False)


def _literal(text: str) -> str:
    return json.dumps(text)


def call_grammar(tools: list[dict], allowed: list[str], parallel: bool) -> str:
    """The Lark grammar of an answer that is one call (or, with `parallel`, one or more calls)
    of the functions named `allowed`, among `tools` (OpenAI function tools as dicts)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    writer = _Writer()
    calls = []
    for name in allowed:
        i = list(by_name).index(name)
        parameters = by_name[name].get("parameters") or {"type": "object"}
        where = f"tools[{i}].function.parameters"
        if isinstance(parameters.get("properties"), dict) and parameters["properties"]:
            body = writer.properties(parameters, where, 0)
        else:
            body = '(BARE ":" any ("," BARE ":" any)*)?'
        calls.append(writer.rule(f'{_literal(OPEN + "call:" + name + "{")} {body} '
                                 f'{_literal("}" + CLOSE)}'))
    one = writer.rule(" | ".join(calls))
    start = f"start: {one}+" if parallel else f"start: {one}"
    return "\n".join([start, *writer.rules]) + "\n" + _COMMON
