"""The tool-calling fields of a chat request, checked and turned into what the chat template
and the answer's parser (tool_calls.py) need.

- `tools` (OpenAI function tools: a name of 1-64 letters, digits, `_` or `-`, unique; an
  optional description; `parameters` a JSON Schema object) reach the template as given; Gemma
  4's template renders them as `<|tool>declaration:...<tool|>` in its system turn.
- `tool_choice`: "auto" (the default with tools): the template declares the tools and calls
  in the answer are parsed; "none" (the default without): the tools are left out of the prompt
  and the answer is text. "required" and a named function need the answer constrained to a
  call, which takes a grammar-constrained sampler (structured outputs, issue 16 item 3): until
  the server has one they are refused with 400 rather than promised and not kept.
  `forced_call_grammar` is the integration point: the grammar (Gemma 4's call syntax, the
  arguments following the tools' schemas) such a sampler must enforce.
- `parallel_tool_calls` false: only the first call of an answer is a call (later ones stay text).
- messages: an assistant message may carry `tool_calls` (its arguments a JSON object's text,
  given to the template as the object); a `tool` message answers one of the calls of the
  assistant message before it (`tool_call_id`). Anything else is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from rvcompile.runtime.serve import tool_grammar

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_DEPTH = 32  # nesting of a tool's parameters or a call's arguments (the template recurses)


class ToolRequestError(ValueError):
    """A tool field of a request that cannot be served: `param` names it (a 400)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of an object


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools."""

    tools: list[dict] | None  # what the template declares (None: no tools in the prompt)
    names: frozenset[str]  # the tools a call may name
    parse: bool  # read calls out of the answer
    parallel: bool  # more than one call per answer
    grammar: str | None = None  # "required" / named: the Lark grammar the answer must follow


def plan(tools: list[Tool] | None, tool_choice: ToolChoice | None,
         parallel_tool_calls: bool) -> ToolPlan:
    """The request's tool fields checked (ToolRequestError otherwise)."""
    tools = tools or []
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise ToolRequestError(f"tools[{i}].function.name", f"{name!r} must be 1 to 64 "
                                   "letters, digits, underscores or dashes")
        if name in names:
            raise ToolRequestError(f"tools[{i}].function.name", f"{name!r} is declared twice")
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ToolRequestError(f"tools[{i}].function.parameters",
                                   "must be a JSON Schema of type object")
        _check_depth(parameters, f"tools[{i}].function.parameters")
        names.append(name)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise ToolRequestError("tool_choice", "needs tools to choose from")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ToolRequestError("tool_choice", f"names the function {choice.function.name!r}, "
                                              "which is not among the tools")
    if choice == "none":
        return ToolPlan(None, frozenset(), parse=False, parallel=parallel_tool_calls)
    grammar = None
    if choice == "required" or isinstance(choice, NamedToolChoice):
        try:  # the sampler's token mask then keeps the answer to calls of the allowed functions
            grammar = forced_call_grammar(tools, choice, parallel_tool_calls)
        except tool_grammar.GrammarError as e:
            raise ToolRequestError(e.param, str(e).removeprefix(f"{e.param}: ")) from e
    declared = [tool.model_dump(exclude_none=True) for tool in tools]
    return ToolPlan(declared, frozenset(names), parse=True, parallel=parallel_tool_calls,
                    grammar=grammar)


def forced_call_grammar(tools: list[Tool], tool_choice: ToolChoice, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) an answer must follow under a "required" or
    named `tool_choice`: calls in Gemma 4's syntax of the allowed functions, their arguments
    following the parameters' schemas (serve/tool_grammar.py). GrammarError names a tool
    whose parameters it cannot express."""
    allowed = [t.function.name for t in tools if tool_choice == "required"
               or (isinstance(tool_choice, NamedToolChoice)
                   and t.function.name == tool_choice.function.name)]
    if not allowed:
        raise ToolRequestError("tool_choice", "forces no declared function")
    return tool_grammar.call_grammar([t.model_dump(exclude_none=True) for t in tools], allowed,
                                     parallel)


def template_messages(messages: list) -> list[dict]:
    """The request's messages as the chat template reads them: content as text or text parts,
    an assistant's calls with their arguments as objects, tool answers tied to their call."""
    out: list[dict] = []
    open_calls: set[str] = set()  # ids of the calls the tool messages here may answer
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        entry: dict[str, Any] = {"role": m.role, "content": _content(m.content)}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls is not None and m.role != "assistant":
            raise ToolRequestError(f"{where}.tool_calls", "only an assistant message has calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise ToolRequestError(f"{where}.tool_call_id", "only a tool message has one")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise ToolRequestError(f"{where}.content", "is required (only an assistant message "
                                                       "with tool_calls may leave it out)")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ToolRequestError(f"{where}.tool_call_id", "is required in a tool message")
            if m.tool_call_id not in open_calls:
                raise ToolRequestError(f"{where}.tool_call_id", f"{m.tool_call_id!r} answers no "
                                       "call of the assistant message before it")
            entry["tool_call_id"] = m.tool_call_id
        else:
            open_calls = set()
        if m.role == "assistant" and m.tool_calls:
            entry["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]")
                                   for j, c in enumerate(m.tool_calls)]
            open_calls = {c.id for c in m.tool_calls}
        out.append(entry)
    return out


def _content(content) -> str | list[dict] | None:
    if content is None or isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def _call(call: AssistantToolCall, where: str) -> dict:
    def no_constant(name: str):
        raise json.JSONDecodeError(f"{name} is not a number", call.function.arguments, 0)

    try:
        arguments = json.loads(call.function.arguments, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise ToolRequestError(f"{where}.function.arguments", f"not JSON ({e.msg})") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{where}.function.arguments", "must be a JSON object")
    _check_depth(arguments, f"{where}.function.arguments")
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def _check_depth(value: object, where: str) -> None:
    """Refuse JSON nested deeper than MAX_DEPTH (checked without recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise ToolRequestError(where, f"nested deeper than {MAX_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
